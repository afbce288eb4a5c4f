"""A request's bytes as its method's message, or InvalidArgument naming what is wrong: bytes that
are no message of that type, or an unsigned integer past 2^63 - 1, the most any index, size or
offset the vault keeps can be (its databases store signed 64-bit integers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NamedTuple

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from vault.errors import InvalidArgument

INTEGER_MAX: Final = (1 << 63) - 1
_WIDE: Final = frozenset({FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64})

Decode = Callable[[bytes], Any]


class _Field(NamedTuple):
    """A field that is, or holds, an unsigned 64-bit integer, as the check needs it."""

    name: str
    wide: bool
    repeated: bool
    # Whether the field says when it is set (a message, an optional scalar).
    presence: bool
    is_map: bool
    # For a message (or a map's entry): its own such fields.
    inner: tuple[_Field, ...]


class Undecodable:
    """What a request that must not be served is decoded to where gRPC decodes it before any
    handler runs (and would answer an exception from the decoder with UNKNOWN): the handler
    refuses the call with `error`."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def decoder(rpc: str, deserialize: Decode | None) -> Decode | None:
    """`deserialize` (a message type's FromString) for method `rpc` ("Ledger.Log"), raising
    InvalidArgument for a request it must refuse."""
    kind = getattr(deserialize, "__self__", None)
    descriptor = getattr(kind, "DESCRIPTOR", None)
    if deserialize is None or not isinstance(descriptor, Descriptor):
        return deserialize
    parse = deserialize
    plan = _plan(descriptor, frozenset())
    name = descriptor.full_name

    def decode(data: bytes) -> Any:
        try:
            message = parse(data)
        except Exception:
            raise InvalidArgument(
                f"{rpc}: the request could not be decoded as a {name} message"
            ) from None
        if plan:
            _check(rpc, message, plan, "")
        return message

    return decode


def lenient(decode: Decode | None) -> Decode | None:
    """`decode`, giving an Undecodable rather than raising."""
    if decode is None:
        return None
    strict = decode

    def decode_or_refuse(data: bytes) -> Any:
        try:
            return strict(data)
        except InvalidArgument as exc:
            return Undecodable(exc)

    return decode_or_refuse


def _plan(descriptor: Descriptor, within: frozenset[str]) -> tuple[_Field, ...]:
    """The fields of a message type that may hold integers too wide for the vault."""
    plan: list[_Field] = []
    for field in descriptor.fields:
        inner: tuple[_Field, ...] = ()
        wide = field.type in _WIDE
        if not wide and field.message_type is not None:
            if field.message_type.full_name in within:
                continue
            inner = _plan(field.message_type, within | {descriptor.full_name})
            if not inner:
                continue
        elif not wide:
            continue
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        plan.append(_Field(field.name, wide, field.is_repeated, field.has_presence, is_map, inner))
    return tuple(plan)


def _check(rpc: str, message: Any, plan: tuple[_Field, ...], prefix: str) -> None:
    for field in plan:
        value = getattr(message, field.name)
        if field.is_map:
            # Its entries' fields are its key and its value.
            for key, item in value.items():
                for part in field.inner:
                    found = key if part.name == "key" else item
                    _check_one(rpc, f"{prefix}{field.name}[{key!r}]", found, part)
        elif field.repeated:
            for index, item in enumerate(value):
                _check_one(rpc, f"{prefix}{field.name}[{index}]", item, field)
        elif not field.presence or message.HasField(field.name):
            _check_one(rpc, prefix + field.name, value, field)


def _check_one(rpc: str, name: str, value: Any, field: _Field) -> None:
    if field.wide:
        if value > INTEGER_MAX:
            raise InvalidArgument(
                f"{rpc}: {name} is {value}, past {INTEGER_MAX}, the most the vault takes"
            )
    else:
        _check(rpc, value, field.inner, f"{name}.")
