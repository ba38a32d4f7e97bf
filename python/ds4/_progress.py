"""A tiny progress bar on stderr (no dependencies).

It draws ``\\r``-updated lines only when enabled and stderr is a terminal; otherwise it
prints nothing at all, so logs and captured output stay clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


class Progress:
    """``Progress(total, "converting")``; ``update(n)`` as work is done; ``close()`` at the end."""

    def __init__(self, total: int, desc: str = "", enabled: bool = True, stream: TextIO | None = None,
                 width: int = 30, interval: float = 0.1) -> None:
        self.stream = sys.stderr if stream is None else stream
        try:
            tty = self.stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        self.enabled = enabled and tty
        self.total = max(int(total), 0)
        self.desc = desc
        self.width = width
        self.interval = interval
        self.done = 0
        self.note = ""
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, n: int, note: str | None = None) -> None:
        """Adds ``n`` units of progress; ``note`` (e.g. a tensor name) is shown after the bar."""
        self.done += int(n)
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last >= self.interval or self.done >= self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        fill = int(frac * self.width)
        bar = "#" * fill + "-" * (self.width - fill)
        rate = self.done / max(now - self._start, 1e-9)
        note = self.note if len(self.note) <= 40 else "..." + self.note[-37:]
        line = (f"\r{self.desc} [{bar}] {frac * 100:5.1f}% {_size(self.done)} / {_size(self.total)} "
                f"{rate / 2**20:,.0f} MiB/s {note}")
        self.stream.write(line.ljust(120)[:160])
        self.stream.flush()

    def close(self) -> None:
        """Draws the final state and ends the line (when enabled)."""
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
