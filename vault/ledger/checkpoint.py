"""Checkpoints: C2SP tlog-checkpoint bodies in Ed25519 signed notes (c2sp.org/signed-note, as
golang.org/x/mod/sumdb/note writes them), with the signing key and the verifier key."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final, Self

from vault.errors import InvalidArgument, VerificationError
from vault.ledger.merkle import HASH_SIZE

ALG_ED25519: Final = 0x01
MAX_NOTE_BYTES: Final = 1 << 20
MAX_SIGNATURES: Final = 100
# Go's note package parses the size as an int64; anything larger is not a checkpoint it reads.
MAX_TREE_SIZE: Final = (1 << 63) - 1

_SIGNATURE_PREFIX: Final = "— "
_PRIVATE_KEY_PREFIX: Final = "PRIVATE+KEY+"
_KEY_ID = re.compile(r"[0-9a-fA-F]{8}")
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    """Standard base64 with padding, refusing any other character (Go's StdEncoding)."""
    if not text.isascii():
        raise ValueError("not base64")
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from None


def is_valid_name(name: str) -> bool:
    """A note key name: non-empty, no Unicode space, no '+', no control character."""
    return (
        bool(name)
        and "+" not in name
        and not any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in name)
    )


def signature_line(line: str) -> tuple[str, bytes, bytes] | None:
    """A note's signature line `— <name> <base64(key id || signature)>` (without its newline):
    the name, the key id and the signature; None if it is not one."""
    if not line.startswith(_SIGNATURE_PREFIX):
        return None
    name, _, encoded = line[len(_SIGNATURE_PREFIX) :].partition(" ")
    try:
        raw = b64decode(encoded)
    except ValueError:
        return None
    if not is_valid_name(name) or len(raw) < 5:
        return None
    return name, raw[:4], raw[4:]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A signed tree head: the ledger named `origin` had `size` entries with Merkle root `root`."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.origin or any(ord(c) < 0x20 for c in self.origin):
            raise ValueError(f"a checkpoint origin is one non-empty line, found {self.origin!r}")
        if (
            not isinstance(self.size, int)
            or isinstance(self.size, bool)
            or not 0 <= self.size <= MAX_TREE_SIZE
        ):
            raise ValueError(f"a checkpoint size is 0 to {MAX_TREE_SIZE}, found {self.size!r}")
        if not isinstance(self.root, bytes) or len(self.root) != HASH_SIZE:
            raise ValueError(f"a checkpoint root is {HASH_SIZE} bytes")
        for line in self.extensions:
            if not line or any(ord(c) < 0x20 for c in line):
                raise ValueError(f"a checkpoint extension is one non-empty line, found {line!r}")

    def body(self) -> str:
        """The note text: origin, size, base64 root and any extension lines, each ending `\\n`."""
        lines = [self.origin, str(self.size), b64encode(self.root), *self.extensions]
        return "".join(line + "\n" for line in lines)

    @classmethod
    def parse_body(cls, text: str) -> Checkpoint:
        """Parse a note text as a checkpoint, refusing anything `body()` would not produce."""
        if not text.endswith("\n"):
            raise VerificationError("malformed checkpoint: the text does not end with a newline")
        lines = text[:-1].split("\n")
        if len(lines) < 3:
            raise VerificationError(
                f"malformed checkpoint: {len(lines)} lines, expected origin, size and root"
            )
        origin, size_line, root_line, *extensions = lines
        if not origin:
            raise VerificationError("malformed checkpoint: the origin line is empty")
        if not _DECIMAL.fullmatch(size_line) or int(size_line) > MAX_TREE_SIZE:
            raise VerificationError(
                f"malformed checkpoint: size line {size_line[:40]!r} is not a decimal number "
                f"without leading zeros, at most {MAX_TREE_SIZE}"
            )
        try:
            root = b64decode(root_line)
        except ValueError:
            root = b""
        if len(root) != HASH_SIZE or b64encode(root) != root_line:
            raise VerificationError(
                f"malformed checkpoint: root line {root_line[:60]!r} is not the base64 of a "
                f"{HASH_SIZE}-byte hash"
            )
        if any(not line for line in extensions):
            raise VerificationError("malformed checkpoint: an extension line is empty")
        try:
            return cls(origin, int(size_line), root, tuple(extensions))
        except ValueError as exc:
            raise VerificationError(f"malformed checkpoint: {exc}") from None


