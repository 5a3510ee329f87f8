"""Warnings that cannot flood the log: at most ``burst`` lines per key (a
producer) per ``window_s``; the rest are counted and summed up in one line
when the window ends.

A producer that dies with a thousand requests in flight is one incident:
the operator needs the first few reasons and the count, not a thousand
lines. Metrics (``loads_failed``) still count every failure.

Imports the standard library only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RateLimitedWarnings"]


class RateLimitedWarnings:
    """``warn(key, msg, *args)`` logs through ``logger`` unless ``key`` has
    used its ``burst`` in the current window; ``flush()`` (called
    periodically, and by ``warn``) reports what each ended window held back."""

    def __init__(self, logger: logging.Logger, what: str, burst: int = 5, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or window_s <= 0:
            raise ValueError(f"burst must be >= 1 and window_s > 0, got {burst}, {window_s}")
        self._logger, self._what = logger, what
        self._burst, self._window_s, self._clock = burst, window_s, clock
        self._lock = threading.Lock()
        self._windows: dict[str, list[float | int]] = {}  # key -> [start, logged, suppressed]

    def warn(self, key: str, msg: str, *args: object) -> None:
        now = self._clock()
        self.flush(now)
        with self._lock:
            window = self._windows.setdefault(key, [now, 0, 0])
            if window[1] >= self._burst:
                window[2] += 1
                return
            window[1] += 1
        self._logger.warning(msg, *args, stacklevel=2)  # the caller's line, not this one

    def flush(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        ended: list[tuple[str, int]] = []
        with self._lock:
            for key, (start, _, suppressed) in list(self._windows.items()):
                if now - start >= self._window_s:
                    del self._windows[key]
                    if suppressed:
                        ended.append((key, int(suppressed)))
        for key, suppressed in ended:
            self._logger.warning("%s: %d more %s in the last %.0f s not logged (at most %d per %.0f s)",
                                 key, suppressed, self._what, self._window_s, self._burst, self._window_s)
