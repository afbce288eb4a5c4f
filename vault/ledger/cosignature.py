"""Witness cosignatures on checkpoints (c2sp.org/tlog-cosignature, cosignature/v1): a witness's
verifier key, the signature lines a witness adds to a checkpoint note, and the rule that k of n
named witnesses must have cosigned a checkpoint before it is believed. No I/O here."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from vault.errors import InvalidArgument, VerificationError
from vault.ledger.checkpoint import (
    ALG_ED25519,
    MAX_NOTE_BYTES,
    Checkpoint,
    NoteKey,
    b64decode,
    b64encode,
    signature_line,
)

ALG_COSIGNATURE_V1: Final = 0x04
# A cosignature/v1 signature: an 8-byte big-endian timestamp, then the Ed25519 signature.
TIMESTAMP_SIZE: Final = 8
SIGNATURE_SIZE: Final = TIMESTAMP_SIZE + 64
# How many witnesses a client or a server may name: far more than any deployment asks.
MAX_WITNESSES: Final = 64

_SIGNATURE_PREFIX: Final = "— "
_KEY_ID = re.compile(r"[0-9a-fA-F]{8}")
_SEPARATORS = re.compile(r"[\s,]+")


def cosigned_message(timestamp: int, body: str) -> bytes:
    """What a witness signs: the cosignature/v1 header, then the checkpoint's note text."""
    return f"cosignature/v1\ntime {timestamp}\n{body}".encode()


class WitnessKey(NoteKey):
    """A witness's cosignature/v1 verifier key, `<name>+<hex8 key id>+<base64(0x04 || key)>`."""

    ALGORITHM = ALG_COSIGNATURE_V1
    WHAT = "witness key"
    NAME = "witness"
    __slots__ = ()

    @classmethod
    def from_string(cls, vkey: str) -> WitnessKey:
        malformed = (
            f"malformed witness key {vkey[:80]!r}: expected "
            "<name>+<8 hex digits>+<base64 of 0x04 and a 32-byte Ed25519 key>"
        )
        name, sep1, rest = vkey.partition("+")
        key_id_hex, sep2, key_b64 = rest.partition("+")
        if not (sep1 and sep2) or not _KEY_ID.fullmatch(key_id_hex):
            raise InvalidArgument(malformed)
        try:
            key = b64decode(key_b64)
        except ValueError:
            raise InvalidArgument(f"{malformed} (the key is not base64)") from None
        if len(key) == 33 and key[0] == ALG_ED25519:
            raise InvalidArgument(
                f"{vkey[:80]!r} is a checkpoint signing key's verifier (algorithm 0x01), not a "
                "witness's cosignature/v1 key (algorithm 0x04)"
            )
        if len(key) != 33 or key[0] != ALG_COSIGNATURE_V1:
            raise InvalidArgument(malformed)
        return cls._checked(vkey, name, key_id_hex, key[1:])

    def signs(self, name: str, key_id: bytes) -> bool:
        """Whether a signature line naming `name` with `key_id` claims to be by this key."""
        return name == self._name and key_id == self._key_id

    def verify(self, body: str, signature: bytes) -> Cosignature:
        """The cosignature `signature` (timestamp and Ed25519 signature) on the checkpoint note
        text `body`, once it verifies; VerificationError otherwise."""
        if len(signature) != SIGNATURE_SIZE:
            raise VerificationError(
                f"cosignature by witness {self.label} is {len(signature)} bytes, not "
                f"{SIGNATURE_SIZE}: it was truncated or altered"
            )
        from cryptography.exceptions import InvalidSignature

        (timestamp,) = struct.unpack(">Q", signature[:TIMESTAMP_SIZE])
        try:
            self._key.verify(signature[TIMESTAMP_SIZE:], cosigned_message(timestamp, body))
        except InvalidSignature:
            raise VerificationError(
                f"cosignature by witness {self.label} does not verify: the checkpoint or the "
                "cosignature was altered"
            ) from None
        line = f"{_SIGNATURE_PREFIX}{self._name} {b64encode(self._key_id + signature)}\n"
        return Cosignature(self, timestamp, line)


