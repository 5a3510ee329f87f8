"""The transfer agent: one per process, the façade of the transport.

An ``Agent`` registers memory, publishes its metadata (worker address and
packed remote keys), imports peers' metadata, and posts batches of
one-sided READ / WRITE operations, each batch one C call. Completion is
asynchronous: a ``Transfer`` handle is polled, waited on or awaited, and an
optional notification reaches the peer once the batch has completed.

It owns one UCP context and worker and one of each part, and forwards to
them; each part has one job and knows the others only through the few
calls named here:

- ``MemoryRegistry`` (registry.py): regions, memory handles, packed remote
  keys, memory types; the local descriptor table.
- ``PeerTable`` (peers.py): endpoints and remote keys on the own worker,
  metadata export and import, retired incarnations.
- ``InFlight`` (inflight.py): the C context, the slab of batch records,
  the one submit path, and the only code that settles a ``Transfer``.
- ``Notifications`` (notifications.py): the notification ring.
- ``ProgressDriver`` (progress.py): the own pump and the service thread,
  or polling; what a waiting caller does.
- ``Lanes`` (lanes.py): extra workers, each with its pump and endpoints.
- ``RouteBuilder`` (route.py): the C routes requests are posted on.
- ``PreparedLists`` (prepared.py): prepared lists and requests by index.
- ``Posting`` (posting.py): explicit descriptor lists (``read``, ``write``,
  ``flush``).

What spans parts is the agent's own, in ``AgentCore``: the settling round
the driver runs (``service``), the check that a peer is usable on every
worker, and failing a peer (the table force-closes its endpoint, the
lanes theirs, the in-flight table settles what UCX cancelled), which a
passed deadline or an endpoint error triggers. The core holds every part
and never the ``Agent``, so that a forgotten agent can be closed by its
finalizer (``weakref.finalize``: a ``ResourceWarning``, then ``close``).

Threading and lock order. There is one Python lock, the agent's
(``threading.RLock``), shared by every part: each public call and the
service thread take it, and no part has a lock of its own, so the order
is simply

    agent lock  ->  UCX's worker lock (inside ucp_* calls, on MULTI workers)

and never the other way: the C pumps (the own worker's with
``progress="thread"``, and every lane's) progress their workers under
UCX's lock alone and never take the agent's; they wake the settling
thread through an eventfd or the own worker's signal, and a caller
blocked in ``wait()`` through its transfer's slot. Completion callbacks
and ``Transfer`` waiters run with no lock held (callbacks queued under the
lock, run after it is released: a posting thread runs those its post
settled once the post released it, ``InFlight.take_due``). ``_lib``'s
loader lock is taken once, before any of these.

Bounded failure: every transfer has a deadline. When it passes, or when UCX
reports the peer's endpoint failed, the peer is marked failed, its
endpoints force-closed (cancelling its operations) and every transfer with
it fails with a message that says so. Nothing waits forever on a dead peer.

May import: numpy, rdma_kv.errors, the other rdma_kv.transport modules.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from rdma_kv.errors import ClosedError, ConfigError, PeerError, UCXError
from rdma_kv.transport import metadata as wire
from rdma_kv.transport import stall
from rdma_kv.transport._lib import load, status_name
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.cuda import creator_context
from rdma_kv.transport.descriptors import ChainedRead, DescList, PreparedList, new_generation
from rdma_kv.transport.inflight import OP_GET, OP_PUT, AgentStats, Callbacks, InFlight
from rdma_kv.transport.lanes import Lanes
from rdma_kv.transport.memory import MemoryRegion
from rdma_kv.transport.notifications import Notification, Notifications
from rdma_kv.transport.peer import Peer, reap_left_open
from rdma_kv.transport.peers import PeerTable
from rdma_kv.transport.posting import Posting
from rdma_kv.transport.prepared import PreparedLists, RequestParts
from rdma_kv.transport.progress import ProgressDriver, Wake
from rdma_kv.transport.registry import MemoryRegistry
from rdma_kv.transport.route import Epoch, RouteBuilder
from rdma_kv.transport.transfer import Transfer, XferOp
from rdma_kv.transport.ucx import Context, Worker, ucx_setting

log = logging.getLogger("rdma_kv.transport.agent")

__all__ = ["Agent", "AgentConfig", "AgentStats", "Notification"]

_READ, _WRITE = XferOp.READ, XferOp.WRITE  # module globals: an Enum class attribute is a slower lookup
_LOOK_DONE, _LOOK_NOTIF, _LOOK_ERRORS, _LOOK_DUE = 1, 2, 4, 8  # csrc/shim.h's RK_LOOK_* (checked in AgentCore)


class AgentCore:
    """Every part of one agent, and what spans them. It never refers to the
    ``Agent``: the agent's finalizer closes it. It is also what a
    ``Transfer`` waits through (``transfer.Owner``)."""

    def __init__(self, name: str, config: AgentConfig) -> None:
        self.name = name
        self.config = cfg = config
        self.lock = threading.RLock()
        self.wedged = False  # closed leaving its memory registered (_leave_wedged)
        self.context = Context(cfg.ucx_options, name=name, shared_workers=cfg.lanes > 1)
        lib = load()[1]
        assert (lib.RK_LOOK_DONE, lib.RK_LOOK_NOTIF, lib.RK_LOOK_ERRORS, lib.RK_LOOK_DUE) == (
            _LOOK_DONE, _LOOK_NOTIF, _LOOK_ERRORS, _LOOK_DUE), "agent.py's constants differ from csrc/shim.h"
        self._look = lib.rk_look
        self._errors_seen = 0  # the context's ep_errors when the endpoints were last looked at
        self._made: list[Any] = []  # parts made so far, closed in reverse if a later one fails
        try:
            # A pumped worker (progress="thread") is progressed by a C thread
            # while Python posts: UCX's own worker lock. With lanes, a lane's
            # pump may complete a batch's last operation and then send its
            # notification on this worker's endpoint.
            self.worker = Worker(self.context, multi_thread=cfg.progress == "thread" or cfg.lanes > 1)
            self._made.append(self.worker)
            self.inflight = InFlight(name, cfg, self)
            self.notifications = Notifications(name, self.inflight.ctx, self.worker, cfg)
            self.epoch = epoch = Epoch()
            self.memory = MemoryRegistry(self.context, f"agent {name!r}",
                                         functools.partial(ucx_setting, cfg.ucx_options, "TLS"), epoch.move)
            self.peers = PeerTable(name, self.worker, self.inflight.ctx, epoch.move, cfg.express)
            # The creator's CUDA context (None without CUDA): every pump makes
            # it current before it progresses (cuda.py).
            cuda = creator_context()
            self.wake = wake = Wake(cfg.progress, self.worker)
            self._made.append(wake)
            self.lanes = Lanes(self.context, cfg.lanes - 1, name, self.inflight.ctx, wake.worker, wake.fd,
                               cfg.spin_s, cuda, epoch.move, cfg.express)
            self._made.append(self.lanes)
            self.driver = ProgressDriver(name, cfg, self.worker, self.lock, self.inflight, wake,
                                         self.lanes.pumps, cuda, self.service, self.fail_all)
            self._made.append(self.driver)
            self.routes = RouteBuilder(self.inflight.ctx, epoch, self.memory, self.lanes, self.worker,
                                       self.driver.pump, cfg.lane_min_bytes, cfg.spread, cfg.spread_alone)
            parts = RequestParts(name, self.lock, self.memory, self.peers, self.routes, self.inflight,
                                 self.usable_peer)
            self.prepared = PreparedLists(parts)
            self.posting = Posting(parts)
        except BaseException:
            self._abandon_init()
            raise

    def _abandon_init(self) -> None:
        """Undo a constructor that failed part-way (nothing registered or connected yet)."""
        inflight: InFlight | None = getattr(self, "inflight", None)
        if inflight is not None:
            inflight.closed = True
        for part in reversed(self._made):
            if isinstance(part, ProgressDriver):
                part.stop()
                part.stop_helping()
            elif isinstance(part, (Lanes, Worker, Wake)):
                part.close()
        self.context.close()

    # ------------------------------------------------- what a Transfer waits through

    @property
    def manual_progress(self) -> bool:
        return self.driver.manual_progress

    def poll(self) -> None:
        self.driver.poll()

    def progress_once(self, block_s: float) -> None:
        self.driver.progress_once(block_s)

    def block(self, xfer: Transfer, block_s: float) -> None:
        self.driver.block(xfer, block_s)

    def add_done_callback(self, xfer: Transfer, fn: Callable[[Transfer], None]) -> bool:
        return self.driver.add_done_callback(xfer, fn)

    # ------------------------------------------------------- what spans parts

    def require_open(self) -> None:
        if self.inflight.closed:
            raise ClosedError(f"agent {self.name!r} is closed")

    def service(self) -> int:
        """Settle what progress produced: completions, notifications, failed
        endpoints, deadlines, retired peers. Returns completions drained.
        Caller holds the lock."""
        inflight = self.inflight
        ctx = inflight.ctx
        look = self._look(ctx, self._errors_seen, self.notifications.dropped)
        drained = inflight.drain() if look & _LOOK_DONE else 0
        if look & _LOOK_NOTIF:
            self.notifications.drain()
        if look & _LOOK_ERRORS:  # every endpoint's error callback counts ep_errors
            errors, self._errors_seen = ctx.ep_errors, -1  # looked at again if failing one raises
            for peer in self.peers.failed_endpoints():
                self.fail_peer(peer, f"endpoint error {status_name(peer.ep_state.status)}")
            self._errors_seen = errors
            self.reap_left_open()  # UCX giving up a hung peer fails the flushes that kept its endpoint open
        if look & _LOOK_DUE:
            inflight.expire(self.fail_peer)
        self.peers.close_idle_retired()
        return drained

    def reap_left_open(self) -> None:
        """Close, on every worker, the endpoints that peers' closes left open
        while flushes of them were outstanding, once those flushes ended
        (``peer.reap_left_open``). Caller holds the lock."""
        reap_left_open(self.worker)
        for lane in self.lanes:
            reap_left_open(lane.worker)

    def left_open(self, name: str) -> bool:
        """Whether an endpoint to ``name`` waits, left open, for its flushes
        to end on some worker. Caller holds the lock."""
        workers = [self.worker, *(lane.worker for lane in self.lanes)]
        return any(peer.name == name for worker in workers for peer in worker.left_open)

    def usable_peer(self, name: str) -> Peer:
        """The peer ``name`` if its endpoint on every worker is healthy; else
        PeerError (a lane's endpoint that failed fails the peer everywhere)."""
        peer = self.peers.usable(name)
        if len(self.lanes):
            reason = self.lanes.problem(name)
            if reason is not None:
                self.fail_peer(peer, reason)
                raise PeerError(f"peer {name!r} failed ({reason}); re-import its metadata with add_peer() "
                                "once it is back")
        return peer

    def fail_peer(self, peer: Peer, reason: str) -> None:
        """Mark failed and force-close its endpoints on every worker; UCX
        cancels its operations, whose completions are settled right away.
        Caller holds the lock."""
        self.peers.mark_failed(peer, reason)
        if len(self.lanes):
            self.lanes.fail(peer.name, reason)
        self.inflight.drain()

    def fail_all(self, why: str) -> None:
        """Fail every peer with work in flight (UCX cancels its operations),
        then settle what is left. Caller holds the lock."""
        for peer in self.peers.with_inflight():
            self.fail_peer(peer, why)
        self.inflight.fail_all(why)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Let what is in flight finish (at most ``close_drain_s``), fail the
        rest, then tear down: lanes, remote keys and endpoints, memory,
        worker, context. Idempotent."""
        with self.driver.bound():  # the teardown progresses the workers on this thread
            callbacks = self._teardown()
        self.inflight.run_callbacks(callbacks)

    def _teardown(self) -> Callbacks:
        inflight, driver = self.inflight, self.driver
        with self.lock:
            if inflight.closed:
                return []
            inflight.closed = True
            self.epoch.move()  # every route is stale: requests go to the checked path, which says closed
            driver.wake_all()
        why = f"agent {self.name!r} closed"
        own_stopped = driver.stop()  # from here on, this thread progresses the own worker
        with self.lock:
            # The lanes' pumps still run: they progress their share meanwhile.
            callbacks = driver.drain_for_close() if own_stopped else []
            driver.stop_helping()  # the pumps stop next
        wedged = self.lanes.stop_pumps(keep=driver.stragglers > 0) + (not own_stopped)
        with self.lock:
            if own_stopped:
                self.fail_all(why)  # (failing peers closes lane endpoints, not a wedged lane's)
            else:
                inflight.fail_all(why)  # the own worker's endpoints stay as they are
            callbacks += inflight.take_callbacks()
        self.lanes.close()  # their workers go before the context
        with self.lock:
            if own_stopped:
                inflight.drain()
            callbacks += inflight.take_callbacks()
            if wedged:
                self._leave_wedged(wedged, own_stopped, driver.stragglers)
            else:
                driver.close()
                self.peers.close()
                self.worker.close()  # drains first: answers to a peer's reads still read registered memory
                self.memory.close()
                self.context.close()
        return callbacks

    def _leave_wedged(self, wedged: int, own_stopped: bool, stragglers: int) -> None:
        """Some pump's thread is stuck inside its worker (``Pump.stop``): it
        may hold the worker's lock (closing an endpoint there would hang)
        and would use whatever is freed (the context, the eventfd it
        writes, the completion context its callbacks write). Or
        ``stragglers`` threads were still in the shim when the close gave
        up waiting for them (``ProgressDriver.stop``), and may yet reach the
        pumps, the completion context and the workers. Keep all of it
        for the life of the process: a leak, said in the log, instead of a
        hang or a crash. Healthy workers are closed as usual."""
        if own_stopped:
            self.peers.close()
            self.worker.close()
        else:
            self.worker.abandon()
        self.context.abandon()
        self.wedged = True
        _WEDGED.append(self)
        if stragglers:
            log.error("agent %r closed with %d thread(s) still in the shim past the close's bounds: its pumps, "
                      "UCX context, memory registrations and workers are left in place until the process exits",
                      self.name, stragglers)
        else:
            log.error("agent %r closed with %d progress thread(s) stuck in UCX: its UCX context, memory "
                      "registrations and stuck workers are left in place until the process exits", self.name, wedged)


_WEDGED: list[AgentCore] = []
"""Agents closed with a pump stuck in UCX: what its thread may still touch stays alive."""


def _collect(core: AgentCore) -> None:
    """The finalizer of an agent nobody closed: say so, then close it."""
    if not core.inflight.closed:
        warnings.warn(f"agent {core.name!r} was not closed: closing it now; call close() or use it as a "
                      "context manager", ResourceWarning, stacklevel=2)
        core.close()


CREATE_ATTEMPTS = 3
"""How many times an agent is made when a network device vanished while UCX
opened it (below)."""


def _make_core(name: str, config: AgentConfig) -> AgentCore:
    """An ``AgentCore``, made again (with a fresh UCX context) when a device
    the context listed was gone by the time a worker opened it: UCX lists a
    host's network interfaces once, at ``ucp_init``, and a container host
    creates and deletes veth interfaces all the time (seen here: a test's
    veth deleted between the two, ``uct_iface_open(tcp/rc14530b) failed: No
    such device``, and the engine failed to start). A device that stays
    missing (a ``NET_DEVICES`` naming none) still fails, after
    ``CREATE_ATTEMPTS``."""
    no_device = load()[1].UCS_ERR_NO_DEVICE
    for attempt in range(CREATE_ATTEMPTS):
        try:
            return AgentCore(name, config)
        except UCXError as exc:
            if exc.status != no_device or attempt == CREATE_ATTEMPTS - 1:
                raise
            log.warning("agent %r: %s; a network device disappeared while UCX opened it? Making the agent "
                        "again (attempt %d of %d)", name, exc, attempt + 2, CREATE_ATTEMPTS)
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


class Agent:
    """One UCX worker (plus ``config.lanes - 1`` lanes), its registered memory
    and its peers. Use as a context manager or call ``close()``."""

    def __init__(self, name: str, config: AgentConfig | None = None) -> None:
        if not name or len(name.encode()) > wire.MAX_NAME_BYTES:
            raise ConfigError(f"agent name must be 1..{wire.MAX_NAME_BYTES} bytes, got {name!r}")
        self.name = name
        self.config = config or AgentConfig()
        self._core = core = _make_core(name, self.config)
        # The per-request paths, one attribute away.
        self._prepared = core.prepared
        self._posting = core.posting
        self._finalizer = weakref.finalize(self, _collect, core)

    # ------------------------------------------------------------------ memory

    def register(self, obj: Any, *, memory_type: str | None = None) -> MemoryRegion:
        """Register a tensor, array or ``(address, nbytes)``. A view of an
        allocation already registered returns that allocation's region.
        The region keeps a tensor or array alive until it is unmapped.

        ``memory_type`` ("host" or "cuda") says what the memory is; a tensor
        or array says it itself. UCX detects the type of the memory it maps,
        and memory it maps as another type than the declared one is refused
        (RegistrationError): device memory mapped as host memory would be
        touched by the CPU and registered without GPUDirect."""
        core = self._core
        with core.lock:
            core.require_open()
            return core.memory.register(obj, memory_type)

    def deregister(self, region: MemoryRegion) -> None:
        """Drop one reference; unmap when the last one goes. Peers must
        re-import metadata afterwards."""
        core = self._core
        inflight, due = core.inflight, None
        try:
            with core.lock:
                core.require_open()
                inflight.drain()  # transfers UCX handed back since the last settle no longer count
                due = inflight.take_due()
                core.memory.deregister(region, inflight.live, inflight.zombies)
        finally:
            if due:
                inflight.run_callbacks(due)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return self._core.memory.regions

    # ------------------------------------------------------------------- peers

    def metadata(self) -> bytes:
        """Typed, versioned bytes a peer passes to ``add_peer``."""
        core = self._core
        with core.lock:
            core.require_open()
            return core.peers.export(core.memory.infos())

    def add_peer(self, blob: bytes, *, name: str | None = None) -> str:
        """Import a peer's metadata; returns its name: ``name``, else the one
        the metadata gives. Importing a name again replaces the peer (a
        restarted peer has a new worker address): its transfers in flight
        fail, prepared lists for it must be prepared again. A caller that
        knows whom it dialled passes ``name``, so that no peer's metadata
        can replace another's by naming it."""
        core = self._core
        md = core.peers.decode(blob, name)
        with core.lock:
            core.require_open()
            generation = new_generation()
            old = core.peers.discard(md.name)
            if old is not None:
                core.fail_peer(old, "replaced by newly imported metadata")
                core.peers.retire(old)
            core.peers.connect(md, generation)
            try:
                core.lanes.connect(md, generation)
            except BaseException:
                self.remove_peer(md.name)
                raise
            core.reap_left_open()
            return md.name

    def remove_peer(self, name: str, *, fence: bool = False) -> bool:
        """Forget peer ``name`` and close its endpoints on every worker:
        gracefully (a flush, then a goodbye) when nothing is in flight with
        it, else forced (its transfers fail). Returns False when an endpoint
        had to be left open (a flush of it outstanding), else True.

        A graceful close is no fence against the peer's own writes into this
        agent's memory: over TCP, UCX keeps the connection the peer's
        endpoint writes through, and what it queued there goes on landing
        after the close returned (64 MiB abandoned by a writer whose
        deadline passed: 4.2 MiB had landed when the close returned, the
        rest landed after; ``tests/transport/test_fence.py``). ``fence``
        force-closes every endpoint, even with nothing in flight: no write
        of the peer's lands here after this returns True (verified over
        TCP; on RDMA a forced close destroys the RC queue pair the writes
        target, argued; docs/reliability.md, "A fence against a peer's
        writes")."""
        core = self._core
        with core.driver.bound(), core.lock:  # closing its endpoints progresses the workers
            core.require_open()
            peer = core.peers.pop(name)
            if peer.inflight or fence:
                core.fail_peer(peer, "fenced by remove_peer()" if fence else "removed by remove_peer()")
            core.peers.retire(peer)
            core.lanes.disconnect(name)
            core.reap_left_open()
            return not core.left_open(name)

    @property
    def peers(self) -> tuple[str, ...]:
        return self._core.peers.names

    # ------------------------------------------------------------- descriptors

    def prep_local(self, descs: DescList) -> PreparedList:
        """Check local descriptors once; transfers then address them by index."""
        core = self._core
        with core.lock:
            core.require_open()
            return core.prepared.prep_local(descs)

    def prep_remote(self, peer: str, descs: DescList) -> PreparedList:
        core = self._core
        with core.lock:
            core.require_open()
            return core.prepared.prep_remote(peer, descs)

    # ---------------------------------------------------------------- transfers

    def read(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
             timeout_s: float | None = None) -> Transfer:
        """Read remote descriptors of ``peer`` into local ones (RMA get)."""
        return self._posting.transfer(_READ, OP_GET, peer, local, remote, notify, timeout_s)

    def write(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
              timeout_s: float | None = None) -> Transfer:
        """Write local descriptors to ``peer``'s remote ones (RMA put). Its
        completion means the local bytes were taken (the buffers may be
        reused), not that ``peer`` sees them: with ``notify``, ``peer`` hears
        of the write only once every byte is visible to it; otherwise
        ``flush(peer)`` completes once every earlier write is (UCX's own
        put semantics: over TCP the peer's worker applies the bytes)."""
        return self._posting.transfer(_WRITE, OP_PUT, peer, local, remote, notify, timeout_s)

    def read_prepared(self, local: PreparedList, local_index: Any, remote: PreparedList,
                      remote_index: Any, *, notify: bytes | None = None,
                      timeout_s: float | None = None, then: ChainedRead | None = None) -> Transfer:
        """Read ``remote[remote_index]`` into ``local[local_index]``; with
        ``then``, a second read of the same peer posted once this one
        landed (``ChainedRead``), which the transfer includes."""
        return self._prepared.transfer(_READ, OP_GET, local, local_index, remote, remote_index, notify, timeout_s,
                                       then)

    def write_prepared(self, local: PreparedList, local_index: Any, remote: PreparedList,
                       remote_index: Any, *, notify: bytes | None = None,
                       timeout_s: float | None = None) -> Transfer:
        """Write ``local[local_index]`` into ``remote[remote_index]``; completion as ``write``'s."""
        return self._prepared.transfer(_WRITE, OP_PUT, local, local_index, remote, remote_index, notify,
                                       timeout_s)

    def flush(self, peer: str, *, notify: bytes | None = None, timeout_s: float | None = None) -> Transfer:
        """A transfer that completes once every earlier operation to ``peer``
        has completed remotely; with ``notify``, ``peer`` receives that
        notification only then (every earlier write visible to it)."""
        return self._posting.flush(peer, timeout_s, notify)

    # ------------------------------------------------------ progress, notifications

    @property
    def manual_progress(self) -> bool:
        return self._core.driver.manual_progress

    @property
    def inflight(self) -> int:
        """Transfers in flight (a transfer striped over lanes counts once)."""
        return self._core.inflight.live

    @property
    def stats(self) -> AgentStats:
        """What this agent has done so far: a frozen snapshot."""
        core = self._core
        with core.lock:
            return core.inflight.stats()

    def progress(self) -> int:
        """Drive the worker once (polling mode). Returns UCX events handled."""
        core = self._core
        core.require_open()
        return core.driver.progress()

    def settle(self) -> None:
        """Settle now, on this thread, the transfers that have completed, and
        run their callbacks here (``progress="thread"``: without waiting for
        the service thread's wake-up; polling: one :meth:`progress` round).
        Cheap when nothing completed; nothing once closed."""
        core = self._core
        if not core.inflight.closed:
            core.driver.settle()

    def progress_report(self) -> str:
        """What each of this agent's progress threads (pumps) is doing, for
        a log line: per worker, held, in progress, asleep or spinning, when
        it last progressed its worker, and its thread as the kernel sees it
        (``stall.pump``). A polling agent has none."""
        core = self._core
        with core.lock:
            if core.inflight.closed:
                return "closed"
            pumps = [core.driver.pump] + [lane.pump for lane in core.lanes]
            now = time.monotonic_ns()
            return "; ".join(stall.pump(stall.worker_name(w), p.handle if p is not None else None, now)
                             for w, p in enumerate(pumps))

    def get_notifications(self) -> list[Notification]:
        """Notifications received since the last call, in arrival order
        (received ones not yet settled are settled on this thread first)."""
        core = self._core
        core.require_open()
        core.driver.settle()
        with core.lock:
            return core.notifications.take()

    # ------------------------------------------------------------------ closing

    @property
    def closed(self) -> bool:
        return self._core.inflight.closed

    def wedged(self) -> bool:
        """Closed leaving its memory registered and its workers in place: a
        thread was stuck in UCX past the close's bounds (said in the log);
        a transfer could still write into the memory."""
        return self._core.wedged

    def close(self) -> None:
        """Let what is in flight finish (at most ``close_drain_s``), fail the
        rest, then tear down: lanes, remote keys and endpoints, memory,
        worker, context. Idempotent."""
        self._finalizer.detach()
        self._core.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        core = self._core
        return (f"Agent({self.name!r}, regions={len(core.memory.regions)}, peers={len(core.peers)}, "
                f"lanes={len(core.lanes) + 1}, inflight={self.inflight}, closed={self.closed})")
