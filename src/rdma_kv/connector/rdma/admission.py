"""Which connections the side channel keeps: limits per source address, on
connections not yet trusted, and in all, and whom a newcomer displaces.

A connection is *untrusted* from its accept until it proves something:
with a shared secret, a completed AUTH; without one, a lease call answered
HELD for a lease this producer holds (a valid token for a live lease),
and only while that lease lives. Untrusted connections are what a flood is
made of, so they get the tight limits (per source and in all) and the
opening deadline (``sidechannel``).

A full budget does not refuse the newcomer: it evicts. When an untrusted
budget is full, the newcomer takes the slot of the oldest untrusted
connection of the source holding the most untrusted connections (the
flooder's, not the legitimate consumer's, which holds one); when the server
is full, that of the trusted connection idle longest, if it has been idle at
least ``evict_idle_s``, else again the flooder's oldest untrusted one. So neither an idle
flood from many addresses nor an insider's idle (or slowloris) connections
can hold the door; a refusal remains only when one source exceeds its own
budget with active connections, or every trusted connection is busy.

The decision is made in the side channel's event loop, before a byte is
read from the newcomer, so refusing or evicting costs an accept and a
close. Single-threaded: only the event loop calls it.

Imports the standard library and ``rdma_kv.errors``.
"""

from __future__ import annotations

import collections
import dataclasses
import resource
from typing import Protocol

from rdma_kv.errors import ConfigError

__all__ = ["Admission", "ConnectionLimits", "Member", "check_max_connections", "default_max_connections",
           "raise_fd_limit"]

FD_RESERVE = 1024
"""File descriptors left to the rest of the process (UCX endpoints over TCP,
files, the engine's own sockets) when ``max_connections`` is sized from
``RLIMIT_NOFILE``."""
MAX_CONNECTIONS_CAP = 65536


MIN_DEFAULT_CONNECTIONS = 256
"""The default's floor, whatever the file-descriptor limit."""


def _fd_limits() -> tuple[int | None, int | None]:
    """The process's soft and hard ``RLIMIT_NOFILE`` (None: unlimited)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1024, 1024
    return (None if soft == resource.RLIM_INFINITY else soft), (None if hard == resource.RLIM_INFINITY else hard)


def _fd_limit() -> int | None:
    """The process's soft ``RLIMIT_NOFILE`` (None: unlimited)."""
    return _fd_limits()[0]


