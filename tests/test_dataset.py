"""`vault dataset add|checkout|diff` against a real `vault serve`: trees round-trip byte for byte
and mode for mode, unchanged files are not sent again, and a bad manifest or tree is refused
with one line naming the problem and nothing written."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, command_env
from tests.terminal import run_on_terminal
from vault.errors import FailedPrecondition, InvalidArgument
from vault.files import size_text
from vault.runs import dataset
from vault.runs.dataset import add_dataset
from vault.store.hashcache import RACY, HashCache
from vault.store.manifest import FileEntry, build_manifest, decode_manifest, encode_manifest


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write(root: Path, path: str, data: bytes, mode: int = 0o644) -> None:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    target.chmod(mode)


def make_tree(root: Path, tag: str) -> Path:
    write(root, "README.md", f"dataset {tag}\n".encode())
    write(root, "train/part-0.bin", os.urandom(300_000))
    write(root, "train/part-1.bin", os.urandom(70_000), 0o600)
    write(root, "eval/b.txt", b"b\n")
    write(root, "eval/a.txt", b"a\n")
    write(root, "run.sh", b"#!/bin/sh\necho hi\n", 0o755)
    write(root, "empty", b"", 0o444)
    write(root, "données/é.csv", b"x,y\n1,2\n")
    return root


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every regular file under root: its bytes and permission bits (and nothing else there)."""
    found: dict[str, tuple[bytes, int]] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode):
            continue
        assert stat.S_ISREG(info.st_mode), path
        found[path.relative_to(root).as_posix()] = (path.read_bytes(), stat.S_IMODE(info.st_mode))
    return found


def add(server: VaultServer, folder: Path, *args: str) -> dict[str, object]:
    result: dict[str, object] = (
        server.run("dataset", "add", str(folder), "--json", *args).ok().json()
    )
    return result


def put_manifest(server: VaultServer, data: bytes) -> str:
    with server.client() as client:
        return str(client.put(data).blob.sha256)


