"""Lanes: extra UCX workers that carry parts of one large transfer at once.

With ``AgentConfig(lanes=N)`` the agent owns N-1 lanes besides its own
worker. A lane is a second ``Agent`` on the *same* UCP context (created
with ``mt_workers_shared``): the memory handles and the remote keys' packed
bytes are shared, but it has its own worker (``UCS_THREAD_MODE_MULTI``) and
its own endpoint to every peer (remote keys unpacked on it). Its worker is
progressed by a *pump*, a C thread of the shim that never takes the
interpreter lock.

A transfer of at least ``2 * lane_min_bytes`` (prepared, or explicit: its
merged runs then serve as the tables) is *striped*: one C call (``rk_post_striped``) cuts the byte stream of its
index pairs into parts of about equal bytes (at 4 KiB
boundaries, so one 256 MiB descriptor is cut too) and posts each part on
its worker's endpoint -- the lanes' parts first, each lane signalled as
soon as its part is posted, the agent's own part last. It is still *one*
batch and one ``Transfer``: its operation count is atomic, the pumps count
down the lanes' operations on their threads, and whichever thread finishes
the last one publishes the batch on the agent's completion ring and (a
pump) signals the agent's worker. So the transfer resolves only once every
operation on every worker has, and costs the caller one C call.

A notification is sent then, by that same thread, on the agent's own
endpoint (so the agent's worker is ``UCS_THREAD_MODE_MULTI`` whenever it
has lanes): a READ's once every part completed locally, a WRITE's once,
in addition, every endpoint that carried a part was flushed
(``ucp_ep_flush_nbx``, counted as an operation of the batch) -- each
worker's endpoint completes only its own operations remotely, so the peer
never hears of data it cannot see yet.

Why: on a node (UCX ``cma``) a one-sided get is a ``process_vm_readv``
done by the reading process's progress, so one worker copies on one core;
on a fabric each worker has its own queue pairs.

Rules:

- A lane endpoint that failed fails the peer for the whole agent at the next
  post (``_check_lanes``); failing a peer (error, deadline, removal,
  replacement) force-closes its endpoints on every lane too, which cancels
  the lanes' operations of its transfers.
- Lock order is agent -> lane, never the other way.
- Peers are installed on, and removed from, every lane with the agent.
  ``close`` lets what is in flight finish (every worker progresses it), then
  fails the rest, then closes the lanes (pumps, endpoints, workers) before
  the agent unmaps the memory and destroys the context.

May import: rdma_kv.errors and the other rdma_kv.transport modules, never agent.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdma_kv.errors import PeerError, TransferError
from rdma_kv.transport._lib import status_name

if TYPE_CHECKING:
    from rdma_kv.transport.agent import Agent
    from rdma_kv.transport.peer import Peer

MAX_LANES = 16


class Lanes:
    """The lane half of ``Agent`` (which sets every attribute used here)."""

    _lock: threading.RLock
    _lanes: list[Agent]
    _peers: dict[str, Peer]
    name: str

    def _check_lanes(self, p: Peer) -> None:
        """Raise PeerError (failing the peer everywhere) if any lane's endpoint
        to ``p`` failed. Caller holds the agent's lock."""
        for i, lane in enumerate(self._lanes, 1):
            lp = lane._peers.get(p.name)
            if lp is not None and lp.healthy:
                continue
            why = "missing" if lp is None else (lp.failure or f"endpoint error {status_name(lp.ep_state.status)}")
            reason = f"lane {i}'s endpoint failed ({why})"
            self._fail_peer(p, reason)  # type: ignore[attr-defined]
            raise PeerError(f"peer {p.name!r} failed ({reason}); re-import its metadata with add_peer() "
                            "once it is back")

    def _fail_lane_eps(self, name: str, reason: str) -> None:
        """Force-close every lane's endpoint to ``name`` (part of failing the
        peer: cancels the lanes' operations of its transfers)."""
        for lane in self._lanes:
            with lane._lock:
                lp = lane._peers.get(name)
                if lp is not None:
                    lane._fail_peer(lp, reason)

    def _install_on_lanes(self, md: Any, generation: int) -> None:
        for lane in self._lanes:
            with lane._lock:
                lane._install_peer(md, generation)

    def _remove_from_lanes(self, name: str) -> None:
        for lane in self._lanes:
            with lane._lock:
                if name in lane._peers:
                    lane.remove_peer(name)

    def _close_lanes(self) -> None:
        for lane in self._lanes:
            lane.close()

    def _stripe(self, p: Peer) -> Any:
        """The ``rk_stripe_t`` of peer ``p`` (its endpoint and remote keys on
        the agent's worker, then on each lane's), made at the first striped
        transfer and kept with the peer: re-importing a peer makes a new
        one. Caller holds the agent's lock and has checked the lanes."""
        if p.stripe is None:
            ffi = self._ffi  # type: ignore[attr-defined]
            workers = [self, *self._lanes]
            peers = [p] + [lane._peers[p.name] for lane in self._lanes]
            eps = ffi.new("ucp_ep_h[]", [q.ep for q in peers])
            rkeys = ffi.new("ucp_rkey_h *[]", [q.rkeys for q in peers])
            handles = ffi.new("ucp_worker_h[]", [w._worker.handle for w in workers])  # type: ignore[attr-defined]
            pumps = ffi.new("rk_pump_t *[]", [w._pump or ffi.NULL for w in workers])  # type: ignore[attr-defined]
            stripe = ffi.new("rk_stripe_t *", {"eps": eps, "rkeys": rkeys, "workers": handles, "pumps": pumps})
            ops = ffi.new("uint64_t[]", len(workers))
            p.stripe = (stripe, ops, eps, rkeys, handles, pumps, peers)  # the last five keep the arrays alive
        return p.stripe


def start_pump(agent: Agent, owner: Agent) -> Any:
    """Start the C thread that progresses ``agent``'s worker (a lane's, or
    the owner's own in progress="thread" mode). It watches the owner's
    context and wakes whoever settles it: the owner's service thread through
    its eventfd, or a polling owner's caller through the owner's worker."""
    lib, ffi = agent._lib, agent._ffi
    wake_worker = owner._worker.handle if owner._wake_fd < 0 else ffi.NULL
    cuda = owner._cuda  # made current in the pump's thread before it progresses
    set_ctx = ffi.cast("rk_cu_set_ctx_t", cuda.set_current) if cuda else ffi.NULL
    cu_status = ffi.new("int *")
    pump = lib.rk_pump_start(agent._worker.handle, agent._worker.efd, owner._ctx, wake_worker, owner._wake_fd,
                             int(agent.config.spin_s * 1e9), set_ctx,
                             ffi.cast("void *", cuda.handle) if cuda else ffi.NULL, cu_status)
    if pump == ffi.NULL:
        if cu_status[0]:
            raise TransferError(f"the progress thread of {agent.name!r} cannot make the creator's CUDA context "
                                f"{cuda.handle:#x} current: cuCtxSetCurrent returned CUresult {cu_status[0]}")
        raise TransferError(f"cannot start the progress thread of {agent.name!r} (pthread_create failed)")
    return pump


def lane_factory(make: Callable[[int], Agent], count: int) -> list[Agent]:
    """Create ``count`` lanes with ``make(i)`` (i from 1); close those made if one fails."""
    lanes: list[Agent] = []
    try:
        for i in range(1, count + 1):
            lanes.append(make(i))
    except BaseException:
        for lane in lanes:
            lane.close()
        raise
    return lanes
