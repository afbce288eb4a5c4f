"""A batch put answers for each blob what the vault holds: its digests and size as the vault
hashed them, whether the batch stored it anew, and when the vault first stored it, which a blob
put again (in the same batch or a later one) keeps."""

from __future__ import annotations

import hashlib
import random

import blake3

from tests.conftest import StartVault
from vault.digest import Digest


def random_bytes(size: int, seed: object) -> bytes:
    return random.Random(str(seed)).randbytes(size)


def test_a_batch_answers_each_blob_with_the_time_it_was_first_stored(
    start_vault: StartVault,
) -> None:
    server = start_vault()
    old, new, other = (random_bytes(4096, name) for name in ("old", "new", "other"))
    with server.client() as client:
        (first,) = client.put_many([old])
        # Expected digests of either algorithm, and none: each is checked against the answer.
        results = client.put_many(
            [new, old, new, other],
            expected=[
                f"sha256:{hashlib.sha256(new).hexdigest()}",
                f"blake3:{blake3.blake3(old).hexdigest()}",
                None,
                f"blake3:{blake3.blake3(other).hexdigest()}",
            ],
        )
        stats = [client.stat(str(result.blob.sha256)) for result in results]
    assert [result.created for result in results] == [True, False, False, True]
    for result, data, stat in zip(results, [new, old, new, other], stats, strict=True):
        assert result.blob.sha256 == Digest.sha256(hashlib.sha256(data).digest())
        assert result.blob.blake3 == Digest.blake3(blake3.blake3(data).digest())
        assert result.blob.size == len(data)
        assert result.blob.stored_at == stat.blob.stored_at
    assert first.created
    assert results[1].blob.stored_at == first.blob.stored_at
    assert results[0].blob.stored_at == results[2].blob.stored_at > first.blob.stored_at
