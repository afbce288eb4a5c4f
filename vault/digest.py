"""Digests as OCI spells them: `algorithm:hex`. `sha256:` is canonical; `blake3:` is an alias
computed in the same pass over the bytes."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final

import blake3

from vault.errors import InvalidArgument

ALGORITHMS: Final = ("sha256", "blake3")
HEX_LENGTH: Final = 64
_HEX = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"(?:sha256|blake3):[0-9a-f]{64}")
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")


def check_digest(text: str) -> str:
    """`text` itself if it is a well-formed digest (the fast path of pins and look-ups), else
    the InvalidArgument that `Digest.parse` explains."""
    if isinstance(text, str) and _DIGEST.fullmatch(text):
        return text
    return str(Digest.parse(text))


def is_sha256(text: str) -> bool:
    """Whether `text` is a well-formed sha256 digest."""
    return _SHA256.fullmatch(text) is not None


# The byte before the raw bytes of a digest key, for each algorithm but SHA-256 (whose key is its
# 32 raw bytes alone).
_KEY_TAGS: Final = {"blake3": b"\x01"}
_KEY_ALGORITHMS: Final = {tag[0]: algorithm for algorithm, tag in _KEY_TAGS.items()}


def digest_key(text: str) -> bytes:
    """The bytes an index keys a well-formed digest by: a SHA-256 digest's 32 raw bytes, any
    other's raw bytes after a byte naming its algorithm."""
    algorithm, _, hex_part = text.partition(":")
    raw = bytes.fromhex(hex_part)
    return raw if algorithm == "sha256" else _KEY_TAGS[algorithm] + raw


def digest_from_key(key: bytes) -> str:
    """The digest `digest_key` gave `key`."""
    if len(key) == HEX_LENGTH // 2:
        return "sha256:" + key.hex()
    return f"{_KEY_ALGORITHMS[key[0]]}:{key[1:].hex()}"


@dataclass(frozen=True, slots=True)
class Digest:
    algorithm: str
    hex: str

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hex}"

    @property
    def raw(self) -> bytes:
        return bytes.fromhex(self.hex)

    @classmethod
    def parse(cls, text: str) -> Digest:
        """Parse `algorithm:hex`, naming exactly what is wrong when it is not a digest."""
        if not isinstance(text, str) or not text:
            raise InvalidArgument("empty digest: expected 'sha256:<64 hex digits>'")
        shown = text if len(text) <= 80 else text[:77] + "..."
        algorithm, sep, hex_part = text.partition(":")
        if not sep:
            raise InvalidArgument(
                f"malformed digest {shown!r}: expected 'sha256:<64 hex digits>' "
                "(a floating tag or bare hex is not a digest)"
            )
        if algorithm not in ALGORITHMS:
            raise InvalidArgument(
                f"unknown digest algorithm {algorithm!r} in {shown!r}: "
                f"expected one of {', '.join(ALGORITHMS)}"
            )
        if len(hex_part) != HEX_LENGTH:
            raise InvalidArgument(
                f"wrong length for {algorithm} digest {shown!r}: "
                f"expected {HEX_LENGTH} hex digits, found {len(hex_part)}"
            )
        if not _HEX.fullmatch(hex_part):
            raise InvalidArgument(
                f"malformed digest {shown!r}: expected lowercase hex digits after '{algorithm}:'"
            )
        return cls(algorithm, hex_part)

    @classmethod
    def sha256(cls, raw: bytes) -> Digest:
        return cls("sha256", raw.hex())

    @classmethod
    def blake3(cls, raw: bytes) -> Digest:
        return cls("blake3", raw.hex())


class Hasher:
    """SHA-256 and BLAKE3 over one stream of bytes, in one pass."""

    __slots__ = ("_b3", "_sha", "size")

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._b3 = blake3.blake3()
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        self._sha.update(data)
        self._b3.update(data)
        self.size += len(data)

    def digests(self) -> tuple[Digest, Digest]:
        return Digest.sha256(self._sha.digest()), Digest.blake3(self._b3.digest())


def sha256_of(data: bytes) -> Digest:
    return Digest.sha256(hashlib.sha256(data).digest())


def blake3_of(data: bytes) -> Digest:
    return Digest.blake3(blake3.blake3(data).digest())
