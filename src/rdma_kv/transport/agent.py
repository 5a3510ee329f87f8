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
- ``Completions`` (progress.py): batch records, transfers in flight and
  their deadlines, the progress thread or polling, the completion and
  notification rings. ``Transfer`` reaches it only through
  ``transfer.Completer``.
- ``Lanes`` (lanes.py): extra workers, each with its pump and endpoints.
- ``Routes`` (prepared.py): prepared lists and the one-C-call request path.
- ``Posting`` (posting.py): explicit descriptor lists (``read``, ``write``,
  ``flush``), checked, merged and posted in one C call.

The registry and the peer table move the ``Epoch`` the routes are checked
against. Failing a peer spans three parts, so it is the agent's
(``_fail_peer``): the table force-closes its endpoint, the lanes theirs,
the completions settle what UCX cancelled. The completions call it back
when a deadline passes or UCX reports an endpoint failed.

Threading and lock order. There is one Python lock, the agent's
(``threading.RLock``), shared by every part: each public call and the
service thread take it, and no part has a lock of its own, so the order
is simply

    agent lock  ->  UCX's worker lock (inside ucp_* calls, on MULTI workers)

and never the other way: the C pumps (the own worker's with
``progress="thread"``, and every lane's) progress their workers under
UCX's lock alone and never take the agent's; they wake the settling
thread through an eventfd or the own worker's signal. Completion callbacks
and ``Transfer`` waiters run with no lock held (callbacks queued under the
lock, run after it is released; the posting thread runs those due at once
with the lock still held, which is reentrant). ``_lib``'s loader lock is
taken once, before any of these.

With ``progress="thread"`` a C pump progresses the own worker
(``UCS_THREAD_MODE_MULTI``) without the interpreter lock and a Python
thread sleeps on an eventfd until it reports something to settle; with
``progress="poll"`` (``UCS_THREAD_MODE_SERIALIZED`` without lanes) the
caller drives it through ``progress()`` (``wait`` and ``done`` do so too).

Bounded failure: every transfer has a deadline. When it passes, or when UCX
reports the peer's endpoint failed, the peer is marked failed, its
endpoints force-closed (cancelling its operations) and every transfer with
it fails with a message that says so. Nothing waits forever on a dead peer.

May import: numpy, rdma_kv.errors, the other rdma_kv.transport modules.
"""

from __future__ import annotations

import threading
from typing import Any

from rdma_kv.errors import ConfigError, PeerError
from rdma_kv.transport import metadata as wire
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.cuda import creator_context
from rdma_kv.transport.descriptors import DescList, PreparedDescList, new_generation
from rdma_kv.transport.lanes import Lanes
from rdma_kv.transport.memory import MemoryRegion
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.peers import PeerTable
from rdma_kv.transport.posting import Posting
from rdma_kv.transport.prepared import Epoch, Routes
from rdma_kv.transport.progress import Completions, Notification
from rdma_kv.transport.registry import MemoryRegistry
from rdma_kv.transport.transfer import Transfer, XferOp
from rdma_kv.transport.ucx import Context, Worker

__all__ = ["Agent", "AgentConfig", "Notification"]


class Agent:
    """One UCX worker (plus ``config.lanes - 1`` lanes), its registered memory
    and its peers. Use as a context manager or call ``close()``."""

    def __init__(self, name: str, config: AgentConfig | None = None) -> None:
        if not name or len(name.encode()) > wire.MAX_NAME_BYTES:
            raise ConfigError(f"agent name must be 1..{wire.MAX_NAME_BYTES} bytes, got {name!r}")
        self.name = name
        self.config = cfg = config or AgentConfig()
        self._lock = threading.RLock()
        self._context = Context(cfg.ucx_options, name=name, shared_workers=cfg.lanes > 1)
        lanes: Lanes | None = None
        try:
            # A pumped worker (progress="thread") is progressed by a C thread
            # while Python posts: UCX's own worker lock. With lanes, a lane's
            # pump may complete a batch's last operation and then send its
            # notification on this worker's endpoint.
            self._worker = Worker(self._context, multi_thread=cfg.progress == "thread" or cfg.lanes > 1)
            self._completions = comp = Completions(name, cfg, self._worker, self._lock, has_lanes=cfg.lanes > 1)
            self.stats = comp.stats
            epoch = Epoch()
            self._memory = MemoryRegistry(self._context, f"agent {name!r}", cfg.ucx_options.get("TLS", ""),
                                          epoch.move)
            self._peers = PeerTable(name, self._worker, comp.ctx, epoch.move)
            # The creator's CUDA context (None without CUDA): every pump makes
            # it current before it progresses (cuda.py).
            cuda = creator_context()
            self._lanes = lanes = Lanes(self._context, cfg.lanes - 1, name, comp.ctx, comp.wake_worker,
                                        comp.wake_fd, cfg.spin_s, cuda, epoch.move)
            self._posting = Posting(cfg.lane_min_bytes, self._memory, lanes, comp, self._worker, self._usable_peer)
            self._routes = Routes(name, cfg.lane_min_bytes, epoch, self._memory, self._peers, lanes, comp,
                                  self._worker, self._usable_peer)
            comp.start(self._peers, self._fail_peer, cuda)
            comp.helpers = tuple(lane.pump.handle for lane in lanes if lane.pump is not None)
        except BaseException:
            self._abandon_init(lanes)
            raise

    def _abandon_init(self, lanes: Lanes | None) -> None:
        """Undo a constructor that failed part-way (nothing registered or connected yet)."""
        comp: Completions | None = getattr(self, "_completions", None)
        if comp is not None:
            comp.begin_close()
            comp.stop_progress()
            comp.helpers = ()
        if lanes is not None:
            lanes.close()
        if comp is not None:
            comp.close()
        if getattr(self, "_worker", None) is not None:
            self._worker.close()
        self._context.close()

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
        with self._lock:
            self._completions.require_open()
            return self._memory.register(obj, memory_type)

    def deregister(self, region: MemoryRegion) -> None:
        """Drop one reference; unmap when the last one goes. Peers must
        re-import metadata afterwards."""
        with self._lock:
            self._completions.require_open()
            self._memory.deregister(region, self.inflight)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return self._memory.regions

    # ------------------------------------------------------------------- peers

    def metadata(self) -> bytes:
        """Typed, versioned bytes a peer passes to ``add_peer``."""
        with self._lock:
            self._completions.require_open()
            return self._peers.export(self._memory.infos())

    def add_peer(self, blob: bytes) -> str:
        """Import a peer's metadata; returns its name. Importing a name again
        replaces the peer (a restarted peer has a new worker address): its
        transfers in flight fail, prepared lists for it must be prepared again."""
        md = self._peers.decode(blob)
        with self._lock:
            self._completions.require_open()
            generation = new_generation()
            old = self._peers.discard(md.name)
            if old is not None:
                self._fail_peer(old, "replaced by newly imported metadata")
                self._peers.retire(old)
            self._peers.connect(md, generation)
            try:
                self._lanes.connect(md, generation)
            except BaseException:
                self.remove_peer(md.name)
                raise
            return md.name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._completions.require_open()
            peer = self._peers.pop(name)
            if peer.inflight:
                self._fail_peer(peer, "removed by remove_peer()")
            self._peers.retire(peer)
            self._lanes.disconnect(name)

    @property
    def peers(self) -> tuple[str, ...]:
        return self._peers.names

    def _usable_peer(self, name: str) -> Peer:
        """The peer ``name`` if its endpoint on every worker is healthy; else
        PeerError (a lane's endpoint that failed fails the peer everywhere)."""
        peer = self._peers.usable(name)
        if len(self._lanes):
            reason = self._lanes.problem(name)
            if reason is not None:
                self._fail_peer(peer, reason)
                raise PeerError(f"peer {name!r} failed ({reason}); re-import its metadata with add_peer() "
                                "once it is back")
        return peer

    def _fail_peer(self, peer: Peer, reason: str) -> None:
        """Mark failed and force-close its endpoints on every worker; UCX
        cancels its operations, whose completions are settled right away.
        Caller holds the lock."""
        self._peers.mark_failed(peer, reason)
        if len(self._lanes):
            self._lanes.fail(peer.name, reason)
        self._completions.drain()

    # ------------------------------------------------------------- descriptors

    def prep_local(self, descs: DescList) -> PreparedDescList:
        """Check local descriptors once; transfers then address them by index."""
        with self._lock:
            self._completions.require_open()
            return self._routes.prep_local(descs)

    def prep_remote(self, peer: str, descs: DescList) -> PreparedDescList:
        with self._lock:
            self._completions.require_open()
            return self._routes.prep_remote(peer, descs)

    # ---------------------------------------------------------------- transfers

    def read(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
             timeout_s: float | None = None) -> Transfer:
        """Read remote descriptors of ``peer`` into local ones (RMA get)."""
        return self._posting.transfer(XferOp.READ, peer, local, remote, notify, timeout_s)

    def write(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
              timeout_s: float | None = None) -> Transfer:
        """Write local descriptors to ``peer``'s remote ones (RMA put)."""
        return self._posting.transfer(XferOp.WRITE, peer, local, remote, notify, timeout_s)

    def read_prepared(self, local: PreparedDescList, local_index: Any, remote: PreparedDescList,
                      remote_index: Any, *, notify: bytes | None = None,
                      timeout_s: float | None = None) -> Transfer:
        """Read ``remote[remote_index]`` into ``local[local_index]``."""
        return self._routes.transfer(XferOp.READ, local, local_index, remote, remote_index, notify, timeout_s)

    def write_prepared(self, local: PreparedDescList, local_index: Any, remote: PreparedDescList,
                       remote_index: Any, *, notify: bytes | None = None,
                       timeout_s: float | None = None) -> Transfer:
        return self._routes.transfer(XferOp.WRITE, local, local_index, remote, remote_index, notify, timeout_s)

    def flush(self, peer: str, *, timeout_s: float | None = None) -> Transfer:
        """A transfer that completes once every earlier operation to ``peer``
        has completed remotely."""
        return self._posting.flush(peer, timeout_s)

    # ------------------------------------------------------ progress, notifications

    @property
    def manual_progress(self) -> bool:
        return self._completions.manual_progress

    @property
    def inflight(self) -> int:
        """Transfers in flight (a transfer striped over lanes counts once)."""
        return len(self._completions.inflight)

    def progress(self) -> int:
        """Drive the worker once (polling mode). Returns UCX events handled."""
        self._completions.require_open()
        return self._completions.progress()

    def get_notifications(self) -> list[Notification]:
        """Notifications received since the last call, in arrival order."""
        self._completions.require_open()
        return self._completions.notifications()

    # ------------------------------------------------------------------ closing

    @property
    def closed(self) -> bool:
        return self._completions.closed

    def close(self) -> None:
        """Let what is in flight finish (at most ``close_drain_s``), fail the
        rest, then tear down: lanes, remote keys and endpoints, memory,
        worker, context. Idempotent."""
        comp = self._completions
        with self._lock:
            if not comp.begin_close():
                return
        comp.stop_progress()  # from here on, this thread progresses the own worker
        with self._lock:
            # The lanes' pumps still run: they progress their share meanwhile.
            callbacks = comp.drain_for_close(f"agent {self.name!r} closed")  # also closes lane endpoints
        with self._lock:
            comp.helpers = ()  # the pumps stop next
        self._lanes.close()  # their workers go before the context
        with self._lock:
            callbacks += comp.close()
            self._peers.close()
            self._memory.close()
            self._worker.close()
            self._context.close()
        comp.run_callbacks(callbacks)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # backstop only; close() is the contract
        comp = getattr(self, "_completions", None)
        if comp is not None and not comp.closed and hasattr(self, "_routes"):
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return (f"Agent({self.name!r}, regions={len(self._memory.regions)}, peers={len(self._peers)}, "
                f"lanes={len(self._lanes) + 1}, inflight={self.inflight}, closed={self.closed})")
