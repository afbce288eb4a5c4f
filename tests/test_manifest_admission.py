"""Huge dataset manifests at admission, against a real `vault serve`: a refused manifest is
refused again from memory (for good when the manifest itself is bad or gives a stored file a
wrong size, for a short while when files are missing), admission reads no manifest larger than
admission.max_manifest_bytes, and the fast reader of canonical manifests refuses exactly what
the whole-document one does."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator

import pytest

from tests.conftest import StartVault
from tests.test_admission import Lab
from vault import config
from vault.errors import FailedPrecondition, InvalidArgument
from vault.store import manifest as manifest_module
from vault.store.manifest import (
    FileEntry,
    _decode_document,
    build_manifest,
    check_manifest,
    decode_manifest,
    encode_manifest,
)

A = "sha256:" + "ab" * 32
B = "sha256:" + "cd" * 32


def manifest(*paths: str, digest: str = A) -> bytes:
    files = [{"mode": "0644", "path": p, "sha256": digest, "size": 2} for p in paths]
    return json.dumps(
        {"v": 1, "files": files}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


@pytest.fixture
def lab(start_vault: StartVault) -> Iterator[Lab]:
    lab = Lab(start_vault())
    yield lab
    lab.client.close()


def refusal(lab: Lab, dataset: str) -> str:
    with pytest.raises((FailedPrecondition, InvalidArgument)) as refused:
        lab.admit(dataset=dataset)
    return str(refused.value)


# -- the reader --------------------------------------------------------------------------------

ESCAPED = ['a"b', "a\\b", "c\bd", "c\td", "c\nd", "c\x0cd", "c\rd", "c\x01d", "c\x1fd", "é/ü"]


def test_escaped_paths_round_trip_through_the_fast_reader() -> None:
    entries = [FileEntry(p, 2, 0o644, A) for p in ESCAPED]
    data = encode_manifest(build_manifest(entries))
    assert b'\\"' in data and b"\\u0001" in data and b"\\u001f" in data and b"\\n" in data
    assert decode_manifest(data) == build_manifest(entries)


@pytest.mark.parametrize(
    "spelling",
    [
        (b'"path":"a\\"b"', b'"path":"a\\u0022b"'),
        (b'"path":"c\\nd"', b'"path":"c\\u000ad"'),
        (b'"path":"c\\u001fd"', b'"path":"c\\u001Fd"'),
        (b'"path":"a\\"b"', b'"path":"a\\"\\/b"'),
        (b'"path":"a\\\\b"', b'"path":"a\\u005cb"'),
    ],
)
def test_a_non_canonical_escape_is_refused_as_not_canonical(spelling: tuple[bytes, bytes]) -> None:
    data = encode_manifest(build_manifest([FileEntry(p, 2, 0o644, A) for p in ESCAPED]))
    canonical, other = spelling
    assert canonical in data
    with pytest.raises(InvalidArgument, match="not in canonical form"):
        decode_manifest(data.replace(canonical, other))


CORNERS = {
    "empty list": b'{"files":[],"v":1}',
    "one file": manifest("a"),
    "dotfiles": manifest(".git/config", "a/.hidden", "a/..b", "b..", "c/d."),
    "trailing slash": manifest("a/"),
    "empty path": manifest(""),
    "dot": manifest("."),
    "dot-dot name": manifest("a/../b"),
    "leading dot-dot": manifest("../b"),
    "file and folder, apart": manifest("d", "d!", "d.txt", "d/a"),
    "folder after a longer sibling": manifest("d", "d.x", "d.x/y"),
    "siblings": manifest("d.x", "d/a", "d/b", "e"),
    "a NUL": manifest("a\x00b"),
    "a lone surrogate": manifest("a").replace(b'"a"', b'"\\ud800"'),
    "not UTF-8": manifest("a").replace(b'"a"', b'"\xff"'),
    "two sizes": manifest("a", "b").replace(b'"size":2}]', b'"size":3}]'),
    "size 2^53": manifest("a").replace(b'"size":2', b'"size":9007199254740992'),
    "size 2^53-1": manifest("a").replace(b'"size":2', b'"size":9007199254740991'),
    "leading zero size": manifest("a").replace(b'"size":2', b'"size":02'),
    "negative size": manifest("a").replace(b'"size":2', b'"size":-2'),
    "float size": manifest("a").replace(b'"size":2', b'"size":2.0'),
    "trailing bytes": manifest("a") + b" ",
    "trailing comma": manifest("a").replace(b"}]", b"},]"),
    "second entry broken": manifest("a", "b").replace(b'"path":"b"', b'"path":b'),
    "upper-case digest": manifest("a", digest="sha256:" + "AB" * 32),
    "duplicate key": manifest("a")[:-1] + b',"v":1}',
    "one digest, two paths": manifest("a", "b"),
    "long name": manifest("d/" + "n" * 255, "e/" + "n" * 256),
    "2048 bytes": manifest("a/" * 1023 + "bc"),
}

# Manifests of many pieces (the fast reader checks about 256 KiB at a time), with what matters
# far apart: a file and a path under it as a folder, a digest listed with two sizes, a path out
# of order, an escape, a dotfile.
FILLER = [f"d-{i:06d}/part.bin" for i in range(8_000)]
CORNERS |= {
    "many pieces": manifest(*FILLER),
    "file and folder, pieces apart": manifest("d", *FILLER, "d/a"),
    "file after its folder's files": manifest(*FILLER, "d/a", "d0"),
    "two sizes, pieces apart": manifest(*FILLER).replace(b'"size":2}]', b'"size":3}]'),
    "out of order, pieces apart": manifest(*FILLER[:7_000], "a", *FILLER[7_000:]),
    "an escape, pieces on": manifest(*FILLER, 'e"f'),
    "a dotfile, pieces on": manifest(*FILLER, "e/.f"),
    "a dot-dot, pieces on": manifest(*FILLER, "e/../f"),
    "a long name, pieces on": manifest(*FILLER, "e/" + "n" * 256),
    "broken entry, pieces on": manifest(*FILLER).replace(b'"path":"d-007999', b'"path":d-007999'),
}


@pytest.mark.parametrize("case", list(CORNERS))
def test_the_fast_reader_refuses_exactly_what_the_whole_document_reader_does(case: str) -> None:
    data = CORNERS[case]
    try:
        expected: object = _decode_document(data, len(data) + 1)
    except InvalidArgument as exc:
        expected = str(exc)
    try:
        found: object = decode_manifest(data)
    except InvalidArgument as exc:
        found = str(exc)
    assert found == expected


@pytest.mark.parametrize("case", list(CORNERS))
def test_the_piecewise_reader_accepts_nothing_the_exact_one_refuses(case: str) -> None:
    """The piecewise reader either agrees with the entry-by-entry one or leaves the manifest
    to it; on a plain valid manifest of many pieces it decides alone."""
    data = CORNERS[case]
    if not data.startswith(b'{"files":[') or not manifest_module._is_utf8(data):
        return
    pieces = manifest_module._scan_pieces(data, None)
    exact = manifest_module._scan(data, None)
    assert pieces is None or pieces == exact
    if case in ("many pieces", "an escape, pieces on", "a dotfile, pieces on"):
        assert exact is not None and pieces == exact


def test_the_fast_reader_hands_files_on_in_batches() -> None:
    entries = [FileEntry(f"f{i:05d}", 2, 0o600, A) for i in range(25_000)]
    data = encode_manifest(build_manifest(entries))
    batches: list[int] = []
    assert check_manifest(data, lambda batch: batches.append(len(batch))) == 25_000
    assert batches == [10_000, 10_000, 5_000]


def test_max_manifest_bytes_is_range_checked() -> None:
    env = {"PINVAULT_ADMISSION_MAX_MANIFEST_BYTES": "4096"}
    assert config.load(environ=env).admission.max_manifest_bytes == 4096
    with pytest.raises(InvalidArgument, match=r"admission\.max_manifest_bytes: expected 1024"):
        config.load(environ={"PINVAULT_ADMISSION_MAX_MANIFEST_BYTES": "10"})
    with pytest.raises(InvalidArgument, match=r"admission\.max_manifest_bytes"):
        config.load(environ={"PINVAULT_ADMISSION_MAX_MANIFEST_BYTES": str(2**30)})


# -- admission ---------------------------------------------------------------------------------


def test_a_bad_manifest_is_refused_again_without_being_read(lab: Lab) -> None:
    bad = lab.pinned("dataset", manifest("d", "d/a.txt"))
    first = refusal(lab, bad)
    assert "is not a dataset manifest" in first and "'d' is a file and also the folder" in first
    # Its bytes gone: a refusal that read them again would say so.
    lab.blob_path(bad).unlink()
    assert refusal(lab, bad) == first


def test_a_dataset_missing_files_is_refused_again_from_memory(lab: Lab) -> None:
    absent = "sha256:" + os.urandom(32).hex()
    dataset = lab.pinned("dataset", manifest("a", "b", digest=absent))
    first = refusal(lab, dataset)
    assert f"dataset {dataset} is missing 1 of its 2 files' content (first: a)" in first
    lab.blob_path(dataset).unlink()
    assert refusal(lab, dataset) == first


@pytest.mark.parametrize("engine", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_dataset_giving_a_stored_file_a_wrong_size_is_refused_naming_it(
    start_vault: StartVault, request: pytest.FixtureRequest, engine: str
) -> None:
    database = request.getfixturevalue("postgres_url") if engine == "postgres" else None
    lab = Lab(start_vault(database=database))
    try:
        _refuse_wrong_size(lab)
    finally:
        lab.client.close()


def _refuse_wrong_size(lab: Lab) -> None:
    good, stored = os.urandom(10), os.urandom(100)
    lab.put(good)
    lab.put(stored)
    entries = [
        FileEntry("good.bin", len(good), 0o644, "sha256:" + hashlib.sha256(good).hexdigest()),
        FileEntry("wrong.bin", 99, 0o644, "sha256:" + hashlib.sha256(stored).hexdigest()),
    ]
    dataset = lab.pinned("dataset", encode_manifest(build_manifest(entries)))
    first = refusal(lab, dataset)
    assert (
        f"dataset {dataset} says 'wrong.bin' is 99 bytes, but its content "
        f"sha256:{hashlib.sha256(stored).hexdigest()} is stored with 100 bytes"
    ) in first
    # Neither the blob nor the manifest can change: the verdict is kept for good.
    lab.blob_path(dataset).unlink()
    assert refusal(lab, dataset) == first


def test_a_dataset_whose_files_are_put_later_is_admitted_after_the_short_refusal(
    start_vault: StartVault,
) -> None:
    lab = Lab(start_vault(env={"PINVAULT_ADMISSION_VERIFY_INTERVAL": "1"}))
    try:
        late = os.urandom(100)
        entries = [
            FileEntry("late.bin", len(late), 0o644, "sha256:" + hashlib.sha256(late).hexdigest())
        ]
        dataset = lab.pinned("dataset", encode_manifest(build_manifest(entries)))
        refused_at = time.monotonic()
        assert "is missing 1 of its 1 files' content (first: late.bin)" in refusal(lab, dataset)
        lab.put(late)
        if time.monotonic() - refused_at < 0.8:
            assert "is missing 1 of its 1" in refusal(lab, dataset), "kept for a second"
        time.sleep(max(0.0, refused_at + 1.2 - time.monotonic()))
        assert lab.admit(dataset=dataset).new
    finally:
        lab.client.close()


def test_a_manifest_over_max_manifest_bytes_is_refused_naming_the_setting(
    start_vault: StartVault,
) -> None:
    lab = Lab(start_vault(env={"PINVAULT_ADMISSION_MAX_MANIFEST_BYTES": "1024"}))
    try:
        data = manifest(*(f"file-{i:03d}" for i in range(20)))
        assert len(data) > 1024
        dataset = lab.pinned("dataset", data)
        message = refusal(lab, dataset)
        assert re.search(
            rf"dataset {dataset} is {len(data)} bytes, more than a manifest may be "
            r"\(admission\.max_manifest_bytes is 1024\)",
            message,
        ), message
        # The lab's own small manifest is still admitted.
        assert lab.admit().new
    finally:
        lab.client.close()


def test_a_manifest_of_many_mib_is_read_whole_and_admitted(lab: Lab) -> None:
    content = os.urandom(10)
    lab.put(content)
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    entries = [FileEntry(f"shard-{i:06d}/part.bin", 10, 0o644, digest) for i in range(60_000)]
    data = encode_manifest(build_manifest(entries))
    assert len(data) > 6 * 1024 * 1024  # many of the store's chunks
    assert lab.admit(dataset=lab.pinned("dataset", data)).new
