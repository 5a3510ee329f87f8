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

A route is current while the agent's *epoch* has not moved: the agent
moves it when a peer is added, replaced, failed or removed and when its own
regions change (``_invalidate_routes``), so a stale route is never used.
A route holds its agent, peer and local list: a remote list that outlives
its agent keeps them (closed, never used again) until the list goes.

May import: numpy, rdma_kv.errors and the other rdma_kv.transport modules, never agent.py.
"""

from __future__ import annotations

import threading
from time import perf_counter
from typing import TYPE_CHECKING, Any

from rdma_kv.errors import ConfigError, DescriptorError
from rdma_kv.transport.descriptors import INT32, PreparedDescList, as_index, pair_indices
from rdma_kv.transport.transfer import Transfer, XferOp

if TYPE_CHECKING:
    from rdma_kv.transport.config import AgentConfig
    from rdma_kv.transport.peer import Peer


NOTIF_AM_ID = 0x524B  # "RK": active-message id of rdma-kv notifications


class Route:
    """A ``rk_route_t`` and what keeps its arrays alive."""

    __slots__ = ("c", "agent", "local", "peer", "_keep")

    def __init__(self, c: Any, agent: Any, local: PreparedDescList, peer: Peer, keep: tuple[Any, ...]) -> None:
        self.c = c
        self.agent = agent  # lists may be shared between agents; a route is one agent's
        self.local = local
        self.peer = peer
        self._keep = keep


class PreparedTransfers:
    """The prepared-transfer half of ``Agent`` (which sets every attribute used here)."""

    _lock: threading.RLock
    _closed: bool
    _lanes: list[Any]
    _peers: dict[str, Peer]
    _epoch: Any  # uint64_t *: moved by _invalidate_routes
    _ffi: Any
    _lib: Any
    _ctx: Any  # rk_ctx_t *
    _submit_out: Any  # uint64_t[]: rk_submit's and rk_check_indexed's out
    _local_gen: int
    _name_c: Any  # char[]: the agent's name, a notification's header
    _name_len: int
    _memhs: Any
    _memhs_c: Any
    config: AgentConfig
    name: str

    def _invalidate_routes(self) -> None:
        """Every route built so far is stale (peers or regions changed)."""
        self._epoch[0] += 1

    def _prepared(self, op: XferOp, local: PreparedDescList, local_index: Any, remote: PreparedDescList,
                  remote_index: Any, notify: bytes | None, timeout_s: float | None) -> Transfer:
        li, ri = as_index(local_index), as_index(remote_index)
        n = len(li)
        if n != len(ri):
            raise DescriptorError(f"selected descriptors must pair up: {n} local vs {len(ri)} remote")
        idx32 = (li.dtype is INT32) | (ri.dtype is INT32) << 1  # RK_IDX_L32 | RK_IDX_R32
        with self._lock:
            route = remote.route
            if route is None or route.local is not local or route.agent is not self or self._closed:
                return self._prepared_checked(op, local, li, local_index, remote, ri, remote_index, idx32,
                                              notify, timeout_s)
            ffi, lib = self._ffi, self._lib
            xid, batch = self._new_batch(None)  # type: ignore[attr-defined]
            # A notification goes out once every part completed (and, for a
            # WRITE, once each endpoint that carried one was flushed).
            keep = () if notify is None else self._set_notif(batch, notify)
            xfer = self._track(op, route.peer, xid, batch, keep, 0, n, timeout_s)  # type: ignore[attr-defined]
            out = self._submit_out
            t0 = perf_counter()
            is_put = op is XferOp.WRITE
            ops = lib.rk_submit(route.c, batch, xid, lib.RK_OP_PUT if is_put else lib.RK_OP_GET, n,
                                ffi.from_buffer(li), ffi.from_buffer(ri), idx32,
                                1 if is_put and notify is not None else 0, out)
            if ops < 0:  # nothing posted: the slow path says why, or rebuilds the route
                self._untrack(xfer)  # type: ignore[attr-defined]
                return self._prepared_checked(op, local, li, local_index, remote, ri, remote_index, idx32,
                                              notify, timeout_s)
            xfer.nbytes = out[0]
            parts = out[1]
            if parts > 1:
                xfer.worker_ops = tuple(out[2:2 + parts])
            return self._posted(xfer, ops, perf_counter() - t0)  # type: ignore[attr-defined]

    def _prepared_checked(self, op: XferOp, local: PreparedDescList, li: Any, local_index: Any,
                          remote: PreparedDescList, ri: Any, remote_index: Any, idx32: int,
                          notify: bytes | None, timeout_s: float | None) -> Transfer:
        """Every check in Python, with the precise error; builds the pair's
        route for the next request. Caller holds the lock."""
        if local.peer is not None or remote.peer is None:
            raise DescriptorError("pass a list from prep_local() as local and one from prep_remote() as remote")
        self._require_open()  # type: ignore[attr-defined]
        if local.generation != self._local_gen or local.c_tables is None:
            raise DescriptorError(
                f"local prepared list was not made by prep_local() of agent {self.name!r} or predates "
                "a deregister(); prepare it again"
            )
        p = self._usable_peer(remote.peer)  # type: ignore[attr-defined]
        if remote.generation != p.generation or remote.c_tables is None:
            raise DescriptorError(
                f"remote prepared list was not made by prep_remote() of agent {self.name!r} or is for an "
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
        return self._prepared(op, local, li, remote, ri, notify, timeout_s)  # now one C call

    def _route(self, local: PreparedDescList, remote: PreparedDescList, p: Peer) -> Route:
        """The C route of (local, remote) to peer ``p``, current as of now.
        Caller holds the lock and has checked the lists and the peer."""
        ffi = self._ffi
        laddr, llen, lreg, nl = local.c_tables
        raddr, rlen, rreg, nr = remote.c_tables
        uniform = local.uniform_length
        peers = [p] + [lane._peers[p.name] for lane in self._lanes]
        states = ffi.new("rk_ep_state_t *[]", [q.ep_state for q in peers])
        stripe = self._stripe(p) if self._lanes else None  # type: ignore[attr-defined]
        c = ffi.new("rk_route_t *", {
            "laddr": laddr, "llen": llen, "lreg": lreg, "nl": nl,
            "raddr": raddr, "rlen": rlen, "rreg": rreg, "nr": nr,
            "uniform": uniform if uniform is not None and uniform == remote.uniform_length else 0,
            "memhs": self._memhs_c, "ctx": self._ctx, "ep": p.ep, "rkeys": p.rkeys,
            "stripe": stripe[0] if stripe else ffi.NULL, "nworkers": len(peers),
            "lane_min_bytes": self.config.lane_min_bytes,
            "ep_states": states, "epoch": self._epoch, "built_at": self._epoch[0],
        })
        return Route(c, self, local, p, (states, local.c_tables, remote.c_tables, stripe, self._memhs))

    def _set_notif(self, batch: Any, notify: bytes) -> tuple[Any, ...]:
        """Fill the notification into a batch record not yet posted; returns
        what must stay alive until UCX sent it."""
        if len(notify) > self.config.notif_max_bytes:
            raise ConfigError(f"notification of {len(notify)} bytes exceeds "
                              f"notif_max_bytes={self.config.notif_max_bytes}")
        data = self._ffi.from_buffer(bytes(notify)) if notify else self._ffi.NULL
        batch.has_notif = 1
        batch.am_id = NOTIF_AM_ID
        batch.notif_header = self._name_c
        batch.notif_header_len = self._name_len
        batch.notif_data = data
        batch.notif_data_len = len(notify)
        return (data,)
