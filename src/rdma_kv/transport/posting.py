"""Explicit transfers: ``read`` / ``write`` / ``flush`` of descriptor lists
that were not prepared.

Both lists are checked against the regions on their side (vectorised),
then posted in one C call, ``rk_post_indexed``, the shim's one post loop,
with the lists as its tables, addressed by identity indices: it merges
contiguous runs and posts them as it goes, on the agent's worker or, when
the bytes earn more than one (``rk_stripe_parts``, the rule the prepared
path uses too), striped over the lanes.

``Posting`` reads the registry, the peer table and the lanes, and posts
through the completions, under the agent's lock (the completions' ``lock``).

May import: numpy, rdma_kv.errors and the transport's lower modules
(descriptors, lanes, peer, progress, registry, transfer, ucx); never agent.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rdma_kv.errors import DescriptorError
from rdma_kv.transport._lib import load
from rdma_kv.transport.descriptors import DescList
from rdma_kv.transport.lanes import Lanes
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.progress import Completions
from rdma_kv.transport.registry import MemoryRegistry
from rdma_kv.transport.transfer import Transfer, XferOp
from rdma_kv.transport.ucx import Worker

PostFn = Callable[[Any, int, int], int]  # (batch, opcode, flush) -> operations posted


class Posting:
    """Explicit transfers of one agent. ``usable(name)`` is the agent's check
    that a peer may be posted to (PeerError otherwise)."""

    def __init__(self, lane_min_bytes: int, registry: MemoryRegistry, lanes: Lanes, completions: Completions,
                 worker: Worker, usable: Callable[[str], Peer]) -> None:
        self._ffi, self._lib = load()
        self._lane_min_bytes = lane_min_bytes
        self._registry = registry
        self._lanes = lanes
        self._completions = completions
        self._worker = worker
        self._usable = usable

    def transfer(self, op: XferOp, peer: str, local: DescList, remote: DescList,
                 notify: bytes | None, timeout_s: float | None) -> Transfer:
        if len(local) != len(remote) or not np.array_equal(local.lengths, remote.lengths):
            raise DescriptorError(
                f"local and remote lists must pair up: {len(local)} vs {len(remote)} descriptors"
                + ("" if len(local) != len(remote) else "; their lengths differ")
            )
        comp = self._completions
        with comp.lock:
            comp.require_open()
            p = self._usable(peer)
            lreg = self._registry.table.locate(local.addrs, local.lengths, "local descriptors")
            rreg = p.table.locate(remote.addrs, remote.lengths, f"remote descriptors for {peer!r}")
            return self._post(op, p, local.addrs, remote.addrs, local.lengths, lreg, rreg, notify, timeout_s)

    def flush(self, peer: str, timeout_s: float | None) -> Transfer:
        """A transfer that completes once every earlier operation to ``peer``
        has completed remotely."""
        empty = np.empty(0, dtype=np.uint64)
        comp = self._completions
        with comp.lock:
            comp.require_open()
            p = self._usable(peer)
            return self._post(XferOp.FLUSH, p, empty, empty, empty, empty.astype(np.uint32),
                              empty.astype(np.uint32), None, timeout_s)

    def _post(self, op: XferOp, p: Peer, laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray,
              lreg: np.ndarray | None, rreg: np.ndarray | None, notify: bytes | None,
              timeout_s: float | None) -> Transfer:
        """Decide how many workers carry the bytes, then one rk_post_indexed
        over the lists as tables (identity indices). Caller holds the lock."""
        ffi, lib = self._ffi, self._lib
        n = len(laddr)
        nbytes = int(lengths.sum()) if n else 0
        parts = int(lib.rk_stripe_parts(nbytes, len(self._lanes) + 1, self._lane_min_bytes))
        if parts > 1:  # (a flush moves no bytes: never striped)
            stripe, ops = self._lanes.stripe(p, self._worker, self._completions.pump)[:2]
        else:
            stripe, ops = ffi.NULL, ffi.NULL
        ident = ffi.from_buffer("int64_t[]", np.arange(n, dtype=np.int64))
        tables = [ffi.from_buffer("uint64_t[]", t) for t in (laddr, raddr, lengths)]
        regs = [ffi.NULL if r is None else ffi.from_buffer("uint32_t[]", r) for r in (lreg, rreg)]
        memhs = self._registry.memhs_c

        def post(batch: Any, opcode: int, flush: int) -> int:
            return int(lib.rk_post_indexed(batch, opcode, n, ident, ident, 0, *tables, *regs, memhs, p.rkeys,
                                           stripe, parts, nbytes, ops, flush))

        xfer = self._submit(op, p, nbytes, n, notify, timeout_s, post)
        if parts > 1:
            xfer.worker_ops = tuple(ops[0:parts])
        return xfer

    def _submit(self, op: XferOp, p: Peer, nbytes: int, num_descs: int, notify: bytes | None,
                timeout_s: float | None, post: PostFn) -> Transfer:
        """Create the batch record, call ``post`` (one C call) and track the
        transfer. Caller holds the lock and has checked the peer."""
        comp, lib = self._completions, self._lib
        xid, batch = comp.new_batch(p.ep)
        keep = () if notify is None else comp.set_notif(batch, notify)
        xfer = comp.track(op, p, xid, batch, keep, nbytes, num_descs, timeout_s)
        is_put = op is XferOp.WRITE
        t0 = time.perf_counter()
        ops = post(batch, lib.RK_OP_PUT if is_put else lib.RK_OP_GET,
                   1 if (op is XferOp.FLUSH or (is_put and notify is not None)) else 0)
        return comp.posted(xfer, ops, time.perf_counter() - t0)
