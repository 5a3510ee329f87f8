"""Warnings that cannot flood the log.

:class:`RateLimitedWarnings`: at most ``burst`` lines per key (a producer)
per ``window_s``; the rest are counted and summed up in one line when the
window ends. A producer that dies with a thousand requests in flight is one
incident: the operator needs the first few reasons and the count, not a
thousand lines. Metrics (``loads_failed``) still count every failure.

:class:`EventSummary`: the same budget per *reason*, and one summary line
per window with the count of every reason and the sources that caused the
most. A side channel under a connection flood refuses thousands of
connections a second; its log gets a few lines a window, never one per
connection.

Imports the standard library only.
"""

from __future__ import annotations

import logging
import collections
import threading
import time
from collections.abc import Callable

__all__ = ["EventSummary", "RateLimitedWarnings", "WINDOW_S"]

WINDOW_S = 10.0
"""The default window of both: a key's (a reason's) budget of lines is spent
per this many seconds."""


class RateLimitedWarnings:
    """``warn(key, msg, *args)`` logs through ``logger`` unless ``key`` has
    used its ``burst`` in the current window; ``flush()`` (called
    periodically, and by ``warn``) reports what each ended window held back."""

    def __init__(self, logger: logging.Logger, what: str, burst: int = 5, window_s: float = WINDOW_S,
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


class EventSummary:
    """``event(reason, source, msg, *args)`` logs the first ``burst`` events
    of each ``reason`` in a window in full; every event is counted, and when
    a window in which some were held back ends, ``flush()`` (called
    periodically, and by ``event``) logs one line: the count per reason and
    the ``top`` sources. A window that starts within ``window_s`` of such a
    line continues the same incident: it logs nothing in full, so a
    sustained flood costs one line per window after its first."""

    def __init__(self, logger: logging.Logger, what: str, noun: str, burst: int = 3,
                 window_s: float = WINDOW_S, top: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 0 or window_s <= 0 or top < 1:
            raise ValueError(f"burst must be >= 0, window_s > 0 and top >= 1, got {burst}, {window_s}, {top}")
        self._logger, self._what, self._noun = logger, what, noun
        self._burst, self._window_s, self._top, self._clock = burst, window_s, top, clock
        self._lock = threading.Lock()
        self._start: float | None = None
        self._reasons: collections.Counter[str] = collections.Counter()
        self._sources: collections.Counter[str] = collections.Counter()
        self._held_back = 0
        self._window_burst = burst
        self._flood_seen_at: float | None = None  # when the last window with held-back events ended

    def event(self, reason: str, source: str, msg: str, *args: object) -> None:
        now = self._clock()
        self.flush(now)
        with self._lock:
            if self._start is None:
                self._start = now
                continuing = self._flood_seen_at is not None and now - self._flood_seen_at < self._window_s
                self._window_burst = 0 if continuing else self._burst
            self._reasons[reason] += 1
            self._sources[source] += 1
            if self._reasons[reason] > self._window_burst:
                self._held_back += 1
                return
        self._logger.warning(msg, *args, stacklevel=2)

    def flush(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self._lock:
            if self._start is None or now - self._start < self._window_s:
                return
            reasons, sources, held_back = self._reasons, self._sources, self._held_back
            self._start, self._held_back = None, 0
            self._flood_seen_at = now if held_back else None
            self._reasons, self._sources = collections.Counter(), collections.Counter()
        if not held_back:
            return
        by_reason = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
        top = ", ".join(f"{source} ({n})" for source, n in sources.most_common(self._top))
        self._logger.warning("%s: %d %s in the last %.0f s (%d not logged one by one): %s; top sources: %s",
                             self._what, sum(reasons.values()), self._noun, self._window_s, held_back,
                             by_reason, top)
