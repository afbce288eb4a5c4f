"""What a user can do with the `vault` command against a real `vault serve`: put, get, stat,
find-missing, pin, lookup, log, checkpoint, proof and verify, each checked from the outside
(sha256sum, b3sum, an independent Merkle root) rather than by the code under test."""

from __future__ import annotations

import base64
import getpass
import hashlib
import json
import os
import random
import re
import socket
import subprocess
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, command_env
from tests.terminal import run_on_terminal
from vault.errors import IntegrityError, VerificationError
from vault.ledger.checkpoint import Verifier
from vault.ledger.entry import KINDS, Entry
from vault.ledger.merkle import verify_consistency, verify_inclusion
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb

MiB = CHUNK_SIZE


def random_bytes(size: int, seed: object) -> bytes:
    return random.Random(str(seed)).randbytes(size)


def tool_digest(tool: str, path: Path | None = None, data: bytes | None = None) -> str:
    """The hex digest an independent tool (sha256sum, b3sum) prints for a file or for stdin."""
    args = [tool, str(path)] if path is not None else [tool, "-"]
    out = subprocess.run(args, input=data, capture_output=True, check=True).stdout.decode()
    return out.split()[0]


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ledger_size(server: VaultServer) -> int:
    with server.client() as client:
        return client.checkpoint().size


def put(server: VaultServer, data: bytes) -> tuple[str, str]:
    with server.client() as client:
        blob = client.put(data).blob
    return str(blob.sha256), str(blob.blake3)


def entry_from_json(value: dict[str, object]) -> Entry:
    """Rebuild an entry from the command's JSON, to re-derive its canonical bytes."""
    return Entry(
        index=int(str(value["index"])),
        kind=str(value["kind"]),
        subjects=tuple(value["subjects"]),  # type: ignore[arg-type]
        author=str(value["author"]),
        time=str(value["time"]),
        prev=bytes.fromhex(str(value["prev"])),
        meta=dict(value["meta"]),  # type: ignore[call-overload]
        external=bool(value["external"]),
    )


def leaf(body: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + body).digest()


