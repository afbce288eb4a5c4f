"""A progress bar on standard error, shown only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from vault.files import size_text


class Progress:
    def __init__(
        self, label: str, total: int | None, *, unit: str = "B", stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._last = 0.0
        self._start = time.monotonic()

    def __call__(self, n: int) -> None:
        self.advance(n)

    def advance(self, n: int) -> None:
        self.done += n
        self._draw()

    def set(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        elapsed = max(now - self._start, 1e-9)
        if self.total:
            fraction = min(self.done / self.total, 1.0)
            bar = "█" * int(fraction * 30)
            text = f"\r{self.label} [{bar:<30}] {fraction:6.1%} {_human(self.done, self.unit)}"
        else:
            text = f"\r{self.label} {_human(self.done, self.unit)}"
        text += f" {_human(int(self.done / elapsed), self.unit)}/s"
        self.stream.write(text + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _human(n: int, unit: str) -> str:
    return size_text(n) if unit == "B" else f"{n:,} {unit}"
