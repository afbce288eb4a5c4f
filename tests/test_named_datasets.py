"""Named datasets through the real `vault` command and a real `vault serve`: a folder added
under a name (leaving out what `--exclude` and `.vaultignore` say), re-added unchanged without
a new pin, listed, shown and checked out by name and tag, and a name that two authors pinned
refused as ambiguous rather than resolved to whoever pinned last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer


@pytest.fixture
def vault(start_vault: StartVault) -> VaultServer:
    return start_vault()


def folder(base: Path) -> Path:
    root = base / "imagenet"
    (root / "train").mkdir(parents=True)
    (root / "train" / "a.jpg").write_bytes(b"a picture")
    (root / "train" / "b.jpg").write_bytes(b"another picture")
    (root / "train" / "b.jpg.tmp").write_bytes(b"half written")
    (root / "cache").mkdir()
    (root / "cache" / "index.bin").write_bytes(b"derived")
    (root / "README").write_bytes(b"a small image set\n")
    (root / ".vaultignore").write_text("# made by tools, not data\ncache/\n")
    return root


def ledger_size(vault: VaultServer) -> int:
    with vault.client() as client:
        return client.checkpoint().size


def test_a_folder_added_under_a_name_leaves_out_what_it_is_told_to(
    vault: VaultServer, tmp_path: Path
) -> None:
    root = folder(tmp_path)
    added = vault.run("dataset", "add", "imagenet", str(root), "--exclude", "*.tmp", "--json")
    result = added.ok().json()
    assert (result["name"], result["tag"], result["new"]) == ("imagenet", "", True)
    assert result["files"] == 4  # .vaultignore, README, train/a.jpg, train/b.jpg

    out = tmp_path / "out"
    vault.run("dataset", "checkout", "imagenet", str(out)).ok()
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == [".vaultignore", "README", "train/a.jpg", "train/b.jpg"]


def test_re_adding_an_unchanged_folder_appends_nothing_and_names_the_pin(
    vault: VaultServer, tmp_path: Path
) -> None:
    root = folder(tmp_path)
    first = vault.run("dataset", "add", "imagenet", str(root), "--json").ok().json()
    size = ledger_size(vault)

    again = vault.run("dataset", "add", "imagenet", str(root)).ok()
    assert again.stdout.split()[0] == first["digest"]
    assert f"already pinned as entry {first['index']} (imagenet); nothing appended" in again.stdout
    assert ledger_size(vault) == size

    # Under a new tag, or after a change, it is a new pin.
    tagged = vault.run("dataset", "add", "imagenet", str(root), "--tag", "v1", "--json")
    assert tagged.ok().json()["new"] is True
    (root / "train" / "c.jpg").write_bytes(b"a third picture")
    changed = vault.run("dataset", "add", "imagenet", str(root), "--json").ok().json()
    assert changed["new"] is True and changed["digest"] != first["digest"]
    assert ledger_size(vault) == size + 2


def test_names_and_tags_resolve_to_their_newest_pin_verified(
    vault: VaultServer, tmp_path: Path
) -> None:
    root = folder(tmp_path)
    v1 = vault.run("dataset", "add", "imagenet", str(root), "--tag", "v1", "--json").ok().json()
    (root / "train" / "c.jpg").write_bytes(b"a third picture")
    v2 = vault.run("dataset", "add", "imagenet", str(root), "--json").ok().json()

    shown = vault.run("dataset", "show", "imagenet", "--json").ok().json()
    assert (shown["digest"], shown["index"], shown["files"]) == (v2["digest"], v2["index"], 6)
    assert (
        vault.run("dataset", "show", "imagenet@v1", "--json").ok().json()["digest"]
        == (v1["digest"])
    )
    text = vault.run("dataset", "show", "imagenet@v1").ok().stdout
    assert "(manifest verified)" in text and "(inclusion verified)" in text

    listed = vault.run("dataset", "ls", "--json").ok().json()
    assert [(d["name"], d["tag"], d["digest"]) for d in listed] == [
        ("imagenet", "", v2["digest"]),
        ("imagenet", "v1", v1["digest"]),
    ]
    missing = vault.run("dataset", "show", "imagenet@v9").error_line()
    assert missing == "vault: NOT_FOUND: no dataset is pinned under the name 'imagenet@v9'"


def test_a_name_pinned_by_two_authors_is_ambiguous_until_one_is_chosen(
    vault: VaultServer, tmp_path: Path
) -> None:
    root = folder(tmp_path)
    mine = vault.run("dataset", "add", "imagenet", str(root), "--json").ok().json()
    with vault.client() as client:
        ours = client.lookup(mine["digest"])[0].entry.author
    # Someone else pins their own bytes under the same name, later.
    with vault.client(author="mallory@elsewhere") as other:
        theirs = other.put(b'{"files":[],"v":1}').blob.sha256
        other.pin("dataset", str(theirs), meta={"name": "imagenet"})

    refused = vault.run("dataset", "show", "imagenet").error_line()
    assert refused.startswith("vault: FAILED_PRECONDITION: dataset name 'imagenet' is pinned")
    assert "mallory@elsewhere" in refused and ours in refused and "--author" in refused
    chosen = vault.run("dataset", "show", "imagenet", "--author", ours, "--json").ok().json()
    assert chosen["digest"] == mine["digest"]


@pytest.mark.parametrize(
    ("rules", "why"),
    [
        ("!keep.txt\n", ".vaultignore line 1: '!keep.txt': negation (!) is not supported"),
        ("a/**/b\n", ".vaultignore line 1: 'a/**/b': '**' is not supported"),
        ("# fine\n[abc\n", ".vaultignore line 2: '[abc': '[' without its ']'"),
    ],
)
def test_ignore_rules_it_cannot_follow_are_refused_before_anything_is_sent(
    vault: VaultServer, tmp_path: Path, rules: str, why: str
) -> None:
    root = folder(tmp_path)
    (root / ".vaultignore").write_text(rules)
    size = ledger_size(vault)
    line = vault.run("dataset", "add", "imagenet", str(root)).error_line()
    assert line.startswith("vault: INVALID_ARGUMENT: ") and line.endswith(why)
    assert ledger_size(vault) == size


def test_a_job_names_its_dataset_and_is_pinned_by_the_digest_it_resolves_to(
    vault: VaultServer, tmp_path: Path
) -> None:
    root = folder(tmp_path)
    v1 = vault.run("dataset", "add", "imagenet", str(root), "--tag", "v1", "--json").ok().json()
    image = "sha256:" + "2e" * 32
    vault.run("pin", "image", image, "--external").ok()

    admit = ("admit", "--image", image, "--seed", "5", "--json")
    admitted = vault.run(*admit, "--dataset", "imagenet@v1").ok().json()
    assert admitted["inputs"]["dataset"] == v1["digest"]
    # The same inputs by digest are the same run.
    again = vault.run(*admit, "--dataset", v1["digest"]).ok().json()
    assert (again["run_id"], again["new"]) == (admitted["run_id"], False)

    # With --json, the refusal is one JSON object, and the status says "not found".
    unknown = vault.run(*admit, "--dataset", "imagenet@v2")
    assert unknown.returncode == 66, unknown.describe()
    assert json.loads(unknown.stderr) == {
        "error": {
            "kind": "not_found",
            "message": "no dataset is pinned under the name 'imagenet@v2'",
            "exit": 66,
        }
    }