def default_max_connections() -> int:
    """Connections one side channel keeps by default: what the process's
    file-descriptor limit allows after ``FD_RESERVE``, three quarters of it,
    at least 256 and at most 65,536. vLLM raises the soft ``RLIMIT_NOFILE``
    to 65,535 at start, which gives 48,384; a shell's common 1,024 gives 256."""
    soft = _fd_limit()
    if soft is None:
        soft = MAX_CONNECTIONS_CAP * 2
    return max(MIN_DEFAULT_CONNECTIONS, min(MAX_CONNECTIONS_CAP, (soft - FD_RESERVE) * 3 // 4))


def check_max_connections(configured: int, knob: str = "side_channel_max_connections") -> None:
    """Refuse (``ConfigError``) a configured connection limit the process's
    file-descriptor limit cannot serve: more than the *hard* limit leaves
    after ``FD_RESERVE`` (or than the default's floor, 256, if that is
    more). Past it, the side channel's accept would find no descriptor (it
    pauses and retries, the connection waits queued) and so would UCX,
    files and the engine's own sockets. The soft limit is the server's to
    raise (:func:`raise_fd_limit`; vLLM raises it to 65,535 itself), so a
    shell's ``ulimit -n`` of 1,024 refuses nothing the hard limit allows."""
    _, hard = _fd_limits()
    if hard is None:
        return
    allowed = max(MIN_DEFAULT_CONNECTIONS, hard - FD_RESERVE)
    if configured > allowed:
        raise ConfigError(f"{knob}={configured} exceeds what this process's file-descriptor limit allows: "
                          f"the hard RLIMIT_NOFILE (ulimit -Hn) is {hard} and {FD_RESERVE} of it are left to "
                          f"the rest of the process, so at most {allowed}; raise the limit, lower {knob}, or set "
                          f"it to 0 (sized from the limit)")


def raise_fd_limit(configured: int) -> None:
    """Before a side channel starts with ``configured`` connections: raise
    the soft ``RLIMIT_NOFILE`` to serve them and ``FD_RESERVE`` more, up to
    the hard limit (:func:`check_max_connections` refused more). Never raises."""
    soft, hard = _fd_limits()
    needed = configured + FD_RESERVE
    if soft is None or soft >= needed:
        return
    target = needed if hard is None else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, resource.RLIM_INFINITY if hard is None else hard))
    except (OSError, ValueError):
        return


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The side channel's connection limits (per server, i.e. per rank)."""

    max_connections: int = dataclasses.field(default_factory=default_max_connections)
    """Open connections in all, trusted or not (default: from the process's
    file-descriptor limit, :func:`default_max_connections`). Each costs a
    file descriptor and about 2.4 KiB of memory idle (docs/benchmarks.md,
    "Control plane at cluster scale")."""
    max_per_source: int = 64
    """Open connections from one peer IP address, trusted or not (a decode
    host opens one per worker and engine)."""
    max_untrusted: int = 64
    """Untrusted connections in all."""
    max_untrusted_per_source: int = 16
    """Untrusted connections from one peer IP address."""
    opening_deadline_s: float = 3.0
    """An untrusted connection is closed this long after its accept (or after
    it lost its trust): one deadline for the whole opening, not one per message.
    A HANDSHAKE answered ends the opening (next)."""
    handshake_idle_s: float = 30.0
    """An untrusted connection whose HANDSHAKE was answered (without a secret:
    a consumer that connected ahead of its first load) has done its opening:
    from then on it is closed only once this long passes without a request
    (counted ``closed_idle``), not at the opening deadline. It stays
    untrusted: the untrusted budgets still bound it and newcomers still
    evict it first; only a lease it proves makes it trusted."""
    evict_idle_s: float = 5.0
    """A trusted connection idle at least this long may be evicted for a
    newcomer when its source's budget or the server is full."""
    evict_stalled_s: float = 1.0
    """So may a connection whose request frame has been arriving for at least
    this long (a legitimate peer sends a frame in one go; slowloris does not,
    and reconnecting does not make it look fresh)."""

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
        for name in ("opening_deadline_s", "handshake_idle_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"side channel {name} must be > 0, got {getattr(self, name)}")
        for name in ("evict_idle_s", "evict_stalled_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"side channel {name} must be >= 0, got {getattr(self, name)}")


class Member(Protocol):
    """What admission needs of a connection."""

    source: str
    trusted: bool
    last_active: float
    frame_started: float | None
    """When the request frame now arriving started (None: none is)."""


_Set = collections.OrderedDict  # an ordered set of members: oldest (or idle longest) first


class Admission:
    """Open connections per source and trust, and the eviction policy."""

    REASONS = ("full", "per_source")
    """What :meth:`plan` may refuse for (a stats key ``refused_<reason>`` each)."""
    EVICTIONS = ("per_source", "untrusted_per_source", "untrusted_total", "full")
    """Which budget a newcomer evicted for (a stats key ``evicted_<reason>`` each)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._untrusted: dict[str, _Set[Member, None]] = {}  # source -> oldest first
        self._trusted: dict[str, _Set[Member, None]] = {}  # source -> idle longest first
        self._trusted_all: _Set[Member, None] = _Set()  # idle longest first
        self._stalled: _Set[Member, None] = _Set()  # a frame arriving, the longest first
        self._open: collections.Counter[str] = collections.Counter()
        self.open_total = 0
        self.untrusted_total = 0

    # --- the newcomer ----------------------------------------------------------------------

    def plan(self, source: str, now: float) -> tuple[list[tuple[Member, str]], tuple[str, str] | None]:
        """Whom a newcomer from ``source`` evicts (each with the budget that
        was full), or why it is refused. Changes nothing: the caller closes
        the victims (:meth:`leave`), then :meth:`enter` s the newcomer."""
        lim = self.limits
        victims: list[tuple[Member, str]] = []
        chosen: set[int] = set()

        def take(member: Member | None, why: str) -> bool:
            if member is None:
                return False
            victims.append((member, why))
            chosen.add(id(member))
            return True

        def first(members: _Set[Member, None] | None, idle: bool = False) -> Member | None:
            for member in members or ():
                if id(member) in chosen:
                    continue
                if idle and now - member.last_active < lim.evict_idle_s:
                    return None  # ordered by activity: nobody after it is idler
                return member
            return None

        def left(members: _Set[Member, None] | None) -> int:
            return sum(1 for m in members or () if id(m) not in chosen)

        def stalled(of: str | None = None) -> Member | None:
            for member in self._stalled:
                started = member.frame_started
                if started is None or now - started < lim.evict_stalled_s:
                    return None  # ordered by when the frame started
                if id(member) not in chosen and (of is None or member.source == of):
                    return member
            return None

        mine = self._untrusted.get(source)
        if self._open[source] - sum(1 for m, _ in victims if m.source == source) >= lim.max_per_source:
            if not (take(first(mine), "per_source") or take(stalled(source), "per_source")
                    or take(first(self._trusted.get(source), idle=True), "per_source")):
                return [], ("per_source", f"{self._open[source]} connections from {source} open and "
                                          f"active (max_per_source {lim.max_per_source})")
        if left(mine) >= lim.max_untrusted_per_source:
            take(first(mine), "untrusted_per_source")
        if self.untrusted_total - sum(1 for m, _ in victims if not m.trusted) >= lim.max_untrusted:
            top = self._top_untrusted_source(chosen)
            take(first(self._untrusted.get(top) if top is not None else None), "untrusted_total")
        if self.open_total - len(victims) >= lim.max_connections:
            # Untrusted connections are within their own budget here: what
            # fills the server is trusted ones, so an idle one goes first.
            top = self._top_untrusted_source(chosen)
            if not (take(stalled(), "full") or take(first(self._trusted_all, idle=True), "full")
                    or top is not None and take(first(self._untrusted[top]), "full")):
                return [], ("full", f"{self.open_total} connections open, every trusted one active in "
                                    f"the last {lim.evict_idle_s:g} s (max_connections {lim.max_connections})")
        return victims, None

    def _top_untrusted_source(self, chosen: set[int]) -> str | None:
        """The source with the most untrusted connections not yet chosen (the
        flooder's: a legitimate consumer holds one)."""
        best, most = None, 0
        for source, members in self._untrusted.items():
            n = sum(1 for m in members if id(m) not in chosen)
            if n > most:
                best, most = source, n
        return best

    # --- bookkeeping -------------------------------------------------------------------------

    def enter(self, member: Member) -> None:
        """Count a new, untrusted connection."""
        self._open[member.source] += 1
        self.open_total += 1
        self._untrusted.setdefault(member.source, _Set())[member] = None
        self.untrusted_total += 1

    def trust(self, member: Member) -> None:
        """An untrusted connection proved itself (sets ``member.trusted``)."""
        member.trusted = True
        self._drop(self._untrusted, member)
        self.untrusted_total -= 1
        self._trusted.setdefault(member.source, _Set())[member] = None
        self._trusted_all[member] = None

    def untrust(self, member: Member) -> None:
        """A trusted connection lost its trust (the lease that proved it ended)."""
        member.trusted = False
        self._drop(self._trusted, member)
        del self._trusted_all[member]
        self._untrusted.setdefault(member.source, _Set())[member] = None
        self.untrusted_total += 1

    def touch(self, member: Member) -> None:
        """A trusted connection was active: last in line for idle eviction."""
        self._trusted[member.source].move_to_end(member)
        self._trusted_all.move_to_end(member)

    def stall(self, member: Member) -> None:
        """A request frame of ``member`` started arriving (``frame_started`` set)."""
        self._stalled[member] = None

    def unstall(self, member: Member) -> None:
        """It arrived whole (or the connection closed)."""
        self._stalled.pop(member, None)

    def leave(self, member: Member) -> None:
        """A connection closed."""
        self._stalled.pop(member, None)
        self._open[member.source] -= 1
        if self._open[member.source] <= 0:
            del self._open[member.source]  # a flood from many sources leaves no key behind
        self.open_total -= 1
        if member.trusted:
            self._drop(self._trusted, member)
            del self._trusted_all[member]
        else:
            self._drop(self._untrusted, member)
            self.untrusted_total -= 1

    def counts(self) -> tuple[int, int]:
        """(open, untrusted) connections now."""
        return self.open_total, self.untrusted_total

    def sources(self) -> int:
        """Source addresses with a connection open (bounded by the connections)."""
        return len(self._open)

    @staticmethod
    def _drop(by_source: dict[str, _Set[Member, None]], member: Member) -> None:
        members = by_source[member.source]
        del members[member]
        if not members:
            del by_source[member.source]
