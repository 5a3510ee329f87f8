"""Transfers between prepared lists: the engine's per-request path.

A request is often built right after a model step, with the CPU's caches
cold, where every Python step costs microseconds. So the common case -- the
same local and remote lists as last time, nothing changed since, with or
without a notification -- is one C call, ``rk_submit``, on a *route*: a C
record of what the two lists and the peer need (both lists' tables, the
peer's endpoint state and remote keys on every worker, the stripe over the
lanes), built once when the slow path first succeeds for the pair and kept
on the remote list.
``rk_submit`` checks the route is current, that none of the peer's endpoints
failed and every index pair, then posts (striped over the lanes when large
enough). Anything else returns to the slow path, which raises the precise
error or rebuilds the route.

A notification rides the same route: the caller fills it into the batch
record and ``rk_submit`` posts the endpoint flushes a notifying WRITE needs;
the shim sends it once every part on every worker has completed.

A route is current while the agent's ``Epoch`` has not moved: the memory
registry moves it when the agent's regions change, the peer table when a
peer is added, replaced, failed or removed, so a stale route is never used.
A route holds its ``Routes``, peer and local list: a remote list that
outlives its agent keeps them (closed, never used again) until the list goes.

``Routes`` also makes the prepared lists (``prep_local``, ``prep_remote``).
It reads the registry, the peer table and the lanes, and posts through the
completions; it runs under the agent's lock (the completions' ``lock``).

May import: numpy, rdma_kv.errors and the transport's lower modules
(descriptors, lanes, peer, peers, progress, registry, transfer); never agent.py.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

from rdma_kv.errors import DescriptorError
from rdma_kv.transport._lib import load
from rdma_kv.transport.descriptors import INT32, DescList, PreparedDescList, as_index, pair_indices
from rdma_kv.transport.lanes import Lanes
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.peers import PeerTable
from rdma_kv.transport.progress import Completions
from rdma_kv.transport.registry import MemoryRegistry
from rdma_kv.transport.transfer import Transfer, XferOp
from rdma_kv.transport.ucx import Worker


class Epoch:
    """The C counter routes are checked against (``rk_route_t.epoch``)."""

    def __init__(self) -> None:
        self.c: Any = load()[0].new("uint64_t *")

    def move(self) -> None:
        """Every route built so far is stale (peers or regions changed)."""
        self.c[0] += 1


class Route:
    """A ``rk_route_t`` and what keeps its arrays alive."""

    __slots__ = ("c", "owner", "local", "peer", "_keep")

    def __init__(self, c: Any, owner: Routes, local: PreparedDescList, peer: Peer, keep: tuple[Any, ...]) -> None:
        self.c = c
        self.owner = owner  # lists may be shared between agents; a route is one agent's
        self.local = local
        self.peer = peer
        self._keep = keep


class Routes:
    """Prepared lists of one agent and the routes between them. ``usable(name)``
    is the agent's check that a peer may be posted to (its endpoints on
    every worker healthy; PeerError otherwise)."""

    def __init__(self, name: str, lane_min_bytes: int, epoch: Epoch, registry: MemoryRegistry,
                 peers: PeerTable, lanes: Lanes, completions: Completions, worker: Worker,
                 usable: Callable[[str], Peer]) -> None:
        self._ffi, self._lib = load()
        self._name = name
        self._lane_min_bytes = lane_min_bytes
        self._epoch = epoch
        self._registry = registry
        self._peers = peers
        self._lanes = lanes
        self._completions = completions
        self._worker = worker
        self._usable = usable
        self._submit_out = self._ffi.new("uint64_t[]", 2 + len(lanes) + 1)  # rk_submit's out, under the lock

    # ------------------------------------------------------------------- lists

    def prep_local(self, descs: DescList) -> PreparedDescList:
        reg = self._registry
        regions = reg.table.locate(descs.addrs, descs.lengths, "local descriptors")
        return PreparedDescList(descs, regions, None, reg.generation).attach_c_tables(self._ffi)

    def prep_remote(self, peer: str, descs: DescList) -> PreparedDescList:
        p = self._peers.get(peer)
        regions = p.table.locate(descs.addrs, descs.lengths, f"remote descriptors for {peer!r}")
        return PreparedDescList(descs, regions, peer, p.generation).attach_c_tables(self._ffi)

    # --------------------------------------------------------------- transfers

    def transfer(self, op: XferOp, local: PreparedDescList, local_index: Any, remote: PreparedDescList,
                 remote_index: Any, notify: bytes | None, timeout_s: float | None) -> Transfer:
        """``remote[remote_index]`` to or from ``local[local_index]``: one C
        call on a current route, else the checked path."""
        li, ri = as_index(local_index), as_index(remote_index)
        n = len(li)
        if n != len(ri):
            raise DescriptorError(f"selected descriptors must pair up: {n} local vs {len(ri)} remote")
        idx32 = (li.dtype is INT32) | (ri.dtype is INT32) << 1  # RK_IDX_L32 | RK_IDX_R32
        comp = self._completions
        with comp.lock:
            route = remote.route
            if route is None or route.local is not local or route.owner is not self or comp.closed:
                return self._checked(op, local, li, local_index, remote, ri, remote_index, idx32,
                                     notify, timeout_s)
            ffi, lib = self._ffi, self._lib
            xid, batch = comp.new_batch(None)
            # A notification goes out once every part completed (and, for a
            # WRITE, once each endpoint that carried one was flushed).
            keep = () if notify is None else comp.set_notif(batch, notify)
            xfer = comp.track(op, route.peer, xid, batch, keep, 0, n, timeout_s)
            out = self._submit_out
            t0 = perf_counter()
            is_put = op is XferOp.WRITE
            ops = lib.rk_submit(route.c, batch, xid, lib.RK_OP_PUT if is_put else lib.RK_OP_GET, n,
                                ffi.from_buffer(li), ffi.from_buffer(ri), idx32,
                                1 if is_put and notify is not None else 0, out)
            if ops < 0:  # nothing posted: the checked path says why, or rebuilds the route
                comp.untrack(xfer)
                return self._checked(op, local, li, local_index, remote, ri, remote_index, idx32,
                                     notify, timeout_s)
            xfer.nbytes = out[0]
            parts = out[1]
            if parts > 1:
                xfer.worker_ops = tuple(out[2:2 + parts])
            return comp.posted(xfer, ops, perf_counter() - t0)

    def _checked(self, op: XferOp, local: PreparedDescList, li: Any, local_index: Any,
                 remote: PreparedDescList, ri: Any, remote_index: Any, idx32: int,
                 notify: bytes | None, timeout_s: float | None) -> Transfer:
        """Every check in Python, with the precise error; builds the pair's
        route for the next request. Caller holds the lock."""
        if local.peer is not None or remote.peer is None:
            raise DescriptorError("pass a list from prep_local() as local and one from prep_remote() as remote")
        self._completions.require_open()
        if local.generation != self._registry.generation or local.c_tables is None:
            raise DescriptorError(
                f"local prepared list was not made by prep_local() of agent {self._name!r} or predates "
                "a deregister(); prepare it again"
            )
        p = self._usable(remote.peer)
        if remote.generation != p.generation or remote.c_tables is None:
            raise DescriptorError(
                f"remote prepared list was not made by prep_remote() of agent {self._name!r} or is for an "
                f"earlier incarnation of {remote.peer!r}; prepare it again"
            )
        ffi, lib = self._ffi, self._lib
        n = len(li)
        out = self._submit_out
        ok = lib.rk_check_indexed(n, ffi.from_buffer(li), ffi.from_buffer(ri), idx32, local.c_tables[3],
                                  remote.c_tables[3], local.c_tables[1], remote.c_tables[1], out)
        if ok != n:
            pair_indices(local, local_index, remote, remote_index)  # raises the precise error
            raise DescriptorError(f"descriptor pair {ok} of {n} failed the range or length check")
        object.__setattr__(remote, "route", self._route(local, remote, p))
        return self.transfer(op, local, li, remote, ri, notify, timeout_s)  # now one C call

    def _route(self, local: PreparedDescList, remote: PreparedDescList, p: Peer) -> Route:
        """The C route of (local, remote) to peer ``p``, current as of now.
        Caller holds the lock and has checked the lists and the peer."""
        ffi = self._ffi
        laddr, llen, lreg, nl = local.c_tables
        raddr, rlen, rreg, nr = remote.c_tables
        uniform = local.uniform_length
        peers = self._lanes.endpoints(p)
        states = ffi.new("rk_ep_state_t *[]", [q.ep_state for q in peers])
        stripe = self._lanes.stripe(p, self._worker, self._completions.pump) if len(self._lanes) else None
        memhs = self._registry.memhs
        c = ffi.new("rk_route_t *", {
            "laddr": laddr, "llen": llen, "lreg": lreg, "nl": nl,
            "raddr": raddr, "rlen": rlen, "rreg": rreg, "nr": nr,
            "uniform": uniform if uniform is not None and uniform == remote.uniform_length else 0,
            "memhs": self._registry.memhs_c, "ctx": self._completions.ctx, "ep": p.ep, "rkeys": p.rkeys,
            "stripe": stripe[0] if stripe else ffi.NULL, "nworkers": len(peers),
            "lane_min_bytes": self._lane_min_bytes,
            "ep_states": states, "epoch": self._epoch.c, "built_at": self._epoch.c[0],
        })
        return Route(c, self, local, p, (states, local.c_tables, remote.c_tables, stripe, memhs))
