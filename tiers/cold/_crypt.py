"""Encryption of what the cold tier writes to a mirror that other people administer: the lab's
key ring, each stored chunk and each index sealed with AES-256-GCM, and index objects named by
a keyed hash of the digest, so that the mirror learns neither the bytes nor which blobs it holds.

A sealed chunk is `nonce || ciphertext || tag`, its nonce random (96 bits: under one key, the
chance of a repeat stays below 2^-32 for the first 2^32 chunks, some 4 PiB). Its associated
data binds it to its copy (a random object id, chosen per copy) and its position, so that a
chunk moved to another object or place fails to open. A sealed index is bound to the name it
is kept under, which is derived from the blob's digest: an index moved under another blob's
name fails to open."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from vault.digest import Digest
from vault.errors import ConfigError, IntegrityError

KEY_SIZE: Final = 32
NONCE_SIZE: Final = 12
TAG_SIZE: Final = 16
# What sealing adds to each stored chunk.
OVERHEAD: Final = NONCE_SIZE + TAG_SIZE
OBJECT_ID_SIZE: Final = 16
# The key ring line whose key names index objects (never used to encrypt): names must not
# change when the keys that encrypt are rotated.
NAMES_ID: Final = "names"

SEALED_MAGIC: Final = b"PVCE"
_SEALED_VERSION: Final = 1
# magic, version, key id length, 2 zero bytes, sealed index length, nonce
SEALED_HEADER = struct.Struct(">4sBB2xI12s")
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_CHUNK_AD: Final = b"pinvault-cold-chunk\0"
_INDEX_AD: Final = b"pinvault-cold-index\0"
_POSITION = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class DataKey:
    """One key of the ring: its id (kept in clear in each object it sealed) and its cipher."""

    id: str
    aead: AESGCM


class KeyRing:
    """The lab's keys for its encrypted mirrors, from a file of `ID BASE64KEY` lines (32-byte
    keys; `#` comments and blank lines ignored). The first data key seals new writes; every one
    opens reads; the line `names BASE64KEY` holds the key that names index objects."""

    def __init__(self, keys: list[tuple[str, bytes]], names: bytes, source: str) -> None:
        if not keys:
            raise ConfigError(f"key ring {source}: no key to encrypt with")
        self.source = source
        self.keys = [DataKey(key_id, AESGCM(key)) for key_id, key in keys]
        self.current = self.keys[0]
        self._by_id = {key.id: key for key in self.keys}
        self._names = names

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyRing:
        """The ring in file `path`; ConfigError, naming the file and line, if it cannot be read
        or is not a key ring."""
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise ConfigError(f"cannot read the mirror key ring {source}: {reason}") from None
        keys: list[tuple[str, bytes]] = []
        names: bytes | None = None
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            key = _decode_key(fields[1]) if len(fields) == 2 else None
            if key is None or not _KEY_ID.fullmatch(fields[0]):
                raise ConfigError(
                    f"key ring {source} line {number}: expected `ID BASE64KEY` with an id of "
                    f"letters, digits, '.', '_' or '-' and a {KEY_SIZE}-byte key"
                )
            key_id = fields[0]
            if key_id == NAMES_ID:
                names = key
            elif any(key_id == known for known, _ in keys):
                raise ConfigError(f"key ring {source} line {number}: key id {key_id} is repeated")
            else:
                keys.append((key_id, key))
        if names is None:
            raise ConfigError(
                f"key ring {source}: no `{NAMES_ID} BASE64KEY` line (the key that names index "
                "objects)"
            )
        return cls(keys, names, source)

    def get(self, key_id: str) -> DataKey | None:
        return self._by_id.get(key_id)

    def name(self, sha256: Digest) -> str:
        """The hex of the keyed hash that names the blob's index object."""
        return hmac.new(self._names, sha256.raw, hashlib.sha256).hexdigest()


def new_key() -> str:
    """A fresh key, as a key ring line holds it."""
    return base64.b64encode(secrets.token_bytes(KEY_SIZE)).decode()


def _decode_key(text: str) -> bytes | None:
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return key if len(key) == KEY_SIZE else None


# -- chunks -----------------------------------------------------------------------------------


