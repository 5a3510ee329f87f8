"""Lanes: extra UCX workers that carry parts of one large transfer at once.

With ``AgentConfig(lanes=N)`` the agent owns N-1 lanes besides its own
worker. A ``Lane`` is a plain worker on the agent's *same* UCP context (created
with ``mt_workers_shared``): the memory handles and the remote keys' packed
bytes are shared, but it has its own worker (``UCS_THREAD_MODE_MULTI``) and
its own endpoint to every peer (remote keys unpacked on it). Its worker is
progressed by a *pump* (pump.py), a C thread of the shim that never takes
the interpreter lock. A lane posts no batch of its own and has no
completion or notification ring: its pump completes parts of the agent's
batches, and the agent settles them.

A transfer of at least ``2 * lane_min_bytes`` (prepared, or explicit) is
*striped*: the one C call every request is (``rk_submit``) cuts the byte stream
of its index pairs into parts of about equal bytes (at 4 KiB boundaries,
so one 256 MiB descriptor is cut too) and posts each part on
its worker's endpoint -- the lanes' parts first (each lane's pump kicked
awake before, held off its worker while its part is posted, released
right after), the agent's own part last. A smaller transfer goes *whole*
to one worker (the route's ``spread``: by bytes queued when polling, in
turn with pumps): concurrent requests then copy on every worker at once. Either way it is *one*
batch and one ``Transfer``: its operation count is atomic, the pumps count
down the lanes' operations on their threads, and whichever thread finishes
the last one publishes the batch on the agent's completion ring and (a
pump) signals the agent's worker. So the transfer resolves only once every
operation on every worker has, and costs the caller one C call.

A polling agent (``progress="poll"``) whose own worker is idle while a
transfer is in flight progresses each lane's worker itself whenever that
lane's pump is not progressing it at that moment (``rk_pump_help``; the
progress driver calls it), and so does a caller blocked in ``wait()`` with
``progress="thread"`` for its first ``spin_s`` (``rk_await``): a pump
asleep, or woken but not yet given a CPU, then costs the caller nothing,
while a running pump is left alone.

A notification is sent, by whichever thread completes the last operation, on the agent's own
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
  post (``Lanes.problem``, checked by the agent); failing a peer (error,
  deadline, removal, replacement) force-closes its endpoints on every lane
  too (``Lanes.fail``), which cancels the lanes' operations of its transfers.
- Every change to a lane's endpoints (connect, fail, disconnect) first
  moves the agent's epoch (``stale``): routes name those endpoints, and a
  route to a force-closed one must not be used.
- Lanes have no lock: the agent calls them under its own (agent.py has the
  lock order). Their pumps take none of Python's locks.
- Peers are connected on, and disconnected from, every lane with the agent,
  except one imported ``paired`` (``Agent.add_peer``): on the agent's own
  worker only, so that its one endpoint, which UCX pairs with the
  peer's matching endpoint to this agent, carries all of it (a peer's
  fence needs that).
  The agent's ``close`` lets what is in flight finish (every worker
  progresses it), then fails the rest, then closes the lanes (pumps,
  endpoints, workers) before it unmaps the memory and destroys the context.

May import: rdma_kv.errors and the transport's lower modules (_lib, cuda,
metadata, peer, pump, ucx); never agent.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from rdma_kv.transport._lib import load, status_name
from rdma_kv.transport.cuda import CudaContext
from rdma_kv.transport.metadata import AgentMetadata
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.pump import Pump
from rdma_kv.transport.ucx import Context, Worker

MAX_LANES = 16


class Lane:
    """One extra worker, its pump and its endpoint to every peer (``peers``,
    by name). ``watch`` is the agent's ``rk_ctx_t *``: the pump wakes the
    agent when it changes (``wake_worker``, a polling agent's own worker,
    or ``wake_fd``, its service thread's eventfd); the lane's endpoints
    count their errors there. ``stale`` is called before an endpoint is
    added, failed or removed: the agent's routes point at them."""

    def __init__(self, context: Context, name: str, watch: Any, wake_worker: Worker | None, wake_fd: int,
                 spin_s: float, cuda: CudaContext | None, stale: Callable[[], None], express: bool = False) -> None:
        self.name = name
        self._express = express  # each endpoint to a peer has an express twin (peer.py)
        self._stale = stale
        self._watch = watch
        self.peers: dict[str, Peer] = {}
        self.wedged = False  # its pump's thread did not stop (stop_pump)
        self.worker = Worker(context, multi_thread=True)  # the pump progresses it while the agent posts
        try:
            # Steered: a lane adds bandwidth only on another core than the poster's.
            self.pump: Pump | None = Pump(self.worker, watch, wake_worker=wake_worker, wake_fd=wake_fd,
                                          spin_s=spin_s, cuda=cuda, name=name, steer=True)
        except BaseException:
            self.worker.close()
            raise

    def connect(self, md: AgentMetadata, generation: int) -> None:
        """An endpoint to ``md``'s peer, replacing (force-closing) an earlier one."""
        self._stale()
        old = self.peers.pop(md.name, None)
        if old is not None:
            self._force_close(old, "replaced by newly imported metadata")
        self.peers[md.name] = Peer(self.worker, md, generation, self._watch, self._express)

    def disconnect(self, name: str) -> None:
        self._stale()
        peer = self.peers.pop(name, None)
        if peer is not None:
            peer.close(force=not peer.healthy)

    def fail(self, name: str, reason: str) -> None:
        """Force-close the endpoint to ``name``, cancelling its operations
        (on a wedged lane: mark it failed only)."""
        self._stale()
        peer = self.peers.get(name)
        if peer is not None:
            if self.wedged:
                peer.failure = peer.failure or reason
            else:
                self._force_close(peer, reason)

    @staticmethod
    def _force_close(peer: Peer, reason: str) -> None:
        if peer.failure is None:
            peer.failure = reason
        peer.close(force=True)  # the endpoint first (cancelling its operations), then the remote keys

    def stop_pump(self, keep: bool = False) -> bool:
        """Stop the pump (idempotent); False when its thread is stuck in the
        worker, or ``keep`` (another thread of the agent may still reach the
        pump and its worker): then the lane is ``wedged``, and nothing frees
        the pump or closes the worker or its endpoints."""
        if self.pump is not None:
            if not self.pump.stop(free=not keep) or keep:
                self.wedged = True
            self.pump = None
        return not self.wedged

    def close(self) -> None:
        """Stop the pump, close the endpoints, destroy the worker
        (idempotent). A wedged lane's are left as they are: the stuck thread
        may hold the worker's lock, and would use what is freed."""
        if self.stop_pump():  # from here on, closing an endpoint progresses from Python
            for peer in self.peers.values():
                peer.close(force=not peer.healthy)
            self.worker.close()
        else:
            self.worker.abandon()
        self.peers.clear()


class Paths:
    """One peer on every worker of an agent (0: its own, 1..: the lanes), as
    the C arrays of a route (``rk_route_t``): ``eps``, ``rkeys``, the
    express endpoints ``xeps`` and ``xrkeys`` (NULL: none), ``workers``,
    ``pumps`` (NULL: none) and ``ep_states``."""

    def __init__(self, peers: list[Peer], workers: list[Worker], pumps: list[Pump | None]) -> None:
        ffi = load()[0]
        self.count = len(peers)
        self.eps = ffi.new("ucp_ep_h[]", [q.ep for q in peers])
        self.rkeys = ffi.new("ucp_rkey_h *[]", [q.rkeys for q in peers])
        express = all(q.xep != ffi.NULL for q in peers)
        self.xeps = ffi.new("ucp_ep_h[]", [q.xep for q in peers]) if express else ffi.NULL
        self.xrkeys = ffi.new("ucp_rkey_h *[]", [q.xrkeys for q in peers]) if express else ffi.NULL
        self.workers = ffi.new("ucp_worker_h[]", [w.handle for w in workers])
        self.pumps = ffi.new("rk_pump_t *[]", [ffi.NULL if q is None else q.handle for q in pumps])
        self.ep_states = ffi.new("rk_ep_state_t *[]", [q.ep_state for q in peers])
        self._peers = peers  # their endpoints, keys and states outlive the arrays


class Lanes:
    """The agent's lanes (``count`` of them; none for ``AgentConfig(lanes=1)``).
    ``owner`` names the agent; the other arguments go to every ``Lane``."""

    def __init__(self, context: Context, count: int, owner: str, watch: Any, wake_worker: Worker | None,
                 wake_fd: int, spin_s: float, cuda: CudaContext | None, stale: Callable[[], None],
                 express: bool = False) -> None:
        self._lanes: list[Lane] = []
        try:
            for i in range(1, count + 1):
                self._lanes.append(Lane(context, f"{owner}.lane{i}", watch, wake_worker, wake_fd, spin_s, cuda,
                                        stale, express))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._lanes)

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._lanes)

    def __getitem__(self, i: int) -> Lane:
        return self._lanes[i]

    def connect(self, md: AgentMetadata, generation: int) -> None:
        for lane in self._lanes:
            lane.connect(md, generation)

    def disconnect(self, name: str) -> None:
        for lane in self._lanes:
            lane.disconnect(name)

    def fail(self, name: str, reason: str) -> None:
        """Force-close every lane's endpoint to ``name`` (part of failing the
        peer: cancels the lanes' operations of its transfers)."""
        for lane in self._lanes:
            lane.fail(name, reason)

    def problem(self, p: Peer) -> str | None:
        """Why a lane's endpoint to ``p`` is unusable, or None if every lane's
        is healthy (or it has none: a paired peer)."""
        if p.paired:
            return None
        name = p.name
        for i, lane in enumerate(self._lanes, 1):
            lp = lane.peers.get(name)
            if lp is not None and lp.healthy:
                continue
            why = "missing" if lp is None else (lp.failure or f"endpoint error {status_name(lp.ep_state.status)}")
            return f"lane {i}'s endpoint failed ({why})"
        return None

    def endpoints(self, p: Peer) -> list[Peer]:
        """``p`` then its endpoint on every lane: worker order of a stripe
        (``p`` alone when paired)."""
        return [p] if p.paired else [p] + [lane.peers[p.name] for lane in self._lanes]

    @property
    def pumps(self) -> tuple[Any, ...]:
        """Every running lane pump's handle (``rk_pump_t *``): what a poller
        or a blocked waiter may help."""
        return tuple(lane.pump.handle for lane in self._lanes if lane.pump is not None)

    def paths(self, p: Peer, own: Worker, own_pump: Pump | None) -> Paths:
        """``p``'s endpoint, remote keys, worker, pump and endpoint state on the
        agent's worker ``own``, then on each lane's, as C arrays: made at the
        first route to ``p`` and kept with the peer (re-importing a peer
        makes a new one). The caller has checked ``problem(p)``."""
        if p.paths is None:
            lanes = [] if p.paired else self._lanes
            p.paths = Paths(self.endpoints(p), [own] + [lane.worker for lane in lanes],
                            [own_pump] + [lane.pump for lane in lanes])
        paths: Paths = p.paths
        return paths

    def stop_pumps(self, keep: bool = False) -> int:
        """Stop every lane's pump; how many are wedged (their thread stuck,
        or all of them with ``keep``: see :meth:`Lane.stop_pump`)."""
        return sum(not lane.stop_pump(keep) for lane in self._lanes)

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()
