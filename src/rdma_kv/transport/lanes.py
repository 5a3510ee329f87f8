"""Lanes: extra UCX workers that carry parts of one large transfer at once.

With ``AgentConfig(lanes=N)`` the agent owns N-1 lanes besides its own
worker. A lane is a second ``Agent`` on the *same* UCP context (created
with ``mt_workers_shared``): the memory handles and the remote keys' packed
bytes are shared, but it has its own worker (``UCS_THREAD_MODE_MULTI``),
its own endpoint to every peer (remote keys unpacked on it), its own lock
and completion ring. Its worker is progressed by a *pump*, a C thread of
the shim that never takes the interpreter lock; the owner settles the
lane's completions, failures and deadlines in its own progress
(``_service_lanes``), woken by the pump's signal on its worker. A prepared transfer of at least ``2 * lane_min_bytes``
without a notification is cut into contiguous slices of its index pairs,
one per lane plus the agent's own worker, each posted by one C call; the
caller gets one ``SplitTransfer``.

Why: on a node (UCX ``cma``) a one-sided get is a ``process_vm_readv``
done by the reading process's progress, so one worker copies on one core;
on a fabric each worker has its own queue pairs. Measured here, two lanes
move 16,384 random 32 KiB blocks ~1.5x faster than one (docs/benchmarks.md).

Rules the split keeps:

- A ``SplitTransfer`` resolves only when every part has resolved, failed or
  not: until then a part may still write into the caller's memory, and a
  caller that frees blocks on completion must not free them early. Its
  error is the first part's error.
- Each part has the transfer's deadline and fails on its own lane's
  endpoint like any transfer. A lane endpoint that failed fails the peer
  for the whole agent at the next post (``_check_lanes``).
- Lock order is agent -> lane, never the other way: the owner collects a
  lane's part callbacks under both and runs them holding neither.
- Peers are installed on, and removed from, every lane with the agent;
  ``close`` closes the lanes (their workers) before the agent unmaps the
  memory and destroys the context.

May import: rdma_kv.errors and the other rdma_kv.transport modules, never agent.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from rdma_kv.errors import PeerError, TransferError
from rdma_kv.transport._lib import status_name
from rdma_kv.transport.transfer import Transfer, XferOp, XferState

if TYPE_CHECKING:
    from rdma_kv.transport.agent import Agent
    from rdma_kv.transport.descriptors import PreparedDescList
    from rdma_kv.transport.peer import Peer

MAX_LANES = 16


class SplitTransfer(Transfer):
    """One transfer carried by several workers: resolves when all parts have."""

    def __init__(self, agent: Agent, xfer_id: int, op: XferOp, peer: str, nbytes: int, num_descs: int,
                 deadline: float, parts: int) -> None:
        super().__init__(agent, xfer_id, op, peer, None, (), nbytes, num_descs, deadline)
        self.parts: list[Transfer] = []
        self._own: Transfer | None = None  # the part on the agent's own worker
        self._remaining = parts  # parts not resolved yet (or never posted)
        self._first_error: TransferError | None = None

    def _part_done(self, part: Transfer) -> None:
        """Every part's first callback, registered before it is posted (so no
        lane lock is taken to attach it while that lane copies)."""
        agent = self._agent
        with agent._lock:  # a lane's part waits here until posting has finished
            if part.error is not None and self._first_error is None:
                self._first_error = part.error
            self._remaining -= 1
            callbacks = self._settle()
        agent._run_callbacks(callbacks)

    def _posted(self, parts: list[Transfer], own: Transfer | None, unposted: int) -> list[Any]:
        """Posting finished (agent's lock held): ``unposted`` parts never will."""
        self.parts = parts
        self._own = own
        self.ops_posted = sum(p.ops_posted for p in parts)
        self._remaining -= unposted
        return self._settle()

    def _settle(self) -> list[Any]:
        if self._remaining or self.state is not XferState.IN_PROGRESS:
            return []
        if self._first_error is not None:
            self._agent.stats["failed"] += 1
        return [(cb, self) for cb in self._resolve(self._first_error)]

    def _drives_progress(self) -> bool:
        # Lanes' pumps copy; in polling mode the caller progresses the own
        # part and settles the lanes' (the agent's progress does both).
        return self._agent.manual_progress


class Lanes:
    """The lane half of ``Agent`` (which sets every attribute used here)."""

    _lock: threading.RLock
    _lanes: list[Agent]
    _peers: dict[str, Peer]
    _ids: Any
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
            self._fail_everywhere(p, reason)
            raise PeerError(f"peer {p.name!r} failed ({reason}); re-import its metadata with add_peer() "
                            "once it is back")

    def _fail_everywhere(self, p: Peer, reason: str) -> None:
        self._fail_peer(p, reason)  # type: ignore[attr-defined]
        for lane in self._lanes:
            with lane._lock:
                lp = lane._peers.get(p.name)
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

    def _lanes_inflight(self) -> int:
        return sum(len(lane._inflight) for lane in self._lanes)

    def _service_lanes(self) -> int:
        """Settle what the lanes' pumps finished (caller holds the agent's
        lock): their completions, failed endpoints and deadlines. Their
        callbacks (a part's first is ``SplitTransfer._part_done``) join the
        agent's, to run outside the lock. Returns completions drained."""
        drained = 0
        for lane in self._lanes:
            with lane._lock:
                drained += lane._service_locked()
                self._callbacks.extend(lane._take_callbacks())  # type: ignore[attr-defined]
        return drained

    def _close_lanes(self) -> None:
        for lane in self._lanes:
            lane.close()

    def _split_parts(self, nbytes: int) -> int:
        """How many workers carry a transfer of ``nbytes`` (1: no split)."""
        if not self._lanes:
            return 1
        return max(1, min(len(self._lanes) + 1, nbytes // self.config.lane_min_bytes))  # type: ignore[attr-defined]

    def _post_split(self, parts_n: int, op: XferOp, p: Peer, local: PreparedDescList, li: np.ndarray, li_c: Any,
                    remote: PreparedDescList, ri: np.ndarray, ri_c: Any, n: int, nbytes: int,
                    uniform: int | None, timeout_s: float | None) -> Transfer:
        """Post ``parts_n`` parts on as many workers (the lanes first, so they
        copy while this thread posts its own part). Many pairs: contiguous
        slices of the index pairs, each one C gather-merge-post. Few pairs
        (fewer than two per part, e.g. one 256 MiB descriptor): equal byte
        ranges cut at 4 KiB boundaries. Caller holds the agent's lock and has
        checked every pair."""
        agent: Any = self
        ffi, lib = agent._ffi, agent._lib
        posts: list[Callable[[Agent, Peer, SplitTransfer], Transfer]] = []
        if n >= 2 * parts_n:
            bounds = [n * k // parts_n for k in range(parts_n + 1)]
            lens = (ffi.NULL, ffi.NULL) if uniform is not None else (local.c_tables[1], remote.c_tables[1])
            for k in range(parts_n):
                lo, cnt = bounds[k], bounds[k + 1] - bounds[k]
                lic, ric = li_c + lo, ri_c + lo
                if uniform is not None:
                    part_bytes = uniform * cnt
                else:
                    lib.rk_check_indexed(cnt, lic, ric, len(local), len(remote), *lens, agent._nbytes_out)
                    part_bytes = int(agent._nbytes_out[0])
                posts.append(lambda w, wp, split, lic=lic, ric=ric, cnt=cnt, nb=part_bytes: w._post_indexed(
                    op, wp, local, lic, remote, ric, cnt, nb, None, timeout_s, part_of=split))
        else:
            pieces = byte_ranges(local.descs.addrs[li], remote.descs.addrs[ri], local.descs.lengths[li],
                                 local.regions[li], remote.regions[ri], parts_n)
            for piece in pieces:
                posts.append(lambda w, wp, split, piece=piece: w._post(
                    op, wp, *piece, None, timeout_s, part_of=split))
        return self._post_parts(op, p, nbytes, n, timeout_s, posts)

    def _post_parts(self, op: XferOp, p: Peer, nbytes: int, n: int, timeout_s: float | None,
                    posts: list[Callable[[Agent, Peer, SplitTransfer], Transfer]]) -> Transfer:
        agent: Any = self
        cfg = agent.config
        workers: list[Agent] = self._lanes[:len(posts) - 1] + [agent]
        for w in workers:  # before anything is posted: no part may be refused for room
            w._require_room()
        timeout = cfg.transfer_timeout_s if timeout_s is None else timeout_s
        split = SplitTransfer(agent, next(self._ids), op, p.name, nbytes, n, time.monotonic() + timeout, len(posts))
        parts: list[Transfer] = []
        own: Transfer | None = None
        t0 = time.perf_counter()
        try:
            for w, post in zip(workers, posts):
                if w is agent:
                    own = post(agent, p, split)
                    parts.append(own)
                    continue
                with w._lock:  # held by the lane's progress only between progress rounds
                    w._require_open()
                    parts.append(post(w, w._peers[p.name], split))
        except Exception as exc:
            if not parts:
                raise
            # Parts already posted may still write: the handle stays, resolving
            # (failed) once they have.
            split._first_error = TransferError(
                f"{op.value} transfer {split.id} with peer {p.name!r}: posting part {len(parts) + 1} of "
                f"{len(posts)} failed ({type(exc).__name__}: {exc}); the transfer fails once the "
                f"{len(parts)} parts already posted have resolved")
        split.post_s = time.perf_counter() - t0
        callbacks = split._posted(parts, own, len(posts) - len(parts))
        s = agent.stats
        s["transfers"] += 1
        s["descs"] += n
        s["bytes"] += nbytes
        s["ops_posted"] += split.ops_posted
        agent._run_callbacks(callbacks)  # none can be registered yet; kept for symmetry
        return split


PAGE = 4096


def byte_ranges(laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray, lreg: np.ndarray, rreg: np.ndarray,
                parts: int) -> list[tuple[np.ndarray, ...]]:
    """Cut the byte stream of these descriptors into ``parts`` ranges of about
    equal size (cuts on 4 KiB boundaries of the stream; fewer ranges when it
    is too short), each as (laddr, raddr, lengths, lreg, rreg) arrays."""
    lengths = lengths.astype(np.uint64)
    ends = np.cumsum(lengths, dtype=np.uint64)
    starts = ends - lengths
    total = int(ends[-1])
    cuts = sorted({0, total} | {total * k // parts // PAGE * PAGE for k in range(1, parts)})
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        i0 = int(np.searchsorted(ends, a, side="right"))
        i1 = int(np.searchsorted(starts, b, side="left"))
        s, e = starts[i0:i1], ends[i0:i1]
        lo = np.maximum(s, np.uint64(a)) - s
        hi = np.minimum(e, np.uint64(b)) - s
        out.append((laddr[i0:i1] + lo, raddr[i0:i1] + lo, hi - lo, lreg[i0:i1], rreg[i0:i1]))
    return out


def start_pump(lane: Agent, owner: Agent) -> Any:
    """Start the C thread that progresses ``lane``'s worker; it signals the
    owner's worker whenever batches complete, so a thread sleeping there
    settles them."""
    pump = lane._lib.rk_pump_start(lane._worker.handle, lane._worker.efd, lane._ctx, owner._worker.handle,
                                   int(lane.config.spin_s * 1e9))
    if pump == lane._ffi.NULL:
        raise TransferError(f"cannot start the progress thread of lane {lane.name!r} (pthread_create failed)")
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
