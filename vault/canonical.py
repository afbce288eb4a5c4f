"""Canonical JSON documents (RFC 8785, JCS, for the values the project's documents hold): the
encoding of ledger entries, run inputs, dataset and run manifests, and the strict reader that
refuses anything that is not one canonical object."""

from __future__ import annotations

import json
from collections.abc import Mapping, Set
from typing import Any

from vault.errors import InvalidArgument


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def load_json_object(what: str, data: bytes, limit: int) -> dict[str, Any]:
    """A JSON object from bytes that should be one canonical document: refused, naming `what`,
    when larger than `limit`, not UTF-8 JSON, not an object, or holding a key twice or a
    constant JSON does not have (NaN, Infinity), which Python's reader would otherwise let
    through."""
    if len(data) > limit:
        raise InvalidArgument(f"{what} is {len(data)} bytes (at most {limit})")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                raise InvalidArgument(f"{what}: key {key!r} appears twice in an object")
            obj[key] = value
        return obj

    def no_constant(name: str) -> Any:
        raise InvalidArgument(f"{what}: {name} is not JSON")

    try:
        obj = json.loads(
            data.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constant
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{what} is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument(f"{what} is nested too deeply") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{what} is not a JSON object")
    return obj


def expect_fields(what: str, obj: Mapping[str, Any], fields: Set[str]) -> None:
    """Refuse an object of a canonical document whose fields are not exactly `fields`."""
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise InvalidArgument(f"{what}: unknown field {unknown[0]!r}")
    missing = sorted(fields - set(obj))
    if missing:
        raise InvalidArgument(f"{what}: field {missing[0]!r} is missing")