@dataclass(frozen=True, slots=True)
class Cosignature:
    """A verified cosignature: by which witness, at what time (seconds since the epoch, as the
    witness says), and its signature line as it appears in the note."""

    witness: WitnessKey
    timestamp: int
    line: str


def split_note(note: str) -> tuple[str, list[str]]:
    """A signed note's text (ending in its newline) and its signature lines."""
    if len(note) > MAX_NOTE_BYTES:
        raise VerificationError(f"note refused: it is over {MAX_NOTE_BYTES} bytes")
    split = note.rfind("\n\n")
    if split < 0 or not note.endswith("\n"):
        raise VerificationError(
            "malformed note: no blank line separates the text from the signatures"
        )
    return note[: split + 1], note[split + 2 : -1].split("\n")


def cosignatures(
    body: str, lines: Iterable[str], witnesses: Iterable[WitnessKey]
) -> dict[WitnessKey, Cosignature]:
    """The cosignatures among signature `lines` on the note text `body` by each of `witnesses`
    that cosigned it. Lines by other keys are ignored, as c2sp.org/signed-note asks; a line
    that claims to be by one of `witnesses` and does not verify is an error, as in Go's note
    package."""
    wanted = list(witnesses)
    found: dict[WitnessKey, Cosignature] = {}
    for line in lines:
        parsed = signature_line(line)
        if parsed is None:
            raise VerificationError(
                f"malformed signature line {line[:60]!r}: expected '— <key name> <base64>'"
            )
        name, key_id, signature = parsed
        for witness in wanted:
            if witness.signs(name, key_id):
                found.setdefault(witness, witness.verify(body, signature))
    return found


class WitnessPolicy:
    """Which witnesses must have cosigned a checkpoint: at least `required` of `witnesses`."""

    __slots__ = ("required", "witnesses")

    def __init__(self, witnesses: Sequence[WitnessKey], required: int | None = None) -> None:
        if not witnesses:
            raise InvalidArgument("a witness policy needs at least one witness key")
        if len(witnesses) > MAX_WITNESSES:
            raise InvalidArgument(
                f"{len(witnesses)} witness keys given, at most {MAX_WITNESSES} are allowed"
            )
        seen: set[WitnessKey] = set()
        for witness in witnesses:
            if witness in seen:
                raise InvalidArgument(f"witness key {witness.label} is given twice")
            seen.add(witness)
        k = len(witnesses) if required is None else required
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(witnesses):
            raise InvalidArgument(
                f"the cosignatures required must be 1 to the {len(witnesses)} witness keys "
                f"given, found {required!r}"
            )
        self.witnesses = tuple(witnesses)
        self.required = k

    @classmethod
    def from_strings(cls, keys: Iterable[str], required: int | None = None) -> WitnessPolicy:
        return cls([WitnessKey.from_string(key) for key in keys], required)

    def check(self, note: str) -> list[Cosignature]:
        """The verified cosignatures of the required witnesses on the signed checkpoint
        `note`, in the order the witnesses were named; VerificationError naming the missing
        witnesses unless at least `required` of them cosigned it."""
        body, lines = split_note(note)
        checkpoint = Checkpoint.parse_body(body)
        found = cosignatures(body, lines, self.witnesses)
        if len(found) < self.required:
            missing = [w.label for w in self.witnesses if w not in found]
            raise VerificationError(
                f"the checkpoint of size {checkpoint.size} is cosigned by {len(found)} of the "
                f"witnesses required ({self.required} of {len(self.witnesses)}): no valid "
                f"cosignature by {', '.join(missing)}"
            )
        return [found[w] for w in self.witnesses if w in found]


def split_witness_keys(text: str) -> list[str]:
    """The witness keys a configuration value lists, separated by spaces, commas or new
    lines."""
    return [key for key in _SEPARATORS.split(text.strip()) if key]


def require(note: str, witnesses: Sequence[WitnessKey], k: int | None = None) -> list[Cosignature]:
    """The cosignatures on `note` once at least `k` of `witnesses` (default: all) cosigned it;
    VerificationError naming the witnesses missing otherwise."""
    return WitnessPolicy(witnesses, k).check(note)