class ChunkSeal:
    """Seals and opens the stored chunks of one copy (one object id) under one key."""

    def __init__(self, key: DataKey, object_id: bytes) -> None:
        self.key = key
        self.object_id = object_id

    def seal(self, index: int, payload: bytes | bytearray | memoryview) -> bytes:
        nonce = secrets.token_bytes(NONCE_SIZE)
        return nonce + self.key.aead.encrypt(nonce, payload, self._associated(index))

    def open(self, index: int, stored: bytes, where: str) -> bytes:
        """The chunk's payload (raw or a zstd frame); IntegrityError naming `where` (the chunk)
        if it was altered, moved or sealed for another copy."""
        if len(stored) < OVERHEAD:
            raise IntegrityError(f"{where} is damaged: {len(stored)} sealed bytes")
        try:
            return self.key.aead.decrypt(
                stored[:NONCE_SIZE], stored[NONCE_SIZE:], self._associated(index)
            )
        except InvalidTag:
            raise IntegrityError(
                f"{where} is damaged: it does not open under key {self.key.id} (altered, or "
                "moved from another copy or place)"
            ) from None

    def _associated(self, index: int) -> bytes:
        return _CHUNK_AD + self.object_id + _POSITION.pack(index)


# -- indexes ----------------------------------------------------------------------------------


def seal_index(key: DataKey, name: str, object_id: bytes, index: bytes) -> bytes:
    """A sealed index object's leading bytes: the clear header (magic, version, key id, nonce)
    and `object_id || index` sealed, bound to `name`, the object's name below the tier's
    prefix."""
    nonce = secrets.token_bytes(NONCE_SIZE)
    key_id = key.id.encode()
    sealed = key.aead.encrypt(nonce, object_id + index, _INDEX_AD + name.encode() + key_id)
    header = SEALED_HEADER.pack(SEALED_MAGIC, _SEALED_VERSION, len(key_id), len(sealed), nonce)
    return header + key_id + sealed


def sealed_length(head: bytes) -> int:
    """The length of a sealed index from its first SEALED_HEADER.size bytes."""
    id_length: int
    sealed: int
    _, _, id_length, sealed, _ = SEALED_HEADER.unpack_from(head)
    return SEALED_HEADER.size + id_length + sealed


def open_index(ring: KeyRing, head: bytes, name: str, where: str) -> tuple[DataKey, bytes, bytes]:
    """The key, object id and plain index of a sealed index object whose leading bytes are
    `head` (at least sealed_length of them); IntegrityError naming `where` if it is not one, is
    under a key the ring lacks, or does not open (altered, or moved from another name)."""
    if len(head) < SEALED_HEADER.size:
        raise IntegrityError(f"{where} is damaged: only {len(head)} bytes")
    magic, version, id_length, sealed, nonce = SEALED_HEADER.unpack_from(head)
    if magic != SEALED_MAGIC or version != _SEALED_VERSION:
        raise IntegrityError(
            f"{where} is not a version {_SEALED_VERSION} sealed index (found magic {magic!r}, "
            f"version {version}): this mirror is encrypted"
        )
    end = SEALED_HEADER.size + id_length + sealed
    if len(head) < end:
        raise IntegrityError(f"{where} is damaged: {len(head)} bytes, expected {end}")
    raw_id = head[SEALED_HEADER.size : SEALED_HEADER.size + id_length]
    key_id = raw_id.decode("utf-8", "replace")
    key = ring.get(key_id)
    if key is None:
        raise IntegrityError(
            f"{where} is unreadable: it is sealed under key {key_id!r}, which the key ring "
            f"{ring.source} no longer holds"
        )
    try:
        plain = key.aead.decrypt(
            nonce, head[SEALED_HEADER.size + id_length : end], _INDEX_AD + name.encode() + raw_id
        )
    except InvalidTag:
        raise IntegrityError(
            f"{where} is damaged: it does not open under key {key_id} (altered, or moved from "
            "another blob's name)"
        ) from None
    if len(plain) < OBJECT_ID_SIZE:
        raise IntegrityError(f"{where} is damaged: its sealed index is empty")
    return key, plain[:OBJECT_ID_SIZE], plain[OBJECT_ID_SIZE:]


def new_object_id() -> bytes:
    return secrets.token_bytes(OBJECT_ID_SIZE)
