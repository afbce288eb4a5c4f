"""A run's inputs and its run id (docs/run-manifest.md).

A run id is the sha256 digest of the run's canonical inputs document: image, dataset, optional
config, seed, and the nonce the vault chose when it first admitted the run. The nonce makes a run
id unknowable before its admission (so nobody can pin into a run, or claim it, in advance); the
vault finds a team's existing run of the same inputs, so the same inputs are still the same run
for that team. Documents of runs admitted before nonces have none and keep their run ids. The
vault stores the document as a blob and every entry of the run names it as a subject, so
`vault lookup RUN_ID` lists the run.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, replace
from typing import Any, Final

from vault.canonical import canonical_json, load_json_object
from vault.digest import ALGORITHMS, Digest
from vault.errors import InvalidArgument

INPUTS_TYPE: Final = "pinvault.run-inputs"
INPUTS_VERSION: Final = 1
MAX_SEED: Final = 2**64 - 1
MAX_INPUTS_BYTES: Final = 4096
_FIELDS: Final = frozenset({"type", "v", "image", "dataset", "config", "seed", "nonce"})
# 128 random bits, chosen by the vault at admission.
NONCE_HEX: Final = 32
_NONCE: Final = re.compile(f"[0-9a-f]{{{NONCE_HEX}}}")


def parse_seed(value: str | int) -> int:
    """A seed as a user writes it: decimal or 0x-hex, 0 to 2**64-1."""
    if isinstance(value, int) and not isinstance(value, bool):
        seed = value
    else:
        text = str(value).strip()
        try:
            seed = int(text, 0)
        except ValueError:
            raise InvalidArgument(
                f"bad seed {text[:40]!r}: expected an integer, decimal or 0x-hex"
            ) from None
    if not 0 <= seed <= MAX_SEED:
        raise InvalidArgument(f"seed {seed} is out of range: expected 0 to 2**64-1")
    return seed


def _sha256_digest(name: str, value: str) -> str:
    if not value:
        raise InvalidArgument(f"no {name} digest: a run needs its {name} pinned by digest")
    if "@" in value:
        raise InvalidArgument(
            f"{name} {value[:80]!r} is a reference: give just its digest, the part after '@'"
        )
    algorithm, sep, _ = value.partition(":")
    if "/" in value or algorithm not in ALGORITHMS or not sep:
        raise InvalidArgument(
            f"{name} {value[:80]!r} is a floating name, not a digest: a tag can move, so a run "
            f"names its {name} by sha256:<64 hex digits>"
        )
    try:
        digest = Digest.parse(value)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{name}: {exc}") from None
    if digest.algorithm != "sha256":
        raise InvalidArgument(f"{name}: a run names its inputs by sha256, found {value!r}")
    return str(digest)


@dataclass(frozen=True, slots=True)
class RunInputs:
    """What makes a run the experiment it is."""

    image: str
    dataset: str
    seed: int
    config: str = ""
    # Chosen by the vault when it admits the run; "" in the inputs a job asks to run on, and in
    # runs admitted before run ids had one.
    nonce: str = ""

    @classmethod
    def checked(
        cls, *, image: str, dataset: str, seed: str | int, config: str = "", nonce: str = ""
    ) -> RunInputs:
        """Inputs from a caller, each refused with a message that names it when it is not a
        sha256 digest (a floating tag such as `name:tag` included)."""
        if nonce and not _NONCE.fullmatch(nonce):
            raise InvalidArgument(
                f"bad run nonce {nonce[:80]!r}: expected {NONCE_HEX} lowercase hex digits"
            )
        return cls(
            image=_sha256_digest("image", image),
            dataset=_sha256_digest("dataset", dataset),
            config=_sha256_digest("config", config) if config else "",
            seed=parse_seed(seed),
            nonce=nonce,
        )

    def with_nonce(self, nonce: str) -> RunInputs:
        return replace(self, nonce=nonce)

    @property
    def bare(self) -> RunInputs:
        """The inputs a job asks to run on: these without the vault's nonce."""
        return replace(self, nonce="") if self.nonce else self

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "type": INPUTS_TYPE,
            "v": INPUTS_VERSION,
            "image": self.image,
            "dataset": self.dataset,
            # A string: JSON readers disagree about integers above 2**53.
            "seed": str(self.seed),
        }
        if self.config:
            doc["config"] = self.config
        if self.nonce:
            doc["nonce"] = self.nonce
        return doc

    def encode(self) -> bytes:
        """The canonical (RFC 8785) bytes whose sha256 is the run id (of an admitted run: these
        inputs with the vault's nonce)."""
        return _canonical(self)[0]

    @property
    def run_id(self) -> str:
        return _canonical(self)[1]

    @property
    def subjects(self) -> tuple[str, ...]:
        return (
            (self.image, self.dataset, self.config)
            if self.config
            else (
                self.image,
                self.dataset,
            )
        )

    @classmethod
    def decode(cls, data: bytes) -> RunInputs:
        """Parse an inputs document; anything but the canonical form of valid inputs is
        refused."""
        obj = load_json_object("run inputs document", data, MAX_INPUTS_BYTES)
        if not set(obj) <= _FIELDS or obj.get("type") != INPUTS_TYPE:
            raise InvalidArgument(f"not a {INPUTS_TYPE} document")
        if obj.get("v") != INPUTS_VERSION:
            raise InvalidArgument(f"run inputs version {obj.get('v')!r} is not {INPUTS_VERSION}")
        if not isinstance(obj.get("seed"), str):
            raise InvalidArgument("run inputs seed must be a decimal string")
        if "nonce" in obj and not (isinstance(obj["nonce"], str) and obj["nonce"]):
            raise InvalidArgument("run inputs nonce must be a non-empty string")
        inputs = cls.checked(
            image=str(obj.get("image", "")),
            dataset=str(obj.get("dataset", "")),
            config=str(obj.get("config", "")),
            seed=obj["seed"],
            nonce=str(obj.get("nonce", "")),
        )
        if inputs.encode() != data:
            raise InvalidArgument("run inputs document is not in canonical form")
        return inputs


# The scheduler asks about the same runs again and again: their encodings are kept.
@functools.lru_cache(maxsize=4096)
def _canonical(inputs: RunInputs) -> tuple[bytes, str]:
    """The inputs' canonical bytes and the run id they make."""
    encoded = canonical_json(inputs.as_json())
    return encoded, "sha256:" + hashlib.sha256(encoded).hexdigest()
