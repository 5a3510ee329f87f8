"""Transfers between prepared lists: the engine's per-request path.

A request is often built right after a model step, with the CPU's caches
cold, where every Python step costs microseconds. So a request is one C
call: the two index arrays, the notification and the deadline go to
``rk_submit`` on the *route* of the two lists (route.py, kept on the
remote list), through the in-flight table's one submit path; the shim
checks that the route is current, that none of the peer's endpoints
failed and every index pair, takes a slot, posts (striped over the lanes
when large enough, spread over them when not) and returns; Python makes
the ``Transfer``. Anything the shim refuses -- no route yet, a stale one,
a failed peer, a bad pair -- goes to the checked path, which raises the
precise error or builds the route and submits once more.

``PreparedLists`` also makes the prepared lists (``prep_local``,
``prep_remote``). It reads the registry and the peer table, builds routes
with the agent's ``RouteBuilder`` and submits through ``InFlight``, under
the agent's lock.

May import: numpy, rdma_kv.errors and the transport's lower modules
(descriptors, inflight, peer, peers, registry, route, transfer); never agent.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdma_kv.errors import ClosedError, DescriptorError, PeerError
from rdma_kv.transport._lib import load
from rdma_kv.transport.descriptors import INT32, ChainedRead, DescList, PreparedList, as_index, pair_indices
from rdma_kv.transport.inflight import NOTIFY, OP_GET, SUBMIT_BAD_PAIR, SUBMIT_BAD_THEN, SUBMIT_PEER_FAILED, InFlight
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.peers import PeerTable
from rdma_kv.transport.registry import MemoryRegistry
from rdma_kv.transport.route import Route, RouteBuilder
from rdma_kv.transport.transfer import Transfer, XferOp


_NDARRAY = np.ndarray
_INT64 = np.dtype(np.int64)


@dataclass(frozen=True)
class RequestParts:
    """What both request paths (prepared and explicit) read: the agent's
    ``name`` and ``lock``, its registry, peer table, route builder and
    in-flight table, and ``usable(name)``, the agent's check that a peer may
    be posted to (its endpoints on every worker healthy; PeerError otherwise)."""

    name: str
    lock: threading.RLock
    registry: MemoryRegistry
    peers: PeerTable
    routes: RouteBuilder
    inflight: InFlight
    usable: Callable[[str], Peer]


class PreparedLists:
    """Prepared lists of one agent and transfers between them."""

    def __init__(self, parts: RequestParts) -> None:
        self._ffi = ffi = load()[0]
        self._from_buffer = ffi.from_buffer
        self._null = ffi.NULL
        self._name, self._lock, self._registry, self._peers = parts.name, parts.lock, parts.registry, parts.peers
        self._routes, self._inflight, self._usable = parts.routes, parts.inflight, parts.usable

    # ------------------------------------------------------------------- lists

    def prep_local(self, descs: DescList) -> PreparedList:
        reg = self._registry
        regions = reg.table.locate(descs.addrs, descs.lengths, "local descriptors")
        return PreparedList(descs, regions, None, reg.generation).attach_c_tables(self._ffi)

    def prep_remote(self, peer: str, descs: DescList) -> PreparedList:
        p = self._peers.get(peer)
        regions = p.table.locate(descs.addrs, descs.lengths, f"remote descriptors for {peer!r}")
        return PreparedList(descs, regions, peer, p.generation).attach_c_tables(self._ffi)

    # --------------------------------------------------------------- transfers

    def transfer(self, op: XferOp, code: int, local: PreparedList, local_index: Any, remote: PreparedList,
                 remote_index: Any, notify: bytes | None, timeout_s: float | None,
                 then: ChainedRead | None = None) -> Transfer:
        """``remote[remote_index]`` to or from ``local[local_index]`` (``code``:
        ``op``'s OP_*), and a read's chained read ``then``: one C call on a
        current route, else the checked path.

        Written for a cold cache, where each new kind of step costs
        microseconds (a page of numpy's, cffi's or the interpreter's own code
        to fetch): int64 or int32 numpy index arrays go to the shim as they
        are (it reads both widths and checks every index), read with three
        numpy calls (type, dtype, shape) and one buffer export each, under
        the lock taken without ``with`` (its special-method lookups cost
        more than the lock, cold)."""
        li, ri = local_index, remote_index
        if type(li) is _NDARRAY and type(ri) is _NDARRAY:
            ld, rd = li.dtype, ri.dtype
            flags = (0 if ld is _INT64 else 1 if ld is INT32 else 8) | (0 if rd is _INT64 else 2 if rd is INT32 else 8)
            lshape, rshape = li.shape, ri.shape
            if len(lshape) != 1 or len(rshape) != 1:
                flags = 8
        else:
            flags = 8
        if flags & 8:  # lists, other dtypes or shapes: converted once, then as above
            li, ri = as_index(local_index), as_index(remote_index)
            flags = (li.dtype is INT32) | (ri.dtype is INT32) << 1
            lshape, rshape = li.shape, ri.shape
        n = lshape[0]
        if n != rshape[0]:
            raise DescriptorError(f"selected descriptors must pair up: {n} local vs {rshape[0]} remote")
        lock, inflight = self._lock, self._inflight
        lock.acquire()
        try:
            route = remote.route
            if route is not None and route.local is local and route.builder is self._routes and (
                    notify is None or type(notify) is bytes):
                try:
                    lbuf, rbuf = self._from_buffer(li), self._from_buffer(ri)
                except (BufferError, ValueError):  # not contiguous (numpy says ValueError): a copy that is
                    li, ri = as_index(li), as_index(ri)
                    lbuf, rbuf = self._from_buffer(li), self._from_buffer(ri)
                # InFlight.submit, inlined (one frame fewer, cold): rk_submit, then track.
                null = self._null
                chain = null if then is None else self._chain(then, code, route)
                slot = inflight.rk_submit(route.c, code, n, lbuf, rbuf, null, null,
                                          flags if notify is None else flags | NOTIFY, notify or null,
                                          0 if notify is None else len(notify),
                                          0 if timeout_s is None else max(1, int(timeout_s * 1e9)),
                                          null if then is None else chain[0], inflight.out)
                x = inflight.track(slot, route, op, n, notify, None if then is None else chain)
                if isinstance(x, Transfer):
                    return x
                if x == SUBMIT_BAD_THEN and then is not None:
                    self._bad_then(then, chain)
            # No route for this pair yet, a stale one (the agent's peers or
            # regions changed, or it closed), a failed peer, a bad pair.
            li, ri = as_index(li), as_index(ri)
            return self._checked(op, code, local, li, local_index, remote, ri, remote_index,
                                 (li.dtype is INT32) | (ri.dtype is INT32) << 1, notify, timeout_s, then)
        finally:
            due = inflight.take_due()  # what the post settled: its callbacks run without the lock
            lock.release()
            if due:
                inflight.run_callbacks(due)

    def _checked(self, op: XferOp, code: int, local: PreparedList, li: Any, local_index: Any, remote: PreparedList,
                 ri: Any, remote_index: Any, flags: int, notify: bytes | None,
                 timeout_s: float | None, then: ChainedRead | None = None) -> Transfer:
        """Every check with its precise error; builds the pair's route and
        submits on it. Caller holds the lock."""
        if local.peer is not None or remote.peer is None:
            raise DescriptorError("pass a list from prep_local() as local and one from prep_remote() as remote")
        if self._inflight.closed:
            raise ClosedError(f"agent {self._name!r} is closed")
        self._check_local(local, "local prepared list")
        p = self._usable(remote.peer)
        self._check_remote(remote, p, "remote prepared list")
        route = self._routes.prepared(local, remote, p)
        object.__setattr__(remote, "route", route)
        chain = None if then is None else self._chain(then, code, route)
        x = self._inflight.submit(route, op, code, len(li), self._from_buffer(li), self._from_buffer(ri), self._null, self._null,
                                  flags, notify, timeout_s, chain)
        if isinstance(x, Transfer):
            return x
        if x == SUBMIT_BAD_THEN:
            assert then is not None and chain is not None
            self._bad_then(then, chain)
        if x == SUBMIT_BAD_PAIR:
            pair_indices(local, local_index, remote, remote_index)  # raises the precise error
            raise DescriptorError(f"descriptor pair {self._inflight.bad_pair} of {len(li)} failed the range "
                                  "or length check")
        if x == SUBMIT_PEER_FAILED:  # an endpoint failed since the check above
            self._usable(remote.peer)
            raise PeerError(f"peer {remote.peer!r} failed; re-import its metadata with add_peer() once it is back")
        raise AssertionError(f"rk_submit refused a route built just now (code {x})")

    def _check_local(self, local: PreparedList, what: str) -> None:
        """``local`` (named ``what`` in the error) is this agent's and current."""
        if local.generation != self._registry.generation or local.c_tables is None:
            raise DescriptorError(
                f"{what} was not made by prep_local() of agent {self._name!r} or predates "
                "a deregister(); prepare it again"
            )

    def _check_remote(self, remote: PreparedList, peer: Peer, what: str) -> None:
        """``remote`` (named ``what`` in the error) is this agent's, for ``peer`` as it is now."""
        if remote.generation != peer.generation or remote.c_tables is None:
            raise DescriptorError(
                f"{what} was not made by prep_remote() of agent {self._name!r} or is for an "
                f"earlier incarnation of {remote.peer!r}; prepare it again"
            )

    # ----------------------------------------------------------- chained reads

    def _chain(self, then: ChainedRead, code: int, route: Route) -> tuple[Any, ...]:
        """The C record of ``then``, the read chained behind a read on
        ``route``, and what keeps it alive (its arrays and its own route,
        kept on ``then.remote`` as a transfer's is). Caller holds the lock."""
        if code != OP_GET:
            raise DescriptorError("a chained read follows a read only: pass then= to read_prepared()")
        if type(then) is not ChainedRead:
            raise TypeError(f"then= takes a ChainedRead, got {type(then).__name__}")
        tl, local_index, tr, remote_index = then
        r = tr.route
        if r is None or r.local is not tl or r.builder is not self._routes or r.c.built_at != r.c.epoch[0]:
            if tr.peer != route.peer.name or tl.peer is not None:
                raise DescriptorError(f"a chained read reads from the same peer ({route.peer.name!r}) into a "
                                      f"local list: its remote list is for {tr.peer!r}")
            self._check_local(tl, "the chained read's local list")
            self._check_remote(tr, route.peer, "the chained read's remote list")
            r = self._routes.prepared(tl, tr, route.peer)
            object.__setattr__(tr, "route", r)
        li, ri = as_index(local_index), as_index(remote_index)
        n = li.shape[0]
        if n != ri.shape[0]:
            raise DescriptorError(f"the chained read's descriptors must pair up: {n} local vs {ri.shape[0]} remote")
        rec = self._ffi.new("rk_then_t *")
        rec.route, rec.l, rec.r = r.c, (lbuf := self._from_buffer(li)), (rbuf := self._from_buffer(ri))
        rec.n, rec.flags = n, (li.dtype is INT32) | (ri.dtype is INT32) << 1
        return rec, r, li, ri, lbuf, rbuf

    def _bad_then(self, then: ChainedRead, chain: tuple[Any, ...]) -> None:
        """Raise what the shim's refusal of a chained read means."""
        n, at = int(chain[0].n), self._inflight.bad_pair
        if at > n:  # (_chain checked the peer and the route: another incarnation of it, meanwhile)
            raise PeerError(f"the chained read's peer {then.remote.peer!r} is not the read's any more; "
                            "prepare its lists again")
        pair_indices(then.local, then.local_index, then.remote, then.remote_index)  # raises the precise error
        raise DescriptorError(f"the chained read's descriptor pair {at} of {n} failed the range check")