class NoteKey:
    """An Ed25519 public key named as c2sp.org/signed-note names keys,
    `<name>+<hex8 key id>+<base64(algorithm byte || key)>`, where the key id is the first 4
    bytes of SHA-256(name || '\\n' || algorithm byte || key). Subclasses set the algorithm."""

    ALGORITHM: ClassVar[int]
    # How messages call the key, and its name.
    WHAT: ClassVar[str] = "verifier key"
    NAME: ClassVar[str] = "key"

    __slots__ = ("_key", "_key_id", "_name", "_public")

    def __init__(self, name: str, public_key: bytes) -> None:
        if not is_valid_name(name):
            raise InvalidArgument(
                f"bad {self.NAME} name {name!r}: it must be non-empty, without spaces or '+'"
            )
        if len(public_key) != 32:
            raise InvalidArgument(f"an Ed25519 public key is 32 bytes, found {len(public_key)}")
        # Loaded with the first key, not the module: a command that verifies no signature
        # (`vault stat`) starts without the signature code.
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        self._name = name
        self._public = bytes(public_key)
        self._key = Ed25519PublicKey.from_public_bytes(self._public)
        self._key_id = hashlib.sha256(
            name.encode() + b"\n" + bytes([self.ALGORITHM]) + self._public
        ).digest()[:4]

    @classmethod
    def _checked(cls, vkey: str, name: str, key_id_hex: str, public_key: bytes) -> Self:
        """The key `vkey` spells, once the key id it names is the key's own."""
        key = cls(name, public_key)
        if key.key_id.hex() != key_id_hex.lower():
            raise InvalidArgument(
                f"{cls.WHAT} {vkey[:80]!r} names key id {key_id_hex}, but its key has id "
                f"{key.key_id.hex()}: the key string is corrupt"
            )
        return key

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_id(self) -> bytes:
        return self._key_id

    @property
    def public_key(self) -> bytes:
        return self._public

    @property
    def label(self) -> str:
        """`<name>+<hex key id>`, how messages name this key."""
        return f"{self._name}+{self._key_id.hex()}"

    def __str__(self) -> str:
        return f"{self.label}+{b64encode(bytes([self.ALGORITHM]) + self._public)}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, NoteKey)
        return (self._name, self._public) == (other._name, other._public)

    def __hash__(self) -> int:
        return hash((self._name, self._public))


class Verifier(NoteKey):
    """Verifies checkpoints signed by one Ed25519 note key, named as in Go's note package."""

    ALGORITHM = ALG_ED25519
    __slots__ = ()

    @classmethod
    def from_string(cls, vkey: str) -> Verifier:
        """Parse a verifier key `<name>+<hex8 key id>+<base64(0x01 || public key)>`."""
        name, sep1, rest = vkey.partition("+")
        key_id_hex, sep2, key_b64 = rest.partition("+")
        if not (sep1 and sep2) or not _KEY_ID.fullmatch(key_id_hex):
            raise InvalidArgument(
                f"malformed verifier key {vkey[:80]!r}: expected <name>+<8 hex digits>+<base64 key>"
            )
        try:
            key = b64decode(key_b64)
        except ValueError:
            raise InvalidArgument(
                f"malformed verifier key {vkey[:80]!r}: the key is not base64"
            ) from None
        if len(key) != 33 or key[0] != ALG_ED25519:
            raise InvalidArgument(
                f"malformed verifier key {vkey[:80]!r}: expected an Ed25519 key "
                "(algorithm byte 0x01 and 32 bytes)"
            )
        return cls._checked(vkey, name, key_id_hex, key[1:])

    def open_note(self, note: str) -> str:
        """Verify a signed note and return its text (the signed part, with its final newline).

        Signatures by other keys are ignored, as c2sp.org/signed-note asks; one by this key
        must be present and every one by this key must verify."""
        if not isinstance(note, str):
            raise VerificationError(f"malformed note: expected text, found {type(note).__name__}")
        if len(note) > MAX_NOTE_BYTES:
            raise VerificationError(f"note refused: it is over {MAX_NOTE_BYTES} bytes")
        try:
            raw = note.encode("utf-8")
        except UnicodeEncodeError:
            raise VerificationError("malformed note: it is not valid UTF-8") from None
        if len(raw) > MAX_NOTE_BYTES:
            raise VerificationError(f"note refused: it is over {MAX_NOTE_BYTES} bytes")
        for char in note:
            if ord(char) < 0x20 and char != "\n":
                raise VerificationError(
                    f"malformed note: it contains control character U+{ord(char):04X}"
                )
        split = note.rfind("\n\n")
        if split < 0:
            raise VerificationError(
                "malformed note: no blank line separates the text from the signatures"
            )
        text, signatures = note[: split + 1], note[split + 2 :]
        if not signatures or not signatures.endswith("\n"):
            raise VerificationError(
                "malformed note: the signature block is empty or does not end with a newline"
            )
        lines = signatures[:-1].split("\n")
        if len(lines) > MAX_SIGNATURES:
            raise VerificationError(
                f"note refused: it has {len(lines)} signatures (at most {MAX_SIGNATURES})"
            )
        from cryptography.exceptions import InvalidSignature

        message = text.encode("utf-8")
        verified = False
        others: list[str] = []
        for number, line in enumerate(lines, start=1):
            if not line.startswith(_SIGNATURE_PREFIX):
                raise VerificationError(
                    f"malformed note: signature line {number} does not start with '— '"
                )
            parsed = signature_line(line)
            if parsed is None:
                raise VerificationError(
                    f"malformed note: signature line {number} is not "
                    "'— <key name> <base64 key id and signature>'"
                )
            name, key_id, signature = parsed
            if name != self._name or key_id != self._key_id:
                others.append(f"{name}+{key_id.hex()}")
                continue
            if len(signature) != 64:
                raise VerificationError(
                    f"signature by key {self.label} is {len(signature)} bytes, not 64: "
                    "the note was truncated or altered"
                )
            try:
                self._key.verify(signature, message)
            except InvalidSignature:
                raise VerificationError(
                    f"signature by key {self.label} does not verify: the checkpoint text "
                    "or the signature was altered"
                ) from None
            verified = True
        if not verified:
            found = f" (signed only by {', '.join(others)})" if others else ""
            raise VerificationError(f"checkpoint is not signed by key {self.label}{found}")
        return text

    def open(self, note: str) -> Checkpoint:
        """Verify a signed checkpoint note and return the checkpoint it states."""
        return Checkpoint.parse_body(self.open_note(note))


