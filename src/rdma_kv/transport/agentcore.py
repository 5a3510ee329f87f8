"""What spans the transport's parts: ``AgentCore`` holds every part of one
agent (agent.py's ``Agent`` is the façade over it) and does what no single
part can.

What spans parts is ``AgentCore``'s: the settling round the driver runs
(``service``), the check that a peer is usable on every worker, and failing a peer (the table force-closes its endpoint, the
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

May import: rdma_kv.errors, the other rdma_kv.transport modules except
agent.py.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from rdma_kv.errors import ClosedError, PeerError, UCXError
from rdma_kv.transport._lib import load, status_name
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.cuda import creator_context
from rdma_kv.transport.inflight import Callbacks, InFlight
from rdma_kv.transport.lanes import Lanes
from rdma_kv.transport.notifications import Notifications
from rdma_kv.transport.peer import Peer, reap_left_open
from rdma_kv.transport.peers import PeerTable
from rdma_kv.transport.posting import Posting
from rdma_kv.transport.prepared import PreparedLists, RequestParts
from rdma_kv.transport.progress import ProgressDriver, Wake
from rdma_kv.transport.registry import MemoryRegistry
from rdma_kv.transport.route import Epoch, RouteBuilder
from rdma_kv.transport.transfer import Transfer
from rdma_kv.transport.ucx import Context, Worker, ucx_setting

log = logging.getLogger("rdma_kv.transport.agent")  # the agent's logger, as docs/deploy.md names it

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
            _LOOK_DONE, _LOOK_NOTIF, _LOOK_ERRORS, _LOOK_DUE), "agentcore.py's constants differ from csrc/shim.h"
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
            reason = self.lanes.problem(peer)
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
        WEDGED.append(self)
        if stragglers:
            log.error("agent %r closed with %d thread(s) still in the shim past the close's bounds: its pumps, "
                      "UCX context, memory registrations and workers are left in place until the process exits",
                      self.name, stragglers)
        else:
            log.error("agent %r closed with %d progress thread(s) stuck in UCX: its UCX context, memory "
                      "registrations and stuck workers are left in place until the process exits", self.name, wedged)


WEDGED: list[AgentCore] = []
"""Agents closed with a pump stuck in UCX: what its thread may still touch stays alive."""


def collect(core: AgentCore) -> None:
    """The finalizer of an agent nobody closed: say so, then close it."""
    if not core.inflight.closed:
        warnings.warn(f"agent {core.name!r} was not closed: closing it now; call close() or use it as a "
                      "context manager", ResourceWarning, stacklevel=2)
        core.close()


CREATE_ATTEMPTS = 3
"""How many times an agent is made when a network device vanished while UCX
opened it (below)."""


def make_core(name: str, config: AgentConfig) -> AgentCore:
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