def test_add_then_checkout_round_trips_bytes_and_modes(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    source = make_tree(tmp_path / "source", "round trip")
    printed = vault_server.run("dataset", "add", str(source), "--name", "mnist").ok().stdout
    digest = printed.strip()
    assert printed == f"{digest}\n" and digest.startswith("sha256:")

    target = tmp_path / "out" / "checkout"
    run = vault_server.run("dataset", "checkout", digest, str(target)).ok()
    size = sum(len(data) for data, _ in tree(source).values())
    assert run.stdout == f"8 files, {size} bytes in {target}\n"
    assert tree(target) == tree(source)
    assert [p.name for p in target.parent.iterdir()] == ["checkout"]  # no staging left behind

    empty = tmp_path / "empty"
    empty.mkdir()
    vault_server.run("dataset", "checkout", digest, str(empty)).ok()
    assert tree(empty) == tree(source)

    (entry,) = vault_server.run("lookup", digest, "--json").ok().json()
    assert entry["kind"] == "dataset"
    assert entry["meta"] == {"name": "mnist", "files": "8"}


def test_printed_digest_is_the_sha256sum_of_the_manifest_blob(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    source = make_tree(tmp_path / "source", "sha256sum")
    write(source, "setuid", b"#!/bin/sh\n", 0o4750)
    digest = str(add(vault_server, source)["digest"])
    fetched = tmp_path / "manifest.json"
    vault_server.run("get", digest, "-o", str(fetched)).ok()
    out = subprocess.run(["sha256sum", str(fetched)], capture_output=True, check=True).stdout
    assert f"sha256:{out.split()[0].decode()}" == digest

    manifest = json.loads(fetched.read_bytes())
    assert manifest["v"] == 1
    paths = [f["path"] for f in manifest["files"]]
    assert paths == sorted(paths, key=lambda p: p.encode())
    assert "données/é.csv" in paths
    by_path = {f["path"]: f for f in manifest["files"]}
    assert by_path["run.sh"]["mode"] == "0755" and by_path["empty"]["mode"] == "0444"
    assert by_path["setuid"]["mode"] == "0750"  # permission bits only
    data = (source / "train/part-0.bin").read_bytes()
    assert by_path["train/part-0.bin"] == {
        "path": "train/part-0.bin",
        "size": len(data),
        "mode": "0644",
        "sha256": sha256(data),
    }
    # Canonical: RFC 8785 is sorted keys, no whitespace, UTF-8 as is.
    assert (
        fetched.read_bytes()
        == json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    )


def test_unchanged_files_are_not_sent_again_and_one_change_is_one_diff_line(
    start_vault: StartVault, tmp_path: Path
) -> None:
    vault_server = start_vault()  # a store of its own, so every blob in it is this test's
    source = make_tree(tmp_path / "source", "versions")
    first = add(vault_server, source)
    assert first["sent_files"] == 8 and first["files"] == 8
    blobs = vault_server.stored_files()

    again = add(vault_server, source)
    assert again["digest"] == first["digest"]
    assert (again["sent_files"], again["sent_bytes"]) == (0, 0)
    assert vault_server.stored_files() == blobs

    write(source, "eval/a.txt", b"a, revised\n")
    changed = add(vault_server, source)
    assert changed["digest"] != first["digest"]
    assert (changed["sent_files"], changed["sent_bytes"]) == (1, len(b"a, revised\n"))

    old, new = str(first["digest"]), str(changed["digest"])
    assert vault_server.run("dataset", "diff", old, new).ok().stdout == "M eval/a.txt\n"
    assert vault_server.run("dataset", "diff", old, new, "--json").ok().json() == {
        "added": [],
        "removed": [],
        "changed": ["eval/a.txt"],
    }

    (source / "run.sh").chmod(0o700)
    (source / "README.md").unlink()
    write(source, "eval/c.txt", b"c\n")
    moved = str(add(vault_server, source)["digest"])
    lines = vault_server.run("dataset", "diff", new, moved).ok().stdout.splitlines()
    assert lines == ["+ eval/c.txt", "- README.md", "M run.sh"]


def manifest_bytes(files: list[dict[str, object]], **extra: object) -> bytes:
    return json.dumps(
        {"v": 1, "files": files, **extra}, sort_keys=True, separators=(",", ":")
    ).encode()


A = sha256(b"a\n")


def file(path: str, sha: str = A, size: int = 2, mode: str = "0644") -> dict[str, object]:
    return {"path": path, "size": size, "mode": mode, "sha256": sha}


GOOD = manifest_bytes([file("a.txt"), file("d/a.txt")])
BAD_MANIFESTS = {
    "absolute path": (manifest_bytes([file("/etc/a.txt")]), "is absolute"),
    "dot-dot": (manifest_bytes([file("d/../../a.txt")]), "'..' component"),
    "empty component": (manifest_bytes([file("d//a.txt")]), "empty component"),
    "duplicate": (manifest_bytes([file("a.txt"), file("a.txt")]), "duplicate path 'a.txt'"),
    "file is a folder": (
        manifest_bytes([file("d"), file("d/a.txt")]),
        "'d' is a file and also the folder of 'd/a.txt'",
    ),
    "non-canonical": (GOOD.replace(b",", b", ", 1), "not in canonical form"),
    "unsorted": (manifest_bytes([file("d/a.txt"), file("a.txt")]), "not in canonical form"),
    "unknown field": (manifest_bytes([file("a.txt")], extra=1), "unknown field 'extra'"),
    "unknown version": (GOOD.replace(b'"v":1', b'"v":2'), "version 2 is not 1"),
    "bad digest": (manifest_bytes([file("a.txt", sha="sha256:abc")]), "bad digest"),
    "bad mode": (manifest_bytes([file("a.txt", mode="4755")]), "bad mode"),
    "one digest, two sizes": (
        manifest_bytes([file("a.txt"), file("b.txt", size=3)]),
        f"{A} is listed with sizes 2 and 3",
    ),
    "wrong size": (manifest_bytes([file("a.txt", size=3)]), "is 3 bytes, its blob"),
    # Deeper or longer than a checkout can create: refused by the one validator that
    # admission shares, not found out by a checkout halfway through.
    "2,000 folders deep": (
        manifest_bytes([file("a/" * 1999 + "f")]),
        "is 3999 bytes long (at most 2048)",
    ),
    "300 folders deep": (manifest_bytes([file("a/" * 299 + "f")]), "is 300 folders deep"),
    "a 256-byte name": (manifest_bytes([file("d/" + "n" * 256)]), "has a name of 256 bytes"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_a_bad_manifest_is_refused_naming_the_problem_and_nothing_is_written(
    vault_server: VaultServer, tmp_path: Path, case: str
) -> None:
    put_manifest(vault_server, b"a\n")
    data, problem = BAD_MANIFESTS[case]
    digest = put_manifest(vault_server, data)
    target = tmp_path / "target"
    line = vault_server.run("dataset", "checkout", digest, str(target)).error_line()
    assert problem in line, line
    assert list(tmp_path.iterdir()) == []


def test_the_good_manifest_of_those_cases_checks_out(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    put_manifest(vault_server, b"a\n")
    digest = put_manifest(vault_server, GOOD)
    vault_server.run("dataset", "checkout", digest, str(tmp_path / "t")).ok()
    assert tree(tmp_path / "t") == {"a.txt": (b"a\n", 0o644), "d/a.txt": (b"a\n", 0o644)}


def test_checkout_refuses_a_non_empty_folder_and_a_missing_manifest(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    digest = str(add(vault_server, make_tree(tmp_path / "source", "refusals"))["digest"])
    target = tmp_path / "busy"
    write(target, "keep.txt", b"mine")
    line = vault_server.run("dataset", "checkout", digest, str(target)).error_line()
    assert "not empty" in line, line
    assert tree(target) == {"keep.txt": (b"mine", 0o644)}

    unknown = sha256(b"no such manifest")
    line = vault_server.run("dataset", "checkout", unknown, str(tmp_path / "x")).error_line()
    assert "NOT_FOUND" in line and unknown in line, line
    assert not (tmp_path / "x").exists()


def test_symlinks_are_refused_and_one_escaping_the_tree_is_named_so(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    source = make_tree(tmp_path / "source", "links")
    before = vault_server.stored_files()
    (source / "eval" / "leak").symlink_to("../../outside.txt")
    line = vault_server.run("dataset", "add", str(source)).error_line()
    assert "'eval/leak' is a symlink to '../../outside.txt', which escapes the tree" in line
    (source / "eval" / "leak").unlink()
    (source / "abs").symlink_to("/etc/passwd")
    line = vault_server.run("dataset", "add", str(source)).error_line()
    assert "escapes the tree" in line, line
    (source / "abs").unlink()
    (source / "eval" / "alias").symlink_to("a.txt")
    line = vault_server.run("dataset", "add", str(source)).error_line()
    assert "'eval/alias' is a symlink to 'a.txt': a dataset holds no symlinks" in line
    assert vault_server.stored_files() == before


def test_manifest_functions_refuse_what_checkout_refuses() -> None:
    entries = [FileEntry("b", 2, 0o644, A), FileEntry("a", 2, 0o600, A)]
    manifest = build_manifest(entries)
    assert [f.path for f in manifest.files] == ["a", "b"]
    assert decode_manifest(encode_manifest(manifest)) == manifest
    for data, problem in BAD_MANIFESTS.values():
        if problem.startswith("is 3 bytes"):
            continue  # only the store knows a blob's size
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            decode_manifest(data)
    duplicate_key = GOOD[:-1] + b',"v":1}'
    with pytest.raises(InvalidArgument, match="appears twice"):
        decode_manifest(duplicate_key)


def test_a_corrupt_blob_fails_the_checkout_and_leaves_the_target_untouched(
    start_vault: StartVault, tmp_path: Path
) -> None:
    vault_server = start_vault()
    source = make_tree(tmp_path / "source", "corrupt")
    digest = str(add(vault_server, source)["digest"])
    blob = vault_server.blob_path(sha256((source / "train/part-1.bin").read_bytes()))
    damaged = bytearray(blob.read_bytes())
    damaged[1000] ^= 1
    blob.chmod(0o644)
    blob.write_bytes(bytes(damaged))

    target = tmp_path / "out"
    target.mkdir()
    line = vault_server.run("dataset", "checkout", digest, str(target)).error_line()
    assert "DATA_LOSS" in line, line
    assert list(target.iterdir()) == []


def test_thousands_of_small_files_go_in_batches_and_round_trip(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    source = tmp_path / "many"
    for n in range(3000):
        # Some files share their bytes: each is stored once and both paths check out.
        write(
            source,
            f"part-{n // 500}/f{n:05d}.bin",
            os.urandom(1 + n % 700) if n % 7 else b"%d" % (n % 3),
        )
    write(source, "big.bin", os.urandom(3 * 1024 * 1024))
    result = add(vault_server, source)
    digest = str(result["digest"])

    target = tmp_path / "checkout"
    vault_server.run("dataset", "checkout", digest, str(target)).ok()
    assert tree(target) == tree(source)
    assert add(vault_server, source)["digest"] == digest


# -- the cache of file digests -----------------------------------------------------------------


def settled_tree(root: Path) -> Path:
    """A tree whose files were last changed longer ago than the cache's racy window."""
    make_tree(root, "cached")
    time.sleep(RACY + 0.2)
    return root


def counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    read: list[str] = []
    real = dataset._read_file

    def counted(root: Path, file: Any, *, keep: bool = False) -> Any:
        read.append(file.name)
        return real(root, file, keep=keep)

    monkeypatch.setattr(dataset, "_read_file", counted)
    return read


def test_adding_an_unchanged_folder_again_reads_none_of_its_files(
    vault_server: VaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = settled_tree(tmp_path / "source")
    read = counting_reads(monkeypatch)
    cache = HashCache(tmp_path / "cache" / "hashes.db")
    with vault_server.client() as client:
        first = add_dataset(client, source, cache=cache)
        assert sorted(read) == sorted(tree(source))
        read.clear()
        second = add_dataset(client, source, cache=cache)
    assert read == []
    assert second.digest == first.digest and second.sent_files == 0

    # A changed file is read again, though its size and modification time are as before:
    # the change time gives it away.
    part = source / "train" / "part-1.bin"
    before = part.stat()
    part.write_bytes(os.urandom(before.st_size))
    os.utime(part, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert part.stat().st_mtime_ns == before.st_mtime_ns
    with vault_server.client() as client:
        third = add_dataset(client, source, cache=cache)
    assert read == ["train/part-1.bin"]
    assert third.digest != first.digest and third.sent_files == 1
    changed = {f.path: f.sha256 for f in third.manifest.files}
    assert changed["train/part-1.bin"] == sha256(part.read_bytes())
    cache.close()


def test_a_cached_file_the_vault_lacks_is_read_and_sent(
    start_vault: StartVault, tmp_path: Path
) -> None:
    source = settled_tree(tmp_path / "source")
    cache = HashCache(tmp_path / "hashes.db")
    first, second = start_vault("first"), start_vault("second")
    with first.client() as client:
        added = add_dataset(client, source, cache=cache)
    with second.client() as client:
        again = add_dataset(client, source, cache=cache)
    assert again.digest == added.digest
    # Every file, though none was read to hash it: the vault had none of them.
    assert again.sent_files == added.sent_files == len(added.manifest.files)
    target = tmp_path / "checkout"
    second.run("dataset", "checkout", again.digest, str(target)).ok()
    assert tree(target) == tree(source)
    cache.close()


def test_a_damaged_cache_is_set_aside_and_the_add_goes_on(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    source = settled_tree(tmp_path / "source")
    cache_home = tmp_path / "xdg-cache"
    (cache_home / "pinvault").mkdir(parents=True)
    (cache_home / "pinvault" / "file-hashes.db").write_bytes(b"not a database" * 100)
    env = {"XDG_CACHE_HOME": str(cache_home)}
    first = vault_server.run("dataset", "add", str(source), "--json", env=env).ok().json()
    assert (cache_home / "pinvault" / "file-hashes.db.damaged").exists()
    again = vault_server.run("dataset", "add", str(source), "--json", env=env).ok().json()
    rehashed = (
        vault_server.run("dataset", "add", str(source), "--json", "--rehash", env=env).ok().json()
    )
    assert first["digest"] == again["digest"] == rehashed["digest"]
    assert again["sent_files"] == rehashed["sent_files"] == 0


def test_admission_refuses_the_manifests_checkout_would_refuse(
    vault_server: VaultServer,
) -> None:
    """Admission and checkout read a dataset manifest through one validator: a dataset that
    cannot be checked out is not admitted, and the refusal names the path."""
    put_manifest(vault_server, b"a\n")
    data, problem = BAD_MANIFESTS["2,000 folders deep"]
    digest = put_manifest(vault_server, data)
    with vault_server.client() as client:
        client.pin("dataset", digest)
        image = "sha256:" + hashlib.sha256(b"deep image").hexdigest()
        client.pin("image", image, external=True)
        with pytest.raises(
            FailedPrecondition, match="is not a dataset manifest: .*" + re.escape(problem)
        ):
            client.admit(image=image, dataset=digest, seed=1)


def test_add_and_checkout_show_their_progress_on_a_terminal_and_print_only_results(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    (source / "shards").mkdir(parents=True)
    (source / "labels.csv").write_text("id,label\n1,cat\n")
    # A large file goes its own way (hashed in the first pass, sent after): counted too.
    (source / "shards" / "big.bin").write_bytes(os.urandom(dataset.SMALL_FILE + 1))
    total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    env = command_env(
        state_home=tmp_path / "state", extra={"PINVAULT_CLIENT_SERVER": vault_server.address}
    )
    added, shown = run_on_terminal(["dataset", "add", str(source), "--rehash"], env)
    assert added.returncode == 0, shown
    (digest,) = added.stdout.decode().split()
    assert re.search(r"dataset add \S*source \[█{30}\] 100\.0%", shown), shown
    # Each large file lacking from the store is counted again as it is sent.
    assert f"{size_text(total + dataset.SMALL_FILE + 1)}" in shown, shown

    target = tmp_path / "target"
    out, shown = run_on_terminal(["dataset", "checkout", digest, str(target)], env)
    assert out.returncode == 0, shown
    assert out.stdout.decode() == f"2 files, {total} bytes in {target}\n"
    assert re.search(rf"dataset checkout \S*target \[█{{30}}\] 100\.0% {size_text(total)}", shown)
