"""Admission looks a dataset's files up a batch of digests to a query, each batch handed to the
database as one parameter that it slices, sorts and looks up itself: against a real `vault
serve` on SQLite and on PostgreSQL, a manifest of more files than one batch holds is refused
naming how many of its distinct digests are missing and the first such file in manifest order,
whichever batch and place in it they fall on, and admitted once they are stored."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest

from tests.conftest import StartVault
from tests.test_admission import Lab
from vault.errors import FailedPrecondition
from vault.server.content import _LOOKUP_BATCH
from vault.store.manifest import FileEntry, build_manifest, encode_manifest

# More distinct digests than one batch of look-ups holds, so that there are two.
FILES = _LOOKUP_BATCH + 2_000
# Refusals for missing files are not kept: the files put later are looked up again at once.
ENV = {"PINVAULT_ADMISSION_VERIFY_INTERVAL": "0"}


def blob_whose_digest_starts(salt: bytes, first: set[int]) -> bytes:
    """Bytes whose SHA-256 starts with one of the bytes `first`."""
    for n in range(1_000_000):
        data = salt + n.to_bytes(4, "big")
        if hashlib.sha256(data).digest()[0] in first:
            return data
    raise AssertionError("no such blob")


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def lab(request: pytest.FixtureRequest, start_vault: StartVault) -> Iterator[Lab]:
    database = request.getfixturevalue("postgres_url") if request.param == "postgres" else None
    lab = Lab(start_vault(database=database, env=ENV))
    yield lab
    lab.client.close()


def test_missing_files_are_found_in_every_batch_and_named_in_manifest_order(lab: Lab) -> None:
    salt = os.urandom(8)
    # Stored files' digests start with neither 0x00 nor 0xff, so that the missing digest that
    # starts with 0x00 is looked up first of all, and the one that starts with 0xff last.
    stored = [
        blob_whose_digest_starts(salt + i.to_bytes(4, "big"), set(range(1, 255)))
        for i in range(FILES - 3)
    ]
    first = blob_whose_digest_starts(salt + b"first", {0x00})
    middle = blob_whose_digest_starts(salt + b"middle", {0x80})
    last = blob_whose_digest_starts(salt + b"last", {0xFF})
    contents = {f"f-{i:05d}": data for i, data in enumerate(stored)}
    contents |= {"f-08000": first, "f-10000": middle, "f-05000": last, "f-11000": last}
    # Files that share a digest: stored (f-00003 and f-00007), missing (f-05000 and f-11000).
    contents["f-00007"] = contents["f-00003"]
    entries = [FileEntry(path, len(data), 0o644, sha256(data)) for path, data in contents.items()]
    dataset = lab.pinned("dataset", encode_manifest(build_manifest(entries)))
    assert len({entry.sha256 for entry in entries}) > _LOOKUP_BATCH
    for at in range(0, len(stored), _LOOKUP_BATCH):
        lab.client.put_many(stored[at : at + _LOOKUP_BATCH])

    with pytest.raises(FailedPrecondition) as refused:
        lab.admit(dataset=dataset)
    assert str(refused.value) == (
        f"dataset {dataset} is missing 3 of its {len(entries)} files' content (first: f-05000)"
    )

    lab.put(last)
    with pytest.raises(FailedPrecondition) as refused:
        lab.admit(dataset=dataset)
    assert str(refused.value) == (
        f"dataset {dataset} is missing 2 of its {len(entries)} files' content (first: f-08000)"
    )

    lab.client.put_many([first, middle])
    assert lab.admit(dataset=dataset).new
