"""The transfer agent: one per process, the façade of the transport.

``Agent`` owns the API (memory, metadata, peers, descriptors, posting,
closing); the progress, completion and failure machinery it inherits from
``progress.ProgressEngine``.

An ``Agent`` registers memory, publishes its metadata (worker address and
packed remote keys), imports peers' metadata, and posts batches of
one-sided READ / WRITE operations, each batch one C call
(``rk_post``). Completion is asynchronous: a ``Transfer`` handle is polled,
waited on or awaited, and an optional notification reaches the peer once
the batch has completed.

Threading: every UCX call from Python happens under ``self._lock``, so the
agent may be used from any of the engine's threads. With
``progress="thread"`` a C thread of the shim (the pump) progresses the
worker (``UCS_THREAD_MODE_MULTI``) without the interpreter lock, and a
Python thread sleeps on an eventfd until the pump reports something to
settle; with ``progress="poll"`` (worker ``UCS_THREAD_MODE_SERIALIZED``)
the caller drives it through ``progress()`` (``wait`` and ``done`` do so
too).

Bounded failure: every transfer has a deadline. When it passes, or when UCX
reports the peer's endpoint failed, the peer is marked failed, its endpoint
force-closed (cancelling its operations) and every transfer with it fails
with a message that says so. Nothing waits forever on a dead peer.

May import: numpy, rdma_kv.errors, the other rdma_kv.transport modules.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from rdma_kv.errors import (
    ConfigError,
    DescriptorError,
    PeerError,
    RegistrationError,
    TransferError,
)
from rdma_kv.transport import metadata as wire
from rdma_kv.transport._lib import check_status, load, status_name, ucx_version
from rdma_kv.transport.cuda import creator_context
from rdma_kv.transport.descriptors import DescList, PreparedDescList, coalesce
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.lanes import MAX_LANES, Lanes, lane_factory, start_pump
from rdma_kv.transport.memory import (
    MemoryKind,
    MemoryRegion,
    RegionTable,
    declared_span,
    kind_from_ucs,
    kinds_in_mask,
    mismatch_error,
    same_memory,
)
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.prepared import NOTIF_AM_ID, PreparedTransfers
from rdma_kv.transport.progress import Notification, ProgressEngine
from rdma_kv.transport.transfer import Transfer, XferOp, XferState
from rdma_kv.transport.ucx import Context, Worker

log = logging.getLogger(__name__)

# Generations of prepared lists come from one process-wide counter, so a list
# prepared by another Agent never matches: its region indices would address
# that agent's memory handles and remote keys, not ours (the C post loop
# indexes memhs[] / rkeys[] with them unchecked).
_generations = itertools.count(1)


class Agent(ProgressEngine, Lanes, PreparedTransfers):
    """One UCX worker (plus ``config.lanes - 1`` lanes), its registered memory
    and its peers. Use as a context manager or call ``close()``.

    ``_owner`` is internal: a lane is an Agent on its owner's context, which
    it neither maps memory into nor closes; a C pump progresses its worker
    and the owner settles its completions (lanes.py)."""

    def __init__(self, name: str, config: AgentConfig | None = None, *, _owner: Agent | None = None) -> None:
        _context = None if _owner is None else _owner._context
        if _context is None and (not name or len(name.encode()) > wire.MAX_NAME_BYTES):
            raise ConfigError(f"agent name must be 1..{wire.MAX_NAME_BYTES} bytes, got {name!r}")
        self.name = name
        self.config = cfg = config or AgentConfig()
        self._ffi, self._lib = load()
        ffi, lib = self._ffi, self._lib
        self._lock = threading.RLock()
        self._closed = False
        self._lanes: list[Agent] = []
        self._pump: Any = None
        self._wake_fd = -1  # progress="thread": the eventfd the pumps wake this agent's thread on
        self._last_event = 0.0
        self._owns_context = _context is None
        self._context = _context or Context(cfg.ucx_options, name=name, shared_workers=cfg.lanes > 1)
        try:
            # A pumped worker (progress="thread", or a lane) is progressed by a
            # C thread while Python posts: UCX's own worker lock.
            # With lanes, a lane's pump may complete a batch's last operation
            # and then send its notification on this worker's endpoint.
            self._worker = Worker(self._context, multi_thread=_owner is not None or cfg.progress == "thread"
                                  or cfg.lanes > 1)
        except BaseException:
            if self._owns_context:
                self._context.close()
            raise
        # Caller-owned rings the shim writes into (see csrc/shim.h).
        self._ctx = ffi.new("rk_ctx_t *")
        self._batch_t = ffi.typeof("rk_batch_t *")
        self._submit_out = ffi.new("uint64_t[]", 2 + MAX_LANES)  # rk_submit's out (bytes, parts, ops), under the lock
        # Routes (prepared.py) are current while the epoch stays put. A lane
        # moves its owner's: a lane endpoint failed or closed stales them too.
        self._epoch = _owner._epoch if _owner is not None else ffi.new("uint64_t *")
        self._done_ring = ffi.new("uint64_t[]", cfg.max_inflight)
        self._ctx.done_ring = self._done_ring
        self._ctx.done_cap = cfg.max_inflight
        self._done_tail = 0
        slot = cfg.notif_max_bytes + wire.MAX_NAME_BYTES + 8
        self._notif_mem = ffi.new("uint8_t[]", cfg.notif_slots * slot)
        self._notif_view = memoryview(ffi.buffer(self._notif_mem))
        self._ctx.notif_slots = self._notif_mem
        self._ctx.notif_slot_size = slot
        self._ctx.notif_nslots = cfg.notif_slots
        self._notif_dropped = 0
        check_status(
            lib.rk_set_notif_handler(self._worker.handle, NOTIF_AM_ID, self._ctx),
            "ucp_worker_set_am_recv_handler",
        )
        self._name_c = ffi.new("char[]", name.encode())
        self._name_len = len(name.encode())
        self._regions: list[MemoryRegion] = []
        self._local_table = RegionTable([], f"agent {name!r}")
        self._local_gen = next(_generations)
        self._memhs = ffi.new("ucp_mem_h[]", 1)
        self._memhs_c = ffi.NULL  # _memhs once a region is registered (what rk_post* get)
        self._peers: dict[str, Peer] = {}
        self._retired: list[Peer] = []
        self._inflight: dict[int, Transfer] = {}
        # Batch records (and notification buffers) UCX may still touch after their
        # transfer was failed without UCX's completion: freed when it comes.
        self._zombies: dict[int, Any] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self._notifs: deque[Notification] = deque()
        self._callbacks: list[tuple[Callable[[Transfer], None], Transfer]] = []
        self.stats = {"transfers": 0, "ops_posted": 0, "descs": 0, "bytes": 0, "failed": 0}
        self._thread: threading.Thread | None = None
        # The creator's CUDA context (None without CUDA): every pump makes it
        # current before it progresses (cuda.py).
        self._cuda = _owner._cuda if _owner is not None else creator_context()
        try:
            if _owner is not None:
                self._pump = start_pump(self, _owner)
            elif cfg.progress == "thread":
                self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                self._pump = start_pump(self, self)
        except BaseException:
            if self._wake_fd >= 0:
                os.close(self._wake_fd)
            self._worker.close()
            if self._owns_context:
                self._context.close()
            raise
        if self._pump is not None and _owner is None:
            self._thread = threading.Thread(target=self._service_loop, name=f"rdma-kv-progress-{name}", daemon=True)
            self._thread.start()
        if cfg.lanes > 1:
            # A lane posts no batch of its own (the agent stripes onto its
            # endpoints) and receives no notification: minimal rings.
            lane_cfg = replace(cfg, lanes=1, progress="poll", max_inflight=1, notif_slots=1)
            try:
                self._lanes = lane_factory(lambda i: Agent(f"{name}.lane{i}", lane_cfg, _owner=self), cfg.lanes - 1)
            except BaseException:
                self.close()
                raise

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
        span = declared_span(obj, memory_type)
        kind = span.kind
        owner = None if isinstance(obj, tuple) else obj
        with self._lock:
            self._require_open()
            for region in self._regions:
                if region.contains(span.base, span.nbytes):
                    if kind is not None and not same_memory(kind, region.kind):
                        raise RegistrationError(
                            f"[{span.base:#x}, +{span.nbytes}) is declared {kind.value} memory but lies in "
                            f"{region}, which UCX mapped as {region.kind.value}")
                    region.refs += 1
                    if owner is not None:
                        region.owners.append(owner)
                    return region
                if span.base < region.end and region.base < span.base + span.nbytes:
                    raise RegistrationError(
                        f"[{span.base:#x}, +{span.nbytes}) overlaps registered region "
                        f"[{region.base:#x}, +{region.nbytes}) without lying inside it; "
                        "register the enclosing allocation once instead"
                    )
            region = self._map(span.base, span.nbytes, kind)
            if owner is not None:
                region.owners.append(owner)
            self._regions.append(region)
            self._rebuild_local()
            return region

    def _map(self, base: int, nbytes: int, kind: MemoryKind | None) -> MemoryRegion:
        """``ucp_mem_map`` without a memory-type hint: UCX detects the type
        through the memory domains of its enabled transports (a hint would be
        trusted and echoed by ucp_mem_query, hiding a UCX that cannot reach
        device memory). The detected type must be the declared ``kind``."""
        ffi, lib = self._ffi, self._lib
        params = ffi.new("ucp_mem_map_params_t *")
        params.field_mask = lib.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | lib.UCP_MEM_MAP_PARAM_FIELD_LENGTH
        params.address = ffi.cast("void *", base)
        params.length = nbytes
        memh_p = ffi.new("ucp_mem_h *")
        check_status(lib.ucp_mem_map(self._context.handle, params, memh_p), f"ucp_mem_map of [{base:#x}, +{nbytes})")
        memh = memh_p[0]
        try:
            attr = ffi.new("ucp_mem_attr_t *")
            attr.field_mask = lib.UCP_MEM_ATTR_FIELD_MEM_TYPE
            check_status(lib.ucp_mem_query(memh, attr), "ucp_mem_query")
            ucx_kind = kind_from_ucs(attr.mem_type)
            if kind is not None and not same_memory(kind, ucx_kind):
                tls = self.config.ucx_options.get("TLS") or os.environ.get("UCX_TLS") or "all (default)"
                raise mismatch_error(base, nbytes, kind, ucx_kind, kinds_in_mask(self._context.memory_types()), tls)
            buf = ffi.new("void **")
            size = ffi.new("size_t *")
            check_status(lib.ucp_rkey_pack(self._context.handle, memh, buf, size), "ucp_rkey_pack")
            packed = bytes(ffi.buffer(buf[0], size[0]))
            lib.ucp_rkey_buffer_release(buf[0])
        except BaseException:
            lib.ucp_mem_unmap(self._context.handle, memh)
            raise
        return MemoryRegion(base, nbytes, ucx_kind, memh, packed)

    def deregister(self, region: MemoryRegion) -> None:
        """Drop one reference; unmap when the last one goes. Peers must
        re-import metadata afterwards."""
        with self._lock:
            self._require_open()
            if region not in self._regions:
                raise RegistrationError(f"{region} is not registered with agent {self.name!r}")
            if region.refs > 1:
                region.refs -= 1
                return
            if self.inflight:
                raise RegistrationError(
                    f"cannot deregister {region}: {self.inflight} transfers in flight; wait for them first"
                )
            self._regions.remove(region)
            check_status(self._lib.ucp_mem_unmap(self._context.handle, region.memh), "ucp_mem_unmap")
            region.owners.clear()  # unmapped: the memory may go now
            self._local_gen = next(_generations)
            self._rebuild_local()

    def _rebuild_local(self) -> None:
        self._invalidate_routes()  # their memory handles and tables
        self._local_table = RegionTable([(r.base, r.nbytes) for r in self._regions], f"agent {self.name!r}")
        self._memhs = self._ffi.new("ucp_mem_h[]", [r.memh for r in self._regions] or 1)
        self._memhs_c = self._memhs if self._regions else self._ffi.NULL

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    # ---------------------------------------------------------------- metadata

    def metadata(self) -> bytes:
        """Typed, versioned bytes a peer passes to ``add_peer``."""
        with self._lock:
            self._require_open()
            regions = [wire.RegionInfo(r.base, r.nbytes, r.kind, r.packed_rkey) for r in self._regions]
            return wire.encode(self.name, ucx_version(), self._worker.address, regions)

    def add_peer(self, blob: bytes) -> str:
        """Import a peer's metadata; returns its name. Importing a name again
        replaces the peer (a restarted peer has a new worker address): its
        transfers in flight fail, prepared lists for it must be prepared again."""
        md = wire.decode(blob)
        if md.name == self.name:
            raise PeerError(f"metadata names this agent itself ({self.name!r}); pass the peer's metadata")
        with self._lock:
            self._require_open()
            generation = next(_generations)
            self._install_peer(md, generation)
            try:
                self._install_on_lanes(md, generation)
            except BaseException:
                self.remove_peer(md.name)
                raise
            return md.name

    def _install_peer(self, md: wire.AgentMetadata, generation: int) -> None:
        self._invalidate_routes()
        old = self._peers.pop(md.name, None)
        if old is not None:
            self._fail_peer(old, "replaced by newly imported metadata")
            self._retire(old)
        self._peers[md.name] = Peer(self._worker, md, generation, self._ctx)

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._require_open()
            peer = self._peer(name)
            del self._peers[name]
            self._invalidate_routes()
            if peer.inflight:
                self._fail_peer(peer, "removed by remove_peer()")
            self._retire(peer)
            self._remove_from_lanes(name)

    def _retire(self, peer: Peer) -> None:
        if peer.inflight == 0:
            peer.close(force=not peer.healthy)
        else:
            self._retired.append(peer)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def _peer(self, name: str) -> Peer:
        peer = self._peers.get(name)
        if peer is None:
            known = ", ".join(sorted(self._peers)) or "none"
            raise PeerError(f"unknown peer {name!r} (known peers: {known}); import its metadata with add_peer()")
        return peer

    def _usable_peer(self, name: str) -> Peer:
        peer = self._peer(name)
        if not peer.healthy:
            raise PeerError(
                f"peer {name!r} failed ({peer.failure or status_name(peer.ep_state.status)}); "
                "re-import its metadata with add_peer() once it is back"
            )
        if self._lanes:
            self._check_lanes(peer)
        return peer

    # ------------------------------------------------------------- descriptors

    def prep_local(self, descs: DescList) -> PreparedDescList:
        """Check local descriptors once; transfers then address them by index."""
        with self._lock:
            self._require_open()
            regions = self._local_table.locate(descs.addrs, descs.lengths, "local descriptors")
            return PreparedDescList(descs, regions, None, self._local_gen).attach_c_tables(self._ffi)

    def prep_remote(self, peer: str, descs: DescList) -> PreparedDescList:
        with self._lock:
            self._require_open()
            p = self._peer(peer)
            regions = p.table.locate(descs.addrs, descs.lengths, f"remote descriptors for {peer!r}")
            return PreparedDescList(descs, regions, peer, p.generation).attach_c_tables(self._ffi)

    # ---------------------------------------------------------------- transfers

    def read(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
             timeout_s: float | None = None) -> Transfer:
        """Read remote descriptors of ``peer`` into local ones (RMA get)."""
        return self._transfer(XferOp.READ, peer, local, remote, notify, timeout_s)

    def write(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
              timeout_s: float | None = None) -> Transfer:
        """Write local descriptors to ``peer``'s remote ones (RMA put)."""
        return self._transfer(XferOp.WRITE, peer, local, remote, notify, timeout_s)

    def _transfer(self, op: XferOp, peer: str, local: DescList, remote: DescList,
                  notify: bytes | None, timeout_s: float | None) -> Transfer:
        if len(local) != len(remote) or not np.array_equal(local.lengths, remote.lengths):
            raise DescriptorError(
                f"local and remote lists must pair up: {len(local)} vs {len(remote)} descriptors"
                + ("" if len(local) != len(remote) else "; their lengths differ")
            )
        with self._lock:
            self._require_open()
            p = self._usable_peer(peer)
            lreg = self._local_table.locate(local.addrs, local.lengths, "local descriptors")
            rreg = p.table.locate(remote.addrs, remote.lengths, f"remote descriptors for {peer!r}")
            return self._post(op, p, local.addrs, remote.addrs, local.lengths, lreg, rreg, notify, timeout_s)

    def read_prepared(self, local: PreparedDescList, local_index: Any, remote: PreparedDescList,
                      remote_index: Any, *, notify: bytes | None = None,
                      timeout_s: float | None = None) -> Transfer:
        """Read ``remote[remote_index]`` into ``local[local_index]``."""
        return self._prepared(XferOp.READ, local, local_index, remote, remote_index, notify, timeout_s)

    def write_prepared(self, local: PreparedDescList, local_index: Any, remote: PreparedDescList,
                       remote_index: Any, *, notify: bytes | None = None,
                       timeout_s: float | None = None) -> Transfer:
        return self._prepared(XferOp.WRITE, local, local_index, remote, remote_index, notify, timeout_s)

    def flush(self, peer: str, *, timeout_s: float | None = None) -> Transfer:
        """A transfer that completes once every earlier operation to ``peer``
        has completed remotely."""
        empty = np.empty(0, dtype=np.uint64)
        with self._lock:
            self._require_open()
            p = self._usable_peer(peer)
            return self._post(XferOp.FLUSH, p, empty, empty, empty, empty.astype(np.uint32),
                              empty.astype(np.uint32), None, timeout_s)

    def _post(self, op: XferOp, p: Peer, laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray,
              lreg: np.ndarray | None, rreg: np.ndarray | None, notify: bytes | None,
              timeout_s: float | None) -> Transfer:
        """Post explicit descriptors: merge contiguous runs, then one rk_post
        (or, large enough, one rk_post_striped over the lanes, the merged
        runs read as tables by identity indices)."""
        ffi, lib = self._ffi, self._lib
        num_descs = len(laddr)
        nbytes = int(lengths.sum()) if num_descs else 0
        laddr, raddr, lengths, lreg, rreg = coalesce(laddr, raddr, lengths, lreg, rreg)
        n_ops = len(laddr)
        parts = lib.rk_stripe_parts(nbytes, len(self._lanes) + 1, self.config.lane_min_bytes)
        if parts > 1:  # (a flush moves no bytes: never striped)
            stripe, ops = self._stripe(p)[:2]
            ident = ffi.from_buffer("int64_t[]", np.arange(n_ops, dtype=np.int64))
            tables = [ffi.from_buffer("uint64_t[]", t) for t in (laddr, raddr, lengths)]
            regs = [ffi.NULL if r is None else ffi.from_buffer("uint32_t[]", r) for r in (lreg, rreg)]

            def striped(batch: Any, opcode: int, flush: int) -> int:
                return int(lib.rk_post_striped(batch, opcode, n_ops, ident, ident, 0, *tables, *regs,
                                               self._memhs_c, stripe, parts, nbytes, ops, flush))

            xfer = self._submit(op, p, nbytes, num_descs, notify, timeout_s, striped)
            xfer.worker_ops = tuple(ops[0:parts])
            return xfer
        if lreg is None:  # single region: index 0 for every op (calloc'd, no pass)
            lreg = np.zeros(n_ops, dtype=np.uint32)
        if rreg is None:
            rreg = np.zeros(n_ops, dtype=np.uint32)

        def post(batch: Any, opcode: int, flush: int) -> int:
            return int(lib.rk_post(
                batch, opcode, n_ops, ffi.from_buffer("uint64_t[]", laddr), ffi.from_buffer("uint64_t[]", raddr),
                ffi.from_buffer("uint64_t[]", lengths), ffi.from_buffer("uint32_t[]", lreg),
                self._memhs_c, ffi.from_buffer("uint32_t[]", rreg), p.rkeys, flush))

        return self._submit(op, p, nbytes, num_descs, notify, timeout_s, post)

    def _new_batch(self, ep: Any) -> tuple[int, Any]:
        """A transfer id and its batch record (for endpoint ``ep``; None: a
        zeroed record that rk_submit fills in), if there is room. Caller
        holds the lock."""
        cfg = self.config
        if len(self._inflight) + len(self._zombies) >= cfg.max_inflight:
            # UCX may still write the zombies' records: they count too.
            raise TransferError(f"{cfg.max_inflight} transfers already in flight on {self.name!r} "
                                "(AgentConfig.max_inflight); wait for some to complete")
        xid = next(self._ids)
        if ep is None:  # the request path fills the batch itself: skip cffi's initializer conversion
            return xid, self._ffi.new(self._batch_t)
        return xid, self._ffi.new(self._batch_t, (xid, self._ctx, ep))

    def _submit(self, op: XferOp, p: Peer, nbytes: int, num_descs: int, notify: bytes | None,
                timeout_s: float | None, post: Callable[[Any, int, int], int]) -> Transfer:
        """Create the batch record, call ``post`` (one C call) and track the
        transfer. Caller holds the lock and has checked the peer."""
        lib = self._lib
        xid, batch = self._new_batch(p.ep)
        keep = () if notify is None else self._set_notif(batch, notify)
        xfer = self._track(op, p, xid, batch, keep, nbytes, num_descs, timeout_s)
        is_put = op is XferOp.WRITE
        t0 = time.perf_counter()
        ops = post(batch, lib.RK_OP_PUT if is_put else lib.RK_OP_GET,
                   1 if (op is XferOp.FLUSH or (is_put and notify is not None)) else 0)
        return self._posted(xfer, ops, time.perf_counter() - t0)

    def _track(self, op: XferOp, p: Peer, xid: int, batch: Any, keep: tuple[Any, ...], nbytes: int,
               num_descs: int, timeout_s: float | None) -> Transfer:
        """The Transfer of a batch about to be posted, tracked from now on:
        UCX may write its record (and complete it on a pump) as soon as
        anything is posted. Caller holds the lock."""
        deadline = time.monotonic() + (self.config.transfer_timeout_s if timeout_s is None else timeout_s)
        xfer = Transfer(self, xid, op, p.name, batch, keep, nbytes, num_descs, deadline)
        xfer._peer_ref = p
        self._inflight[xid] = xfer
        p.inflight += 1
        heapq.heappush(self._deadlines, (deadline, xid))  # _expire skips ids no longer in flight
        return xfer

    def _untrack(self, xfer: Transfer) -> None:
        """Forget a tracked transfer whose batch was not posted at all."""
        del self._inflight[xfer.id]
        xfer._peer_ref.inflight -= 1

    def _posted(self, xfer: Transfer, ops: int, post_s: float) -> Transfer:
        """Account for a tracked transfer's post (``ops`` operations).
        Caller holds the lock."""
        xfer.ops_posted = ops
        xfer.post_s = post_s
        s = self.stats
        s["transfers"] += 1
        s["ops_posted"] += ops
        s["descs"] += xfer.num_descs
        s["bytes"] += xfer.nbytes
        if self._lib.rk_done_head(self._ctx) != self._done_tail:  # some batch completed in place
            self._drain_completions()
        if self._thread is not None and xfer.state is XferState.IN_PROGRESS:
            self._worker.signal()
        if self._callbacks:
            # Posting thread holds the (reentrant) lock; callbacks run now.
            self._run_callbacks(self._take_callbacks())
        return xfer

    # ------------------------------------------------------------ notifications

    def get_notifications(self) -> list[Notification]:
        """Notifications received since the last call, in arrival order."""
        with self._lock:
            self._require_open()
            self._poll_if_manual()
            out = list(self._notifs)
            self._notifs.clear()
            return out

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Let what is in flight finish (at most ``close_drain_s``), fail the
        rest, then tear down: lanes, remote keys and endpoints, memory,
        worker, context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._worker.signal()  # a caller sleeping in wait() (polling mode)
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)  # the service thread
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._pump is not None:
            self._lib.rk_pump_stop(self._pump)  # joins the C thread; from here on, Python progresses
            self._pump = None
        with self._lock:
            # The lanes' pumps still run: they progress their share meanwhile.
            end = time.monotonic() + self.config.close_drain_s
            while self._inflight and time.monotonic() < end:
                if not self._progress_locked():
                    time.sleep(0.0001)
            self._fail_all(f"agent {self.name!r} closed")  # also force-closes lane endpoints with work left
            callbacks = self._take_callbacks()
        self._close_lanes()  # their workers go before the context
        with self._lock:
            self._drain_completions()
            callbacks += self._take_callbacks()
            for peer in list(self._peers.values()) + self._retired:
                peer.close(force=not peer.healthy)
            self._peers.clear()
            self._retired.clear()
            for region in self._regions:  # a lane has none: they are its owner's
                self._lib.ucp_mem_unmap(self._context.handle, region.memh)
                region.owners.clear()
            self._regions.clear()
            self._worker.close()
            if self._owns_context:
                self._context.close()
            if self._wake_fd >= 0:  # every pump writing to it has stopped
                os.close(self._wake_fd)
                self._wake_fd = -1
        self._run_callbacks(callbacks)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # backstop only; close() is the contract
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return (f"Agent({self.name!r}, regions={len(self._regions)}, peers={len(self._peers)}, "
                f"lanes={len(self._lanes) + 1}, inflight={self.inflight}, closed={self._closed})")
