"""Explicit transfers: ``read`` / ``write`` / ``flush`` of descriptor lists
that were not prepared.

Both lists are checked against the regions on their side (vectorised),
contiguous runs are merged (``coalesce``), and the batch is posted in one C
call: ``rk_post``, or, when ``rk_stripe_parts`` says the bytes earn more
than one worker, ``rk_post_striped`` over the lanes with the merged runs as
its tables, addressed by identity indices. The split itself (how many
parts, where to cut) is the shim's, the same rule as on the prepared path.

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
from rdma_kv.transport.descriptors import DescList, coalesce
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
        """Merge contiguous runs, then one rk_post or rk_post_striped.
        Caller holds the lock."""
        ffi, lib = self._ffi, self._lib
        num_descs = len(laddr)
        nbytes = int(lengths.sum()) if num_descs else 0
        laddr, raddr, lengths, lreg, rreg = coalesce(laddr, raddr, lengths, lreg, rreg)
        n_ops = len(laddr)
        memhs = self._registry.memhs_c
        parts = lib.rk_stripe_parts(nbytes, len(self._lanes) + 1, self._lane_min_bytes)
        if parts > 1:  # (a flush moves no bytes: never striped)
            stripe, ops = self._lanes.stripe(p, self._worker, self._completions.pump)[:2]
            ident = ffi.from_buffer("int64_t[]", np.arange(n_ops, dtype=np.int64))
            tables = [ffi.from_buffer("uint64_t[]", t) for t in (laddr, raddr, lengths)]
            regs = [ffi.NULL if r is None else ffi.from_buffer("uint32_t[]", r) for r in (lreg, rreg)]

            def striped(batch: Any, opcode: int, flush: int) -> int:
                return int(lib.rk_post_striped(batch, opcode, n_ops, ident, ident, 0, *tables, *regs,
                                               memhs, stripe, parts, nbytes, ops, flush))

            xfer = self._submit(op, p, nbytes, num_descs, notify, timeout_s, striped)
            xfer.worker_ops = tuple(ops[0:parts])
            return xfer
        # Single region: index 0 for every op (calloc'd, no pass).
        c_lreg = np.zeros(n_ops, dtype=np.uint32) if lreg is None else lreg
        c_rreg = np.zeros(n_ops, dtype=np.uint32) if rreg is None else rreg

        def post(batch: Any, opcode: int, flush: int) -> int:
            return int(lib.rk_post(
                batch, opcode, n_ops, ffi.from_buffer("uint64_t[]", laddr), ffi.from_buffer("uint64_t[]", raddr),
                ffi.from_buffer("uint64_t[]", lengths), ffi.from_buffer("uint32_t[]", c_lreg),
                memhs, ffi.from_buffer("uint32_t[]", c_rreg), p.rkeys, flush))

        return self._submit(op, p, nbytes, num_descs, notify, timeout_s, post)

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
