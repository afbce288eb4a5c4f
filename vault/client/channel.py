"""The client's gRPC channel (TLS, mutual TLS, a bearer token), and the one place where a gRPC
status becomes the project's own error type."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import grpc

from vault.config import DEFAULT_PORT
from vault.errors import (
    ConfigError,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
    VaultError,
)

# gRPC's name resolvers: a target starting with one of these is not HOST[:PORT].
_SCHEMES: Final = frozenset({"unix", "unix-abstract", "vsock", "dns", "ipv4", "ipv6"})

CHANNEL_OPTIONS: Final = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]

# A status back to the error it stands for; a deadline the client set is the server's absence.
_ERRORS: Final[dict[grpc.StatusCode, type[VaultError]]] = {
    **{
        grpc.StatusCode[kind.status]: kind
        for kind in (
            InvalidArgument,
            NotFound,
            FailedPrecondition,
            IntegrityError,
            Unavailable,
            QuotaExceeded,
            Unauthenticated,
            PermissionDenied,
        )
        if kind.status is not None
    },
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


def status_error(exc: grpc.RpcError) -> VaultError:
    """The project's error for a failed call's gRPC status."""
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"vault server unavailable: {details}"
    if code not in _ERRORS:
        # No error type of ours says what went wrong, so the status must.
        return VaultError(f"{code.name}: {details}")
    return _ERRORS[code](details)


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Around a call to the vault: a gRPC error raised inside becomes the project's own."""
    try:
        yield
    except grpc.RpcError as exc:
        raise status_error(exc) from None


@dataclass(frozen=True, slots=True)
class Credentials:
    """How a client proves who it is: a bearer token, TLS with the server's CA, and a client
    certificate for mutual TLS (all PEM bytes)."""

    token: str = ""
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds the bearer token to every call. (gRPC's own call credentials need TLS; a vault on
    loopback or a private network may run without it.)"""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def with_default_port(target: str) -> str:
    """`target` with the vault's port added when it names a host alone (gRPC would call port
    443): `HOST`, `[IPv6]` or a bare IPv6 address. A target with a port, or with a scheme
    (unix:PATH, dns:///HOST…), is left as it is."""
    host = target.strip()
    if not host or host.split(":", 1)[0] in _SCHEMES:
        return target
    if host.startswith("["):
        return host if "]:" in host else f"{host}:{DEFAULT_PORT}"
    if host.count(":") > 1:
        return f"[{host}]:{DEFAULT_PORT}"
    return host if ":" in host else f"{host}:{DEFAULT_PORT}"


def open_channel(target: str, credentials: Credentials | None = None) -> grpc.Channel:
    if not target.strip():
        # gRPC would log its own failure to stderr and raise an UNKNOWN that names nothing.
        raise ConfigError(
            "no vault server to connect to: set client.server (or PINVAULT_CLIENT_SERVER) "
            "to HOST:PORT or unix:PATH"
        )
    creds = credentials or Credentials()
    if creds.ca or creds.cert:
        channel = grpc.secure_channel(
            target,
            grpc.ssl_channel_credentials(
                root_certificates=creds.ca, private_key=creds.key, certificate_chain=creds.cert
            ),
            options=CHANNEL_OPTIONS,
        )
    else:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    if creds.token:
        return grpc.intercept_channel(channel, _Bearer(creds.token))
    return channel
