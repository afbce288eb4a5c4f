"""A put's bytes against the copy the hot tier already holds under the same digest: the put has
just hashed every byte it brings, so its chunk list says what that copy must be, and a copy
damaged on disk is found, and replaced from the put's bytes, at the cost of one read of it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from vault.errors import IntegrityError
from vault.store.chunks import ChunkList

# What the tier journal records of such a repair.
REWRITTEN: Final = "rewrote the damaged copy from the bytes of a put, which match the digest"

# Where a stored copy differs from the blob: the byte offset of its first bad chunk (None when
# its size is wrong, or it cannot be read), and what was found there.
Damage = tuple[int | None, str]


def damage(
    chunks: ChunkList, stored_size: int, pieces: Iterable[bytes | memoryview]
) -> Damage | None:
    """Where the stored copy whose size is `stored_size` and whose bytes come in `pieces` (one
    a chunk, as read) differs from the blob `chunks` describes; None if it holds exactly it."""
    if stored_size != chunks.size:
        return None, (
            f"stored copy of {chunks.sha256} is damaged: it has {stored_size} bytes, "
            f"expected {chunks.size}"
        )
    checked = 0
    try:
        for index, data in enumerate(pieces):
            chunks.check(index, data)
            checked = index + 1
    except IntegrityError as error:
        return chunks.span(checked)[0], str(error)
    except OSError as error:
        return chunks.span(checked)[0] if checked < chunks.count else None, (
            f"stored copy of {chunks.sha256} cannot be read: {error.strerror or error}"
        )
    if checked != chunks.count:
        # The file was cut short while it was read.
        return chunks.span(checked)[0], (
            f"stored copy of {chunks.sha256} is damaged: it ends within chunk {checked}"
        )
    return None