class SigningKey:
    """An Ed25519 note signing key, stored as Go's `PRIVATE+KEY+<name>+<id>+<base64>` string."""

    __slots__ = ("_key", "_name", "_seed", "_verifier")

    def __init__(self, name: str, seed: bytes) -> None:
        if len(seed) != 32:
            raise InvalidArgument(f"an Ed25519 seed is 32 bytes, found {len(seed)}")
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._key = Ed25519PrivateKey.from_private_bytes(bytes(seed))
        self._seed = bytes(seed)
        public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._verifier = Verifier(name, public)
        self._name = name

    @classmethod
    def generate(cls, name: str) -> SigningKey:
        return cls(name, os.urandom(32))

    @classmethod
    def from_string(cls, skey: str) -> SigningKey:
        """Parse `PRIVATE+KEY+<name>+<hex8 key id>+<base64(0x01 || seed)>`."""
        malformed = "malformed signing key: expected PRIVATE+KEY+<name>+<8 hex digits>+<base64>"
        if not skey.startswith(_PRIVATE_KEY_PREFIX):
            raise InvalidArgument(malformed)
        name, sep1, rest = skey[len(_PRIVATE_KEY_PREFIX) :].partition("+")
        key_id_hex, sep2, key_b64 = rest.partition("+")
        if not (sep1 and sep2) or not _KEY_ID.fullmatch(key_id_hex):
            raise InvalidArgument(malformed)
        try:
            key = b64decode(key_b64)
        except ValueError:
            raise InvalidArgument(f"{malformed} (the key is not base64)") from None
        if len(key) != 33 or key[0] != ALG_ED25519:
            raise InvalidArgument(f"{malformed} (expected an Ed25519 seed: 0x01 and 32 bytes)")
        signing_key = cls(name, key[1:])
        if signing_key.key_id.hex() != key_id_hex.lower():
            raise InvalidArgument(
                f"signing key for {name!r} names key id {key_id_hex}, but its public key has id "
                f"{signing_key.key_id.hex()}: the key string is corrupt"
            )
        return signing_key

    def __str__(self) -> str:
        encoded = b64encode(bytes([ALG_ED25519]) + self._seed)
        return f"{_PRIVATE_KEY_PREFIX}{self._name}+{self.key_id.hex()}+{encoded}"

    def __repr__(self) -> str:
        # Never print the seed.
        return f"SigningKey(name={self._name!r}, key_id={self.key_id.hex()!r})"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidArgument(
                f"cannot read signing key file {os.fspath(path)}: {exc.strerror or exc}"
            ) from None
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"signing key file {os.fspath(path)}: not a key (not UTF-8 text); expected one "
                f"line `{_PRIVATE_KEY_PREFIX}NAME+KEYID+KEY`"
            ) from None
        try:
            return cls.from_string(text.strip())
        except InvalidArgument as exc:
            raise InvalidArgument(f"signing key file {os.fspath(path)}: {exc}") from None

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key readable by its owner only, atomically: a crash leaves either no file
        or the whole key. Without `overwrite`, an existing key file is never replaced."""
        target = Path(path)
        folder = target.parent
        import tempfile

        fd, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(str(self) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            if overwrite:
                os.replace(temp_name, target)
            else:
                # link() fails if the target exists, so two writers cannot both win.
                os.link(temp_name, target)
                os.unlink(temp_name)
        except BaseException:
            if os.path.exists(temp_name):
                os.unlink(temp_name)
            raise
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_id(self) -> bytes:
        return self._verifier.key_id

    def verifier(self) -> Verifier:
        return self._verifier

    def sign_note(self, text: str) -> str:
        """Sign a note text (ending in a newline) and return the whole signed note."""
        if not text.endswith("\n"):
            raise ValueError("a note text must end with a newline")
        signature = self._key.sign(text.encode("utf-8"))
        return f"{text}\n{_SIGNATURE_PREFIX}{self._name} {b64encode(self.key_id + signature)}\n"

    def sign(self, checkpoint: Checkpoint) -> str:
        """The checkpoint as a signed note: body, blank line, `— <name> <base64 signature>`."""
        return self.sign_note(checkpoint.body())
