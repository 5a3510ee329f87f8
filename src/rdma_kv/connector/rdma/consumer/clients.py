"""The consumer's side-channel clients, one per producer address, made on
first use and closed once idle, and the RPC threads that call them.

A client holds a socket to one producer rank. Producers come and go (a
restart with an OS-chosen port is a new address), so a client nobody
used for ``idle_s`` and that no peer or load refers to is closed and
forgotten; the next load that needs the address makes a new one, which
starts knowing whether the address answered before (``has_answered``:
a producer known live, whose stalled HANDSHAKE the peer directory waits
out; at most ``ANSWERED_MEMORY`` addresses remembered).

Handshakes, confirmations and lease calls run on the pool's threads
(:meth:`ClientPool.submit`), never on the engine thread. Renewals have
threads of their own (:meth:`ClientPool.submit_renewal`): a RENEW queued
behind handshakes, confirmations or pushes stuck on a slow producer would
come late, and its lease lapse. The worker owns the pool: it outlives a
consumer put to sleep, so the calls that consumer queued (releases of the
loads the sleep failed) still go out.

A call to a producer names the producer rank's address (``to``), and the
pool isolates addresses from one another, on either set of threads:

- **one call per address at a time**: the calls for an address run one
  after another, each as a job of its own; a call submitted while one is
  in flight waits in the address's queue, not on a thread. A producer rank
  that accepts connections and never answers (stopped, its side channel
  starved of CPU) holds one thread, for one call's attempts (the client
  then fails fast for ``down_s``: ``sideclient``), and the calls queued
  behind it fail fast in turn; before, each waited for the client's connection on a
  thread of its own, and four of them held every thread: a CONFIRM to a
  healthy producer waited 6 s behind four RELEASEs to a stalled rank.
- **strangers are capped**: calls to addresses not answering (no client
  yet, or one whose last attempt failed at the peer: an address a request's
  ``kv_transfer_params`` named, which any client of the decode server
  chooses, or a producer whose last attempt timed out or was refused:
  stopped, or every rank of a stopped TP engine) run at most
  :func:`strangers` at once, half the threads, so that the others remain
  for producers that answer. Four handshakes to ports that accept and
  never answer held every thread for 15 s. A parked call starts as soon as
  its address answers (``_unpark``).
- **a producer that stops answering becomes a stranger**: the first call
  to each rank of an engine that just stopped is not capped (its ranks
  answered before), so a stopped TP-4 engine held the four threads for
  one call's attempts each. Its first failed attempt asks the pool for a
  stranger's place (``_demote``); with none free the call is not tried
  again (it fails, its loads recompute): one attempt, not the call's
  attempts, and the next calls to it are capped.
- **parked calls are bounded and taken by host, the fewest first**: calls
  parked for a stranger's place wait per host, and the next to start is
  the oldest of the host holding the fewest (of those, the first in turn;
  a host goes last once served), so the first call to a new producer does
  not wait behind a host's many ports that never answer (a client naming
  fresh ports of a host that accepts and never answers, faster than the
  capped places drain): it starts when the next stranger's place frees.
  At most :data:`PARKED_PER_HOST` per host and :data:`PARKED_MAX` in all
  wait. A stranger call beyond its host's bound is not made: it fails at
  once, saying so (``CallGuard.refusal``), and its load recomputes, as it
  would at its deadline. At the bound in all, a call whose host holds
  fewer parked calls than the host holding the most takes the place of
  that host's oldest, which is not made (it fails at once, saying so);
  only a call whose host holds as many as any is not made itself. Before,
  a flood on more hosts than ``PARKED_MAX / PARKED_PER_HOST`` had every new
  producer's first call not made, and its loads recompute, while it
  lasted. An attacker naming addresses on as many hosts as ``PARKED_MAX``
  (unroutable addresses whose connects hang are as good as ports that
  accept and never answer) can still keep each host at one parked call:
  a new producer's call then waits its turn among theirs and is the
  oldest to go after about ``PARKED_MAX`` more of their calls, so its load
  may still recompute; and a new host with many parked calls (the first
  handshakes of an engine's ranks) goes after hosts holding fewer.

Imports the standard library and the connector's ``sideclient``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from rdma_kv.connector.rdma.sideclient import CallGuard, SideChannelClient, guarded

__all__ = ["ANSWERED_MEMORY", "PARKED_MAX", "PARKED_PER_HOST", "ClientPool"]

logger = logging.getLogger(__name__)

Address = tuple[str, int]


def strangers(threads: int) -> int:
    """How many calls to addresses not answering run at once, of ``threads``."""
    return max(1, threads // 2)


PARKED_PER_HOST = 16
"""Calls to one host's strangers that wait for a stranger's place, per set
of threads (a producer host's first burst: a rank each of a few engines)."""
PARKED_MAX = 64
"""Calls to strangers that wait for a stranger's place, per set of threads."""

Job = tuple[Callable[..., Any], tuple[Any, ...]]


@dataclasses.dataclass(eq=False)
class _Place:
    """A call handed to the threads; ``stranger``: it holds a stranger's place."""

    address: Address | None
    job: Job
    stranger: bool
    refusal: str = ""


@dataclasses.dataclass(eq=False)
class _Lane:
    """One set of RPC threads, and the calls per address that wait for them."""

    executor: concurrent.futures.ThreadPoolExecutor
    limit: int
    """Calls to strangers at once (``strangers``)."""
    queues: dict[Address, collections.deque[Job]] = dataclasses.field(default_factory=dict)
    """Per address with a call running or handed to the executor: the calls waiting behind it."""
    strangers: int = 0
    """Calls to strangers running or handed to the executor."""
    parked: dict[str, collections.deque[tuple[Address, Job]]] = dataclasses.field(default_factory=dict)
    """Per host, in turn: calls to strangers waiting for one of ``limit`` to end (the first of their address)."""
    nparked: int = 0

    def park(self, address: Address, job: Job) -> None:
        self.parked.setdefault(address[0], collections.deque()).append((address, job))
        self.nparked += 1

    def next_parked(self) -> tuple[Address, Job]:
        """The first parked call of the host holding the fewest (of those,
        the first in turn); that host goes last."""
        host = min(self.parked, key=lambda h: len(self.parked[h]))  # (the first of the fewest)
        queue = self.parked.pop(host)
        address, job = queue.popleft()
        if queue:
            self.parked[host] = queue
        self.nparked -= 1
        return address, job

    def most_parked(self) -> tuple[str, int]:
        """The host holding the most parked calls (of those, the first in turn), and how many."""
        host = max(self.parked, key=lambda h: len(self.parked[h]), default="")  # (the first of the most)
        return host, len(self.parked.get(host, ()))

    def shed(self, host: str) -> tuple[Address, Job]:
        """``host``'s oldest parked call, taken out (it keeps its turn)."""
        queue = self.parked[host]
        address, job = queue.popleft()
        if not queue:
            del self.parked[host]
        self.nparked -= 1
        return address, job

    def clear(self) -> None:
        self.queues.clear()
        self.parked.clear()
        self.nparked = 0


ANSWERED_MEMORY = 4096
"""Addresses whose client answered, remembered after the client is closed
idle (``prune``), at most this many (the oldest forgotten first)."""


class ClientPool:
    def __init__(self, make: Callable[[str, int], SideChannelClient], idle_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, threads: int = 1,
                 thread_name: str = "rdma-kv-rpc") -> None:
        self._make, self._idle_s, self._clock = make, idle_s, clock
        self._lock = threading.Lock()
        self._clients: dict[Address, tuple[SideChannelClient, float]] = {}
        self._answered: collections.OrderedDict[Address, None] = collections.OrderedDict()
        """Addresses whose client, closed idle since, had answered: the next
        client made for one starts ``has_answered`` (a producer known live,
        which a stalled HANDSHAKE waits out: ``peers``), so a decode that
        handshakes again after an idle spell does not take a producer that
        stalls for an address that never answered."""
        self._closed = False
        self._calls = _Lane(concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=thread_name),
                            strangers(threads))
        self._renewals = _Lane(concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix=f"{thread_name}-renew"), strangers(threads))

    def submit(self, fn: Callable[..., Any], *args: Any, to: Address | None = None) -> bool:
        """Run ``fn(*args)`` on an RPC thread; False (nothing runs) once
        closed. ``to``: the producer rank's address ``fn`` calls (one call
        per address at a time, strangers capped: module docstring)."""
        return self._submit(self._calls, fn, args, to)

    def submit_renewal(self, fn: Callable[..., Any], *args: Any, to: Address | None = None) -> bool:
        """Like :meth:`submit`, on the threads only renewals use."""
        return self._submit(self._renewals, fn, args, to)

    def _submit(self, lane: _Lane, fn: Callable[..., Any], args: tuple[Any, ...], to: Address | None) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._unpark(lane)
            if to is None:
                return self._start(lane, _Place(None, (fn, args), False))
            queue = lane.queues.get(to)
            if queue is not None:  # a call to ``to`` is in flight: this one waits for it, on no thread
                queue.append((fn, args))
                return True
            lane.queues[to] = collections.deque()
            if self._dispatch(lane, to, (fn, args)):
                return True
            del lane.queues[to]
            return False

    def _stranger(self, address: Address) -> bool:
        """``address`` is not answering (``SideChannelClient.answering``; lock held)."""
        entry = self._clients.get(address)
        return entry is None or not getattr(entry[0], "answering", False)

    def _dispatch(self, lane: _Lane, address: Address, job: Job) -> bool:
        """Hand ``job``, the next call to ``address``, to the threads, or
        park it while ``lane.limit`` calls to strangers run, or, with too
        many parked, have it, or the oldest parked call of the host holding
        the most, fail at once (lock held)."""
        stranger = self._stranger(address)
        if stranger and lane.strangers >= lane.limit:
            host = len(lane.parked.get(address[0], ()))
            if host < PARKED_PER_HOST and lane.nparked >= PARKED_MAX:
                most, held = lane.most_parked()
                if host < held:  # that host's oldest makes room (before: a flood on more hosts than
                    # PARKED_MAX / PARKED_PER_HOST had every new producer's first call not made)
                    why = _refusal(lane, most, held, f"; the oldest of them is not made, for a call to host "
                                                     f"{address[0]}, which had {host}")
                    shed, shed_job = lane.shed(most)
                    if not self._start(lane, _Place(shed, shed_job, False, why)):
                        return False  # closing
            if host < PARKED_PER_HOST and lane.nparked < PARKED_MAX:
                lane.park(address, job)
                return True
            return self._start(lane, _Place(address, job, False, _refusal(lane, address[0], host)))
        return self._start(lane, _Place(address, job, stranger))

    def _unpark(self, lane: _Lane) -> None:
        """Start the parked calls whose address answers now (lock held): a
        call parked while its producer had not answered yet (a load's first
        RENEW, sent beside its handshake) held every later call to that
        address in the queue behind it, its read pin too, until a stranger's
        call ended (found by an adversarial review)."""
        for host, queue in list(lane.parked.items()):
            keep: collections.deque[tuple[Address, Job]] = collections.deque()
            for address, job in queue:
                if self._stranger(address) or not self._start(lane, _Place(address, job, False)):
                    keep.append((address, job))
            lane.nparked -= len(queue) - len(keep)
            if keep:
                lane.parked[host] = keep
            else:
                del lane.parked[host]

    def _start(self, lane: _Lane, place: _Place) -> bool:
        try:
            lane.executor.submit(self._run, lane, place)
        except RuntimeError:  # shut down: the worker is closing
            return False
        if place.stranger:
            lane.strangers += 1
        return True

    def _demote(self, lane: _Lane, place: _Place) -> str:
        """``place``'s producer answered before and an attempt of this call
        just failed at it (``CallGuard.stopped_answering``, RPC thread): the
        call goes on in a stranger's place, or, with none free, is not
        tried again (why not)."""
        with self._lock:
            if place.stranger:
                return ""
            if lane.strangers < lane.limit:
                lane.strangers += 1
                place.stranger = True
                return ""
            return (f"{lane.strangers} calls to producers not answering already hold the {lane.limit} RPC "
                    "threads they may use (rpc_threads / 2)")

    def _run(self, lane: _Lane, place: _Place) -> None:
        """RPC thread: ``place``'s job; then the next call to its address, and the strangers' parked
        calls that now fit, go to the threads (at the back of their queue: other
        addresses' calls submitted meanwhile go first)."""
        fn, args = place.job
        address = place.address
        try:
            if address is None:
                _logged(fn, *args)
            else:
                with guarded(CallGuard(address, place.refusal, lambda: self._demote(lane, place))):
                    _logged(fn, *args)
        finally:
            with self._lock:
                if place.stranger:
                    lane.strangers -= 1
                if address is not None and address in lane.queues:  # not: closed meanwhile
                    queue = lane.queues[address]
                    if not queue or not self._dispatch(lane, address, queue.popleft()):
                        del lane.queues[address]  # nothing left (or closing: what waits is dropped)
                for each in (self._calls, self._renewals):  # (a handshake on one makes its producer answer
                    self._unpark(each)                         # for the calls parked on the other)
                while lane.nparked and lane.strangers < lane.limit:
                    parked, next_job = lane.next_parked()
                    if not self._dispatch(lane, parked, next_job):
                        lane.clear()  # closing
                        break

    @property
    def idle_s(self) -> float:
        """How long a client may go unused before ``prune`` closes it (the
        peer directory forgets an unused producer rank after as long)."""
        return self._idle_s

    def get(self, host: str, port: int) -> SideChannelClient:
        with self._lock:
            if self._closed:
                raise RuntimeError("the side-channel client pool is closed")
            entry = self._clients.get((host, port))
            if entry is not None:
                client = entry[0]
            else:
                client = self._make(host, port)
                if (host, port) in self._answered:
                    del self._answered[(host, port)]
                    client.has_answered = True  # (its predecessor, closed idle, was answered)
            self._clients[(host, port)] = (client, self._clock())
            return client

    def prune(self, in_use: Callable[[], Collection[Address]], now: float | None = None) -> int:
        """Close clients idle for ``idle_s`` whose address is not in
        ``in_use()`` (known peers, loads in flight; asked only when some
        client is idle, so a step pays nothing otherwise); returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            if not any(now - used >= self._idle_s for _, used in self._clients.values()):
                return 0
        busy = in_use()  # may take the caller's lock: not under ours
        with self._lock:
            idle = [addr for addr, (_, used) in self._clients.items()
                    if now - used >= self._idle_s and addr not in busy]
            dropped = [self._clients.pop(addr)[0] for addr in idle]
            for addr, client in zip(idle, dropped):
                if getattr(client, "has_answered", False):
                    self._answered[addr] = None  # (new: get() took it out when it made this client)
            while len(self._answered) > ANSWERED_MEMORY:
                self._answered.popitem(last=False)
        for client in dropped:
            client.close()
        return len(dropped)

    def close(self) -> None:
        """Stop the RPC threads (calls not started are dropped) and close every client."""
        with self._lock:
            self._closed = True
            for lane in (self._calls, self._renewals):
                lane.clear()
        self._calls.executor.shutdown(wait=False, cancel_futures=True)
        self._renewals.executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients = [c for c, _ in self._clients.values()]
            self._clients.clear()
        for client in clients:
            client.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)


def _refusal(lane: _Lane, host: str, parked: int, shed: str = "") -> str:
    """Why a call to a stranger of ``host`` (which has ``parked`` parked) is not made."""
    return (f"{lane.nparked} calls to producer addresses that have not answered wait for the {lane.limit} RPC "
            f"threads they may use (rpc_threads / 2), {parked} of them to host {host} (at most {PARKED_MAX}, "
            f"{PARKED_PER_HOST} per host){shed}; are requests naming producers (kv_transfer_params remote_host "
            "/ remote_port) that do not answer? This load is computed here instead")


def _logged(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn``: a job that raises is a bug, and its loads would otherwise
    sit until their deadline with nothing said (an executor keeps what a
    job raises in a future nobody reads)."""
    try:
        fn(*args)
    except Exception:
        logger.exception("rdma-kv RPC thread: %s failed (a bug: please report it); the loads it "
                         "served fail at their deadline", getattr(fn, "__qualname__", fn))
