"""Which connections the side channel accepts: limits per source address,
on connections not yet trusted, and in all.

A connection is *untrusted* from its accept until it proves something: with
a shared secret, a completed AUTH; without one, a lease request answered
HELD or PENDING (it knows a live lease). Untrusted connections are what a
flood is made of, so they get the tight limits (per source and in all) and
the opening deadline (``sidechannel``); the rest of ``max_connections`` is
kept for trusted peers, which a flood therefore cannot push out.

The decision is made in the accept loop, before a thread exists for the
connection, so that refusing costs one accept and one close.

Imports the standard library and ``rdma_kv.errors``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from rdma_kv.errors import ConfigError

__all__ = ["Admission", "ConnectionLimits"]


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The side channel's connection limits (per server, i.e. per rank)."""

    max_connections: int = 256
    """Open connections in all, trusted or not."""
    max_per_source: int = 64
    """Open connections from one peer IP address, trusted or not (a decode
    host opens one per worker and engine)."""
    max_untrusted: int = 64
    """Untrusted connections in all; ``max_connections - max_untrusted``
    slots stay free for trusted peers."""
    max_untrusted_per_source: int = 16
    """Untrusted connections from one peer IP address: a flood from one host
    uses up its own budget, not everyone's."""
    opening_deadline_s: float = 3.0
    """An untrusted connection is closed this long after its accept (one
    deadline for the whole opening, not one per message)."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_source", "max_untrusted", "max_untrusted_per_source"):
            if getattr(self, name) < 1:
                raise ConfigError(f"side channel {name} must be >= 1, got {getattr(self, name)}")
        if self.max_untrusted > self.max_connections:
            raise ConfigError(f"side channel max_untrusted ({self.max_untrusted}) exceeds max_connections "
                              f"({self.max_connections}): nothing would be kept for trusted peers")
        if self.max_untrusted_per_source > self.max_per_source:
            raise ConfigError(f"side channel max_untrusted_per_source ({self.max_untrusted_per_source}) "
                              f"exceeds max_per_source ({self.max_per_source})")
        if not self.opening_deadline_s > 0:
            raise ConfigError(f"side channel opening_deadline_s must be > 0, got {self.opening_deadline_s}")


class Admission:
    """Counts open connections per source, trusted or not. Thread-safe."""

    REASONS = ("full", "per_source", "untrusted_per_source", "untrusted_total")
    """What :meth:`admit` may refuse for (a stats key ``refused_<reason>`` each)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open: collections.Counter[str] = collections.Counter()
        self._untrusted: collections.Counter[str] = collections.Counter()
        self._open_total = 0
        self._untrusted_total = 0

    def admit(self, source: str) -> tuple[str, str] | None:
        """Count a new (untrusted) connection from ``source`` and return
        ``None``, or return ``(reason, explanation)`` and count nothing."""
        lim = self.limits
        with self._lock:
            if self._open_total >= lim.max_connections:
                return "full", f"{self._open_total} connections open (max_connections {lim.max_connections})"
            if self._open[source] >= lim.max_per_source:
                return "per_source", (f"{self._open[source]} connections from {source} open "
                                      f"(max_per_source {lim.max_per_source})")
            if self._untrusted[source] >= lim.max_untrusted_per_source:
                return "untrusted_per_source", (
                    f"{self._untrusted[source]} connections from {source} not yet authenticated "
                    f"(max_untrusted_per_source {lim.max_untrusted_per_source})")
            if self._untrusted_total >= lim.max_untrusted:
                return "untrusted_total", (f"{self._untrusted_total} connections not yet authenticated "
                                           f"(max_untrusted {lim.max_untrusted})")
            self._open[source] += 1
            self._untrusted[source] += 1
            self._open_total += 1
            self._untrusted_total += 1
            return None

    def trust(self, source: str) -> None:
        """One of ``source``'s untrusted connections became trusted."""
        with self._lock:
            self._drop(self._untrusted, source)
            self._untrusted_total -= 1

    def leave(self, source: str, trusted: bool) -> None:
        """One of ``source``'s connections closed."""
        with self._lock:
            self._drop(self._open, source)
            self._open_total -= 1
            if not trusted:
                self._drop(self._untrusted, source)
                self._untrusted_total -= 1

    def counts(self) -> tuple[int, int]:
        """(open, untrusted) connections now."""
        with self._lock:
            return self._open_total, self._untrusted_total

    @staticmethod
    def _drop(counter: collections.Counter[str], source: str) -> None:
        counter[source] -= 1
        if counter[source] <= 0:
            del counter[source]  # a flood from many sources must not leave a key per source behind