def rfc6962_root(leaves: list[bytes]) -> bytes:
    """MTH from RFC 6962 §2.1, written out here so the check does not trust vault.merkle."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    split = 1 << ((len(leaves) - 1).bit_length() - 1)
    return hashlib.sha256(
        b"\x01" + rfc6962_root(leaves[:split]) + rfc6962_root(leaves[split:])
    ).digest()


# -- serve ---------------------------------------------------------------------------------


def test_serve_says_where_it_listens_and_answers_health_and_reflection(
    vault_server: VaultServer,
) -> None:
    match = re.fullmatch(r"pinvault serving on 127\.0\.0\.1:(\d+)", vault_server.banner[0])
    assert match is not None, vault_server.banner
    assert int(match.group(1)) > 0
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(vault_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pinvault.v1.Store", "pinvault.v1.Ledger"):
            request = health_pb2.HealthCheckRequest(service=service)
            assert health.Check(request, timeout=10).status == serving
        with pytest.raises(grpc.RpcError) as caught:
            health.Check(health_pb2.HealthCheckRequest(service="pinvault.v1.Nothing"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND

        reflected = ProtoReflectionDescriptorDatabase(channel)
        assert {
            "pinvault.v1.Store",
            "pinvault.v1.Ledger",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= set(reflected.get_services())
        pool = descriptor_pool.DescriptorPool(reflected)
        ledger = {m.name for m in pool.FindServiceByName("pinvault.v1.Ledger").methods}
        store = {m.name for m in pool.FindServiceByName("pinvault.v1.Store").methods}
    assert {"Pin", "Lookup", "Log", "GetCheckpoint", "GetConsistencyProof"} <= ledger
    assert {"Put", "Get", "Stat", "FindMissing"} <= store


# -- put -----------------------------------------------------------------------------------


def test_put_prints_the_digests_that_sha256sum_and_b3sum_print(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    paths = []
    for size in (0, 1, 70_000, MiB + 3):
        path = tmp_path / f"file-{size}"
        path.write_bytes(random_bytes(size, ("put", size)))
        paths.append(path)
    lines = vault_server.run("put", *map(str, paths)).ok().stdout.splitlines()
    assert len(lines) == len(paths)
    for line, path in zip(lines, paths, strict=True):
        assert line.split("  ") == [
            "sha256:" + tool_digest("sha256sum", path),
            "blake3:" + tool_digest("b3sum", path),
            str(path),
        ]

    data = random_bytes(123_457, "stdin")
    line = vault_server.run("put", "-", input=data).ok().stdout.strip()
    assert line.split("  ") == [
        "sha256:" + tool_digest("sha256sum", data=data),
        "blake3:" + tool_digest("b3sum", data=data),
        "-",
    ]


def test_putting_the_same_content_twice_stores_nothing_new(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    data = random_bytes(300_000, tmp_path)
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.write_bytes(data)
    copy.write_bytes(data)
    before = set(vault_server.stored_files())

    first = vault_server.run("put", "--json", str(original)).ok().json()
    assert first["created"] is True
    assert first["size"] == len(data)
    assert first["path"] == str(original)
    assert first["sha256"] == "sha256:" + tool_digest("sha256sum", original)
    assert first["blake3"] == "blake3:" + tool_digest("b3sum", original)
    stored = set(vault_server.stored_files())
    blob = vault_server.blob_path(first["sha256"])
    assert stored - before == {blob, blob.with_name(blob.name + ".chunks")}
    assert blob.read_bytes() == data

    again = vault_server.run("put", "--json", str(copy), "-", input=data).ok().json()
    assert [r["created"] for r in again] == [False, False]
    assert {r["sha256"] for r in again} == {first["sha256"]}
    assert {r["stored_at"] for r in again} == {first["stored_at"]}
    assert set(vault_server.stored_files()) == stored


@pytest.mark.parametrize("kind", ["missing file", "folder"])
def test_a_path_that_cannot_be_read_is_refused_and_nothing_is_stored(
    vault_server: VaultServer, tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "no-such-file" if kind == "missing file" else tmp_path
    before = vault_server.stored_files()
    line = vault_server.run("put", str(path)).error_line()
    assert f"cannot read {path}" in line
    assert vault_server.stored_files() == before


# -- get -----------------------------------------------------------------------------------


def test_get_round_trips_every_size_to_a_file_and_to_stdout(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    sources = []
    for size in (0, 1, MiB - 1, MiB + 1, 5 * MiB + 12_345):
        path = tmp_path / f"in-{size}"
        path.write_bytes(random_bytes(size, ("get", size)))
        sources.append(path)
    puts = vault_server.run("put", "--json", *map(str, sources)).ok().json()
    for source, stored in zip(sources, puts, strict=True):
        data = source.read_bytes()
        target = tmp_path / f"out-{len(data)}"
        vault_server.run("get", stored["sha256"], "-o", str(target)).ok()
        assert target.read_bytes() == data, f"{len(data)} bytes through a file"
        assert vault_server.run("get", stored["sha256"]).ok().output == data, "through stdout"
    assert not list(tmp_path.glob(".*partial*"))


def test_get_reads_ranges_within_and_across_chunks(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    data = random_bytes(3 * MiB + 500, "ranges")
    sha256, blake3 = put(vault_server, data)
    ranges = [
        (10, 100),  # within the first chunk
        (MiB + 17, 4096),  # within a later chunk
        (MiB - 7, 20),  # across one chunk boundary
        (MiB // 2, 2 * MiB),  # across two
        (3 * MiB + 1, None),  # to the end
        (len(data), 0),  # empty, at the very end
    ]
    for offset, length in ranges:
        args = ["get", sha256, "--offset", str(offset)]
        if length is not None:
            args += ["--length", str(length)]
        end = len(data) if length is None else offset + length
        assert vault_server.run(*args).ok().output == data[offset:end], (offset, length)

    target = tmp_path / "range"
    vault_server.run(
        "get", blake3, "--offset", str(MiB - 3), "--length", "9", "-o", str(target)
    ).ok()
    assert target.read_bytes() == data[MiB - 3 : MiB + 6]
    assert vault_server.run("get", blake3).ok().output == data


def test_an_unknown_digest_is_not_found_in_one_line(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    unknown = "sha256:" + hashlib.sha256(b"never stored").hexdigest()
    target = tmp_path / "out"
    for args in (["get", unknown, "-o", str(target)], ["get", unknown], ["stat", unknown]):
        run = vault_server.run(*args)
        line = run.error_line()
        assert "NOT_FOUND" in line and unknown in line, line
        assert run.output == b""
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_get_to_a_path_that_cannot_be_written_is_one_line_and_leaves_nothing(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    sha256, _ = put(vault_server, b"to be written somewhere")
    for target, problem in (
        (tmp_path / "no-such-folder" / "out", "No such file or directory"),
        (tmp_path, "it is a folder"),
    ):
        line = vault_server.run("get", sha256, "-o", str(target)).error_line()
        assert f"cannot write {target}: {problem}" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_range_beyond_the_end_is_refused_naming_the_size(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    sha256, _ = put(vault_server, random_bytes(1000, "short"))
    target = tmp_path / "out"
    for args in (
        ["--offset", "1001"],
        ["--offset", "900", "--length", "101"],
        ["--offset", "0", "--length", "5000", "-o", str(target)],
    ):
        line = vault_server.run("get", sha256, *args).error_line()
        assert "INVALID_ARGUMENT" in line and "beyond the end" in line and "1000 bytes" in line
    assert not target.exists()
    line = vault_server.run("get", sha256, "--offset", "-1").error_line()
    assert "-1" in line


def test_a_corrupted_stored_byte_fails_the_get_and_no_bad_byte_is_handed_out(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    data = random_bytes(2 * MiB + 77, "corrupt")
    sha256, _ = put(vault_server, data)
    stored = vault_server.blob_path(sha256)
    damaged = bytearray(stored.read_bytes())
    damaged[MiB + 1000] ^= 0xFF  # in the second chunk
    stored.write_bytes(damaged)

    target = tmp_path / "out"
    line = vault_server.run("get", sha256, "-o", str(target)).error_line()
    assert "DATA_LOSS" in line and sha256 in line, line
    assert list(tmp_path.iterdir()) == [], "no file, not even a partial one"

    # Standard output cannot be taken back: nothing is written to it before the whole digest
    # matched.
    run = vault_server.run("get", sha256)
    assert "DATA_LOSS" in run.error_line()
    assert run.output == b""

    with vault_server.client() as client:
        received = bytearray()
        with pytest.raises(IntegrityError, match=re.escape(sha256)):
            for piece in client.open(sha256).chunks():
                received += piece
        assert bytes(received) == data[:MiB]
        # A range is verified as part of its whole blob (the client cannot trust the chunk list
        # alone), so no range of a damaged blob is handed out, not even of its intact chunks.
        for offset in (MiB + 10, 5):
            with pytest.raises(IntegrityError, match="byte offset 1048576"):
                client.open(sha256, offset=offset, length=5).read()


# -- stat and find-missing -----------------------------------------------------------------


def test_stat_shows_size_both_digests_when_stored_and_pins(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    data = random_bytes(4321, tmp_path)
    before = utc_now()
    stored = vault_server.run("put", "--json", "-", input=data).ok().json()
    after = utc_now()
    assert before <= stored["stored_at"] <= after

    text = vault_server.run("stat", stored["sha256"]).ok().stdout
    fields = dict(line.split(None, 1) for line in text.splitlines())
    assert fields == {
        "sha256": stored["sha256"],
        "blake3": stored["blake3"],
        "size": "4321",
        "stored": stored["stored_at"],
        "pins": "none",
    }

    entry = vault_server.run("pin", "dataset", stored["sha256"], "--json").ok().json()
    text = vault_server.run("stat", stored["blake3"]).ok().stdout
    (pin_line,) = [line for line in text.splitlines() if line.startswith("pin ")]
    assert pin_line.split()[1:4] == [str(entry["index"]), entry["time"], "dataset"]
    as_json = vault_server.run("stat", stored["blake3"], "--json").ok().json()
    assert as_json["sha256"] == stored["sha256"] and as_json["size"] == 4321
    assert [(p["index"], p["kind"]) for p in as_json["pins"]] == [(entry["index"], "dataset")]


def test_find_missing_answers_for_ten_thousand_digests_in_one_command(
    vault_server: VaultServer,
) -> None:
    present: list[str] = []
    for n in range(3):
        present.extend(put(vault_server, random_bytes(100 + n, ("present", n))))
    rng = random.Random("find-missing")
    absent = [
        f"{rng.choice(['sha256', 'blake3'])}:{rng.randbytes(32).hex()}"
        for _ in range(10_000 - len(present))
    ]
    asked = present + absent
    rng.shuffle(asked)
    run = vault_server.run("find-missing", "-", input="\n".join(asked).encode())
    assert run.returncode == 66, run.describe()  # some are not found
    assert run.stdout.splitlines() == [d for d in asked if d not in set(present)]

    assert vault_server.run("find-missing", *present).ok().stdout == ""
    line = vault_server.run("find-missing", present[0], "sha256:zz").error_line()
    assert "INVALID_ARGUMENT" in line and "'sha256:zz'" in line


# -- pin -----------------------------------------------------------------------------------


def test_pin_appends_an_entry_of_every_kind(vault_server: VaultServer) -> None:
    sha256, _ = put(vault_server, b"pinned by every kind")
    indexes = []
    for kind in KINDS:
        entry = vault_server.run("pin", kind, sha256, "--json").ok().json()
        assert (entry["kind"], entry["subjects"], entry["external"]) == (kind, [sha256], False)
        indexes.append(entry["index"])
    assert indexes == list(range(indexes[0], indexes[0] + len(KINDS)))
    found = vault_server.run("lookup", sha256, "--json").ok().json()
    assert [(e["index"], e["kind"]) for e in found] == list(zip(indexes, KINDS, strict=True))

    text = vault_server.run("pin", "image", sha256).ok().stdout.splitlines()
    assert text[0] == f"pinned as entry {indexes[-1] + 1}: image {sha256}"
    assert "(verified)" in text[1]


def test_entries_record_author_time_and_the_previous_entrys_leaf_hash(
    vault_server: VaultServer,
) -> None:
    sha256, blake3 = put(vault_server, b"a chained pair")
    before = utc_now()
    first = vault_server.run("pin", "image", sha256, "--meta", "build=17", "--json").ok().json()
    second = (
        vault_server.run(
            "pin", "run", blake3, "--json", env={"PINVAULT_CLIENT_AUTHOR": "alice@lab"}
        )
        .ok()
        .json()
    )
    after = utc_now()

    assert second["index"] == first["index"] + 1
    assert first["leaf_hash"] == leaf(entry_from_json(first).encode()).hex()
    assert second["prev"] == first["leaf_hash"]
    assert first["author"] == f"{getpass.getuser()}@{socket.gethostname()}"
    assert second["author"] == "alice@lab"
    assert before <= first["time"] <= second["time"] <= after
    assert first["meta"] == {"build": "17"} and second["meta"] == {}
    # A blob named by its blake3 alias is pinned under its canonical sha256 digest.
    assert second["subjects"] == [sha256]


def test_pinning_a_blob_not_in_the_store_is_refused_unless_external(
    vault_server: VaultServer,
) -> None:
    elsewhere = "sha256:" + hashlib.sha256(b"an image in a registry").hexdigest()
    size = ledger_size(vault_server)
    line = vault_server.run("pin", "image", elsewhere).error_line()
    assert "FAILED_PRECONDITION" in line and elsewhere in line, line
    assert "put it first" in line and "external" in line
    assert ledger_size(vault_server) == size

    entry = vault_server.run("pin", "image", elsewhere, "--external", "--json").ok().json()
    assert entry["external"] is True and entry["index"] == size
    found = vault_server.run("lookup", elsewhere, "--json").ok().json()
    assert [(e["index"], e["external"]) for e in found] == [(size, True)]


BAD_PINS = {
    "malformed digest": (["image", "sha256:" + "g" * 64], "malformed digest"),
    "a tag, not a digest": (["image", "ubuntu:latest"], "unknown digest algorithm 'ubuntu'"),
    "bare hex": (["image", "ab" * 32], "malformed digest"),
    "unknown algorithm": (["image", "md5:" + "0" * 32], "unknown digest algorithm 'md5'"),
    "wrong length": (["image", "sha256:abcd"], "expected 64 hex digits, found 4"),
    "unknown kind": (["model", "{blob}"], "'model'"),
    "oversized value": (["run", "{blob}", "--meta", "note=" + "x" * 4097], "4097 bytes"),
    "too many keys": (
        ["run", "{blob}", *(f"--meta=k{n}=v" for n in range(65))],
        "too many metadata keys: 65",
    ),
    "bad key": (["run", "{blob}", "--meta", "Bad Key=v"], "bad metadata key 'Bad Key'"),
    "no value": (["run", "{blob}", "--meta", "novalue"], "'novalue': expected key=value"),
}


@pytest.mark.parametrize("case", list(BAD_PINS))
def test_bad_pin_input_is_one_line_naming_the_problem_and_appends_nothing(
    vault_server: VaultServer, case: str
) -> None:
    sha256, _ = put(vault_server, b"a blob that is stored")
    args, problem = BAD_PINS[case]
    size = ledger_size(vault_server)
    line = vault_server.run("pin", *(a.replace("{blob}", sha256) for a in args)).error_line()
    assert problem in line, line
    if case != "unknown kind":  # refused by the command's own parser, before any request
        assert "INVALID_ARGUMENT" in line, line
    assert ledger_size(vault_server) == size


# -- lookup --------------------------------------------------------------------------------


def test_lookup_prints_entries_verified_against_a_checkpoint_it_keeps(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    sha256, blake3 = put(vault_server, b"looked up")
    with vault_server.client() as client:
        pins = [client.pin("config", sha256).entry, client.pin("run", blake3).entry]

    state = tmp_path / "state"
    lines = vault_server.run("lookup", blake3, state_home=state).ok().stdout.splitlines()
    assert lines[0] == f"2 entries pin {blake3}"
    assert [line.split()[:3] for line in lines[1:3]] == [
        [str(e.index), e.time, e.kind] for e in pins
    ]
    match = re.fullmatch(
        r"verified: inclusion and completeness in checkpoint size (\d+) root (\S+)", lines[3]
    )
    assert match is not None, lines
    size, root = int(match.group(1)), base64.b64decode(match.group(2))
    assert size > pins[-1].index

    (trust_file,) = vault_server.trust_files(state)
    key = vault_server.run("checkpoint", "--key").ok().stdout.strip()
    trusted = json.loads(trust_file.read_text())
    assert (trusted["size"], trusted["root"], trusted["verifier"]) == (size, root.hex(), key)

    proven = vault_server.run("lookup", sha256, "--json", state_home=state).ok().json()
    for entry, pinned in zip(proven, pins, strict=True):
        body = entry_from_json(entry).encode()
        assert entry["leaf_hash"] == leaf(body).hex()
        verify_inclusion(
            leaf(body),
            pinned.index,
            entry["checkpoint"]["size"],
            [bytes.fromhex(h) for h in entry["inclusion"]],
            bytes.fromhex(entry["checkpoint"]["root"]),
        )

    unknown = "sha256:" + hashlib.sha256(b"pinned by no one").hexdigest()
    line = vault_server.run("lookup", unknown).error_line()
    assert "NOT_FOUND" in line and unknown in line


# -- log, checkpoint, proofs ---------------------------------------------------------------


def test_log_filters_by_kind_digest_author_and_time_and_pages_past_a_thousand(
    vault_server: VaultServer,
) -> None:
    author = f"bulk-{time.time_ns()}@lab"
    digests = [f"sha256:{hashlib.sha256(b'bulk %d' % n).hexdigest()}" for n in range(1100)]
    kinds = ["dataset" if n % 2 else "config" for n in range(1100)]
    with vault_server.client() as client:
        response = client.ledger.PinBatch(
            pb.PinBatchRequest(
                pins=[
                    pb.PinRequest(kind=k, subjects=[d], external=True, author=author)
                    for k, d in zip(kinds, digests, strict=True)
                ]
            )
        )
    first = response.entries[0].index

    everything = vault_server.run("log", "--author", author, "--json").ok().json_lines()
    assert [e["index"] for e in everything] == list(range(first, first + 1100))
    assert [e["subjects"] for e in everything] == [[d] for d in digests]

    datasets = vault_server.run("log", "--author", author, "--kind", "dataset", "--json")
    indexes = [e["index"] for e in datasets.ok().json_lines()]
    assert indexes == [first + n for n in range(1100) if kinds[n] == "dataset"]

    page = vault_server.run("log", "--start", str(first + 999), "--limit", "3", "--json")
    assert [e["index"] for e in page.ok().json_lines()] == [first + 999, first + 1000, first + 1001]
    tail = vault_server.run("log", "--author", author, "--start", str(first + 1098), "--json").ok()
    assert [e["index"] for e in tail.json_lines()] == [first + 1098, first + 1099]

    by_digest = vault_server.run("log", "--digest", digests[777], "--json").ok().json_lines()
    assert [e["index"] for e in by_digest] == [first + 777]

    with vault_server.client(author=f"timed-{author}") as client:
        earlier = client.pin("image", digests[0], external=True).entry
        later = client.pin("image", digests[1], external=True).entry
    assert earlier.time < later.time
    timed = ["log", "--author", f"timed-{author}", "--json"]
    since = vault_server.run(*timed, "--since", later.time).ok().json_lines()
    until = vault_server.run(*timed, "--until", later.time).ok().json_lines()
    assert [e["index"] for e in since] == [later.index]
    assert [e["index"] for e in until] == [earlier.index]

    text = vault_server.run("log", "--start", str(later.index), "--limit", "1").ok().stdout
    assert text.split()[:4] == [str(later.index), later.time, "image", digests[1]]
    line = vault_server.run("log", "--kind", "model").error_line()
    assert "unknown kind 'model'" in line


def test_log_since_and_until_take_durations_dates_and_any_rfc_3339_time(
    vault_server: VaultServer,
) -> None:
    """Times are compared as times, whatever form they were given in; anything that is not a
    time is refused in one line, by the command and by the server."""
    author = f"since-{random.getrandbits(32):08x}"
    with vault_server.client(author=author) as client:
        entry = client.pin("image", "sha256:" + os.urandom(32).hex(), external=True).entry
    mine = ["log", "--author", author, "--json"]
    at = datetime.strptime(entry.time, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    # The same moment one hour east of UTC, and a second before it, to the second.
    east = at.astimezone(timezone(timedelta(hours=1)))
    before = (east - timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S+01:00")
    after = (east + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S+01:00")
    found = {
        "2h": [entry.index],
        "1w": [entry.index],
        at.strftime("%Y-%m-%d"): [entry.index],
        before: [entry.index],
        after: [],
        (at + timedelta(days=1)).strftime("%Y-%m-%d"): [],
    }
    for since, expected in found.items():
        lines = vault_server.run(*mine, "--since", since).ok().json_lines()
        assert [e["index"] for e in lines] == expected, since
    assert vault_server.run(*mine, "--until", after).ok().json_lines() != []
    assert vault_server.run(*mine, "--until", before).ok().json_lines() == []

    for bad in ("yesterday", "2h ago", "2026-13-01", "2026-11-24 10:00", "0d"):
        run = vault_server.run(*mine, "--since", bad)
        assert run.returncode == 2, run.describe()
        # With --json, the usage error is one JSON object on standard error (docs/cli.md).
        error = json.loads(run.stderr)["error"]
        assert error["kind"] == "usage", run.describe()
        assert "--since: expected a duration such as 2h or 3d" in error["message"], bad
    with vault_server.client() as client, pytest.raises(grpc.RpcError) as refused:
        client.ledger.Log(pb.LogRequest(since="2026-11-24 10:00"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "since '2026-11-24 10:00' is not an RFC 3339 time" in str(refused.value.details())


def test_checkpoint_and_verify_answer_in_json(vault_server: VaultServer) -> None:
    with vault_server.client() as client:
        client.pin("artefact", put(vault_server, b"an output for json")[0])
    checkpoint = vault_server.run("checkpoint", "--json").ok().json()
    key = vault_server.run("checkpoint", "--key", "--json").ok().json()["verifier_key"]
    opened = Verifier.from_string(key).open(checkpoint["note"])
    assert checkpoint["size"] == opened.size and checkpoint["origin"] == opened.origin
    assert base64.b64decode(checkpoint["root"]) == opened.root

    report = vault_server.run("verify", "--blobs", "--json").ok().json()
    assert report["ok"] is True
    assert report["ledger"]["ok"] is True and report["ledger"]["first_break"] is None
    assert report["ledger"]["entries"] >= opened.size and report["ledger"]["failures"] == []
    assert report["blobs"]["checked"] >= 1 and report["blobs"]["failed"] == []


def test_checkpoint_is_a_c2sp_signed_note_over_the_rfc6962_root_of_the_entries(
    vault_server: VaultServer,
) -> None:
    with vault_server.client() as client:
        client.pin("checkpoint", put(vault_server, b"a model checkpoint")[0])
    note = vault_server.run("checkpoint").ok().stdout
    key = vault_server.run("checkpoint", "--key").ok().stdout.strip()
    lines = note.split("\n")
    assert len(lines) == 6 and lines[3] == "" and lines[5] == "", note
    origin, size_line, root_line, signature = lines[0], lines[1], lines[2], lines[4]
    assert re.fullmatch(r"[1-9][0-9]*", size_line)
    assert len(base64.b64decode(root_line, validate=True)) == 32
    match = re.fullmatch(r"— (\S+) ([A-Za-z0-9+/]+=*)", signature)
    assert match is not None, signature
    verifier = Verifier.from_string(key)
    assert match.group(1) == verifier.name == origin
    signed = base64.b64decode(match.group(2))
    assert len(signed) == 4 + 64 and signed[:4] == verifier.key_id

    checkpoint = verifier.open(note)
    assert (checkpoint.origin, checkpoint.size) == (origin, int(size_line))
    assert checkpoint.root == base64.b64decode(root_line)

    entries = vault_server.run("log", "--json").ok().json_lines()[: checkpoint.size]
    assert [e["index"] for e in entries] == list(range(checkpoint.size))
    assert rfc6962_root([leaf(entry_from_json(e).encode()) for e in entries]) == checkpoint.root

    altered = note.replace(f"\n{size_line}\n", f"\n{int(size_line) + 1}\n")
    with pytest.raises(VerificationError, match="does not verify"):
        verifier.open(altered)


def test_proofs_printed_by_the_command_verify_against_signed_checkpoints(
    vault_server: VaultServer,
) -> None:
    with vault_server.client() as client:
        client.pin("config", put(vault_server, b"a config")[0])
    verifier = Verifier.from_string(vault_server.run("checkpoint", "--key").ok().stdout.strip())
    old = verifier.open(vault_server.run("checkpoint").ok().stdout)
    with vault_server.client() as client:
        for n in range(3):
            client.pin("artefact", "sha256:" + hashlib.sha256(b"%d" % n).hexdigest(), external=True)
    new = verifier.open(vault_server.run("checkpoint").ok().stdout)
    assert new.size == old.size + 3

    index = old.size - 1
    (entry,) = (
        vault_server.run("log", "--start", str(index), "--limit", "1", "--json").ok().json_lines()
    )
    for args in ([], ["--size", str(new.size)]):
        proof = vault_server.run("proof", "inclusion", str(index), *args, "--json").ok().json()
        assert (proof["index"], proof["size"]) == (index, new.size)
        assert proof["leaf_hash"] == leaf(entry_from_json(entry).encode()).hex()
        hashes = [bytes.fromhex(h) for h in proof["hashes"]]
        verify_inclusion(bytes.fromhex(proof["leaf_hash"]), index, new.size, hashes, new.root)
        with pytest.raises(VerificationError):
            verify_inclusion(
                bytes.fromhex(proof["leaf_hash"]), index - 1, new.size, hashes, new.root
            )
    at_old = vault_server.run("proof", "inclusion", "0", "--size", str(old.size), "--json")
    proof = at_old.ok().json()
    verify_inclusion(
        bytes.fromhex(proof["leaf_hash"]),
        0,
        old.size,
        [bytes.fromhex(h) for h in proof["hashes"]],
        old.root,
    )

    args = ["proof", "consistency", str(old.size), str(new.size)]
    consistency = vault_server.run(*args, "--json").ok().json()
    assert (consistency["old_size"], consistency["new_size"]) == (old.size, new.size)
    hashes = [bytes.fromhex(h) for h in consistency["hashes"]]
    verify_consistency(old.size, new.size, old.root, new.root, hashes)
    with pytest.raises(VerificationError):
        verify_consistency(old.size, new.size, new.root, new.root, hashes)

    text = vault_server.run(*args).ok().stdout.splitlines()
    assert text[:3] == [f"old_size   {old.size}", f"new_size   {new.size}", "hashes"]
    assert [line.strip() for line in text[3:]] == consistency["hashes"]


# -- verify --------------------------------------------------------------------------------


def test_verify_passes_on_a_good_ledger_and_checks_every_pinned_blob(
    vault_server: VaultServer,
) -> None:
    with vault_server.client() as client:
        client.pin("artefact", put(vault_server, b"an output")[0])
    size = ledger_size(vault_server)
    run = vault_server.run("verify").ok()
    assert f"ledger: {size} entries" in run.stdout
    assert run.stdout.splitlines()[-1] == "ledger OK"

    entries = vault_server.run("log", "--json").ok().json_lines()
    pinned = {s for e in entries if not e["external"] for s in e["subjects"]}
    run = vault_server.run("verify", "--blobs").ok()
    assert f"blobs: {len(pinned)} pinned blobs checked, 0 failed" in run.stdout


def test_verify_reports_progress_on_a_terminal(vault_server: VaultServer, tmp_path: Path) -> None:
    size = ledger_size(vault_server)
    env = command_env(state_home=tmp_path, extra={"PINVAULT_CLIENT_SERVER": vault_server.address})
    result, text = run_on_terminal(["verify", "--blobs"], env)
    assert result.returncode == 0, text
    assert re.search(rf"verify ledger .*\b{size:,} entries", text), text
    assert "verify blobs" in text, text


def test_tier_status_counts_what_a_running_vault_of_one_tier_holds_now(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    host = {"PINVAULT_DATA_DIR": str(server.data_dir)}
    assert server.run("tier", "status", "--json", env=host).ok().json()["tiers"] == {
        "hot": {"blobs": 0, "bytes": 0}
    }
    sizes = [10_000, 70_000]
    for size in sizes:
        path = tmp_path / f"blob-{size}"
        path.write_bytes(os.urandom(size))
        server.run("put", str(path)).ok()
    status = server.run("tier", "status", "--json", env=host).ok().json()
    assert status["tiers"] == {"hot": {"blobs": 2, "bytes": sum(sizes)}}
    table = server.run("tier", "status", env=host).ok().stdout
    assert re.search(r"^hot +2 +78\.1 KiB$", table, re.M), table
