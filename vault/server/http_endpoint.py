"""The vault's read-only HTTP endpoints (tiles, metrics, the explorer) on the bounded edge server
of `vault.http_edge`: GET and HEAD only. Nobody is asked who they are, so what an endpoint
serves must be public (or, for the explorer, guarded by its own bearer tokens)."""

from __future__ import annotations

from types import TracebackType
from typing import Self

from vault.http_edge import NOT_CACHED, TEXT, Edge, Limits, Request, Response

__all__ = ["NOT_CACHED", "TEXT", "Endpoint", "Limits", "Request", "Response"]


class Endpoint:
    """A read-only HTTP endpoint on `host`:`port` (port 0: one the system picks, read back in
    `port` once started). Subclasses set `what` and `path`, and answer in `respond`, which runs
    on one of the endpoint's few worker threads."""

    what = "http"
    path = "/"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, limits: Limits) -> None:
        self.host = host
        self.limits = limits
        self._edge = Edge(self.what, self.respond, host, port, limits=limits)

    def respond(self, request: Request) -> Response:
        raise NotImplementedError

    @property
    def port(self) -> int:
        return self._edge.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    def start(self) -> Self:
        self._edge.start()
        return self

    def stop(self) -> None:
        self._edge.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
