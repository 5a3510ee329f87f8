"""A progress bar for long benchmark runs, on stderr.

On a terminal it redraws one line (``\\r`` + erase) with a bar, the count,
the elapsed time, an estimate of the time left and the item running now;
lines written through :meth:`ProgressBar.write` appear above it. On
anything else (a pipe, a file, CI logs) it draws nothing while running and
prints one final line, so logs hold no carriage-return noise.

Imports the standard library only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None,
                 interactive: bool | None = None, width: int = 28,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = max(0, int(total))
        self.done = 0
        self.label = label
        self._stream = stream if stream is not None else sys.stderr
        if interactive is None:
            isatty = getattr(self._stream, "isatty", None)
            interactive = bool(isatty and isatty())
        self.interactive = interactive
        self._width = width
        self._clock = clock
        self._t0 = clock()
        self._item = ""
        self._closed = False

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def start(self, item: str) -> None:
        """Show ``item`` as the one running now."""
        self._item = item
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n) if self.total else self.done + n
        self._draw()

    def write(self, line: str) -> None:
        """A line of output that must not be overwritten by the bar."""
        if self.interactive:
            self._stream.write("\r\x1b[K")
        self._stream.write(line + "\n")
        self._draw()

    def close(self, summary: str = "") -> None:
        """Erase the bar and print the final line (on every kind of stream)."""
        if self._closed:
            return
        self._closed = True
        if self.interactive:
            self._stream.write("\r\x1b[K")
        prefix = f"{self.label}: " if self.label else ""
        self._stream.write(f"{prefix}{self.done}/{self.total} done in {self.elapsed_s:.1f} s"
                           + (f"; {summary}" if summary else "") + "\n")
        self._stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def render(self) -> str:
        """The bar as text (without control characters)."""
        frac = self.done / self.total if self.total else 1.0
        filled = round(frac * self._width)
        elapsed = self.elapsed_s
        eta = f", ~{elapsed / self.done * (self.total - self.done):.0f} s left" if 0 < self.done < self.total else ""
        prefix = f"{self.label} " if self.label else ""
        item = f"  {self._item}" if self._item else ""
        return (f"{prefix}[{'#' * filled}{'.' * (self._width - filled)}] {self.done}/{self.total} "
                f"{elapsed:.0f} s{eta}{item}")

    def _draw(self) -> None:
        if not self.interactive or self._closed:
            return
        self._stream.write("\r\x1b[K" + self.render())
        self._stream.flush()
