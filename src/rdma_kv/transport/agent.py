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
- ``InFlight`` (inflight.py): the C context, the slab of batch records,
  the one submit path, and the only code that settles a ``Transfer``.
- ``Notifications`` (notifications.py): the notification ring.
- ``ProgressDriver`` (progress.py): the own pump and the service thread,
  or polling; what a waiting caller does.
- ``Lanes`` (lanes.py): extra workers, each with its pump and endpoints.
- ``RouteBuilder`` (route.py): the C routes requests are posted on.
- ``PreparedLists`` (prepared.py): prepared lists and requests by index.
- ``Posting`` (posting.py): explicit descriptor lists (``read``, ``write``,
  ``flush``).

What spans parts (settling, failing a peer on every worker, closing) is
``AgentCore``'s, in agentcore.py, which also says the threading and
lock order and how failure is bounded.

May import: numpy, rdma_kv.errors, the other rdma_kv.transport modules.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from rdma_kv.errors import ConfigError
from rdma_kv.transport import metadata as wire
from rdma_kv.transport import stall
from rdma_kv.transport.agentcore import collect, make_core
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.descriptors import ChainedRead, DescList, PreparedList, new_generation
from rdma_kv.transport.inflight import OP_GET, OP_PUT, AgentStats
from rdma_kv.transport.memory import MemoryRegion
from rdma_kv.transport.notifications import Notification
from rdma_kv.transport.transfer import Transfer, XferOp

__all__ = ["Agent", "AgentConfig", "AgentStats", "Notification"]

_READ, _WRITE = XferOp.READ, XferOp.WRITE  # module globals: an Enum class attribute is a slower lookup


class Agent:
    """One UCX worker (plus ``config.lanes - 1`` lanes), its registered memory
    and its peers. Use as a context manager or call ``close()``."""

    def __init__(self, name: str, config: AgentConfig | None = None) -> None:
        if not name or len(name.encode()) > wire.MAX_NAME_BYTES:
            raise ConfigError(f"agent name must be 1..{wire.MAX_NAME_BYTES} bytes, got {name!r}")
        self.name = name
        self.config = config or AgentConfig()
        self._core = core = make_core(name, self.config)
        # The per-request paths, one attribute away.
        self._prepared = core.prepared
        self._posting = core.posting
        self._finalizer = weakref.finalize(self, collect, core)

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
        core = self._core
        with core.lock:
            core.require_open()
            return core.memory.register(obj, memory_type)

    def deregister(self, region: MemoryRegion) -> None:
        """Drop one reference; unmap when the last one goes. Peers must
        re-import metadata afterwards."""
        core = self._core
        inflight, due = core.inflight, None
        try:
            with core.lock:
                core.require_open()
                inflight.drain()  # transfers UCX handed back since the last settle no longer count
                due = inflight.take_due()
                core.memory.deregister(region, inflight.live, inflight.zombies)
        finally:
            if due:
                inflight.run_callbacks(due)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return self._core.memory.regions

    # ------------------------------------------------------------------- peers

    def metadata(self) -> bytes:
        """Typed, versioned bytes a peer passes to ``add_peer``."""
        core = self._core
        with core.lock:
            core.require_open()
            return core.peers.export(core.memory.infos())

    def add_peer(self, blob: bytes, *, name: str | None = None, paired: bool = False,
                 ordinal: int | None = None) -> str:
        """Import a peer's metadata; returns its name: ``name``, else the one
        the metadata gives. Importing a name again replaces the peer (a
        restarted peer has a new worker address): its transfers in flight
        fail, prepared lists for it must be prepared again. A caller that
        knows whom it dialled passes ``name``, so that no peer's metadata
        can replace another's by naming it.

        ``paired``: one endpoint to the peer, on this agent's own worker
        only (none on the lanes, no express twin), so every transfer with
        it goes through that one. UCX pairs the n-th endpoint one worker
        makes to another with the n-th the other makes back (one
        connection); when two agents import each other this way, each
        import of one matched by one of the other, what the peer's
        ``remove_peer(fence=True)`` closes is the connection this agent's
        writes to it cross. A lane's endpoint (or
        an express twin) pairs with none of the peer's, and no fence of the
        peer's reaches what it carries (docs/reliability.md, "The fence
        and UCX's endpoint pairing"): import a peer that fences this agent's
        writes ``paired``.

        ``ordinal`` (with ``paired``): the number the peer's own endpoint to
        this agent has among those its worker made to this agent's
        (``Agent.ordinal`` on the peer's side). This import's endpoint is
        made the same number among this worker's to the peer's: the ones
        missing are made and closed first, so that a link of the peer's that
        this agent never imported (an introduction whose answer was lost;
        the peer cannot know whether it was imported) does not leave the
        counts, and the pairing, out of step for good. PeerError (nothing
        imported, nothing replaced) when this worker made that many already,
        when more than ``peers.MAX_PAD`` are missing (that many are made up:
        import again), and for any ``paired`` import when UCX pairs no more
        endpoints between the two workers (65,535) or a failed
        ``ucp_ep_create`` to the peer's worker left the count unknown."""
        if ordinal is not None and (not paired or ordinal < 1):
            raise ConfigError(f"add_peer: ordinal={ordinal!r} needs paired=True and a number from 1")
        core = self._core
        md = core.peers.decode(blob, name)
        with core.lock:
            core.require_open()
            if paired:
                with core.driver.bound():  # closing the endpoints it makes up progresses the worker
                    core.peers.pair(md, ordinal)
            generation = new_generation()
            old = core.peers.discard(md.name)
            if old is not None:
                core.fail_peer(old, "replaced by newly imported metadata")
                core.peers.retire(old)
            if paired:  # (an earlier import's lane endpoints go; an unpaired one's replace them)
                core.lanes.disconnect(md.name)
            core.peers.connect(md, generation, paired)
            try:
                if not paired:
                    core.lanes.connect(md, generation)
            except BaseException:
                self.remove_peer(md.name)
                raise
            core.reap_left_open()
            return md.name

    def remove_peer(self, name: str, *, fence: bool = False) -> bool:
        """Forget peer ``name`` and close its endpoints on every worker:
        gracefully (a flush, then a goodbye) when nothing is in flight with
        it, else forced (its transfers fail). Returns False when an endpoint
        had to be left open (a flush of it outstanding), else True.

        A graceful close is no fence against the peer's own writes into this
        agent's memory: over TCP, UCX keeps the connection the peer's
        endpoint writes through, and what it queued there goes on landing
        after the close returned (64 MiB abandoned by a writer whose
        deadline passed: 4.2 MiB had landed when the close returned, the
        rest landed after; ``tests/transport/test_fence.py``). ``fence``
        force-closes every endpoint, even with nothing in flight: no write
        of the peer's lands here after this returns True (verified over
        TCP; on RDMA a forced close destroys the RC queue pair the writes
        target, argued; docs/reliability.md, "A fence against a peer's
        writes")."""
        core = self._core
        with core.driver.bound(), core.lock:  # closing its endpoints progresses the workers
            core.require_open()
            peer = core.peers.pop(name)
            if peer.inflight or fence:
                core.fail_peer(peer, "fenced by remove_peer()" if fence else "removed by remove_peer()")
            core.peers.retire(peer)
            core.lanes.disconnect(name)
            core.reap_left_open()
            return not core.left_open(name)

    @property
    def peers(self) -> tuple[str, ...]:
        return self._core.peers.names

    def ordinal(self, name: str) -> int:
        """The number peer ``name``'s endpoint on this agent's own worker has
        among the endpoints that worker made to the peer's worker (1 for the
        first; UCX pairs it with the peer's endpoint of the same number to
        this worker). What the peer passes to ``add_peer(..., ordinal=)``
        when it imports this agent ``paired``."""
        core = self._core
        with core.lock:
            core.require_open()
            return core.peers.get(name).ordinal

    # ------------------------------------------------------------- descriptors

    def prep_local(self, descs: DescList) -> PreparedList:
        """Check local descriptors once; transfers then address them by index."""
        core = self._core
        with core.lock:
            core.require_open()
            return core.prepared.prep_local(descs)

    def prep_remote(self, peer: str, descs: DescList) -> PreparedList:
        core = self._core
        with core.lock:
            core.require_open()
            return core.prepared.prep_remote(peer, descs)

    # ---------------------------------------------------------------- transfers

    def read(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
             timeout_s: float | None = None) -> Transfer:
        """Read remote descriptors of ``peer`` into local ones (RMA get)."""
        return self._posting.transfer(_READ, OP_GET, peer, local, remote, notify, timeout_s)

    def write(self, peer: str, local: DescList, remote: DescList, *, notify: bytes | None = None,
              timeout_s: float | None = None) -> Transfer:
        """Write local descriptors to ``peer``'s remote ones (RMA put). Its
        completion means the local bytes were taken (the buffers may be
        reused), not that ``peer`` sees them: with ``notify``, ``peer`` hears
        of the write only once every byte is visible to it; otherwise
        ``flush(peer)`` completes once every earlier write is (UCX's own
        put semantics: over TCP the peer's worker applies the bytes)."""
        return self._posting.transfer(_WRITE, OP_PUT, peer, local, remote, notify, timeout_s)

    def read_prepared(self, local: PreparedList, local_index: Any, remote: PreparedList,
                      remote_index: Any, *, notify: bytes | None = None,
                      timeout_s: float | None = None, then: ChainedRead | None = None) -> Transfer:
        """Read ``remote[remote_index]`` into ``local[local_index]``; with
        ``then``, a second read of the same peer posted once this one
        landed (``ChainedRead``), which the transfer includes."""
        return self._prepared.transfer(_READ, OP_GET, local, local_index, remote, remote_index, notify, timeout_s,
                                       then)

    def write_prepared(self, local: PreparedList, local_index: Any, remote: PreparedList,
                       remote_index: Any, *, notify: bytes | None = None,
                       timeout_s: float | None = None) -> Transfer:
        """Write ``local[local_index]`` into ``remote[remote_index]``; completion as ``write``'s."""
        return self._prepared.transfer(_WRITE, OP_PUT, local, local_index, remote, remote_index, notify,
                                       timeout_s)

    def flush(self, peer: str, *, notify: bytes | None = None, timeout_s: float | None = None) -> Transfer:
        """A transfer that completes once every earlier operation to ``peer``
        has completed remotely; with ``notify``, ``peer`` receives that
        notification only then (every earlier write visible to it)."""
        return self._posting.flush(peer, timeout_s, notify)

    # ------------------------------------------------------ progress, notifications

    @property
    def manual_progress(self) -> bool:
        return self._core.driver.manual_progress

    @property
    def inflight(self) -> int:
        """Transfers in flight (a transfer striped over lanes counts once)."""
        return self._core.inflight.live

    @property
    def stats(self) -> AgentStats:
        """What this agent has done so far: a frozen snapshot."""
        core = self._core
        with core.lock:
            return core.inflight.stats()

    def progress(self) -> int:
        """Drive the worker once (polling mode). Returns UCX events handled."""
        core = self._core
        core.require_open()
        return core.driver.progress()

    def settle(self) -> None:
        """Settle now, on this thread, the transfers that have completed, and
        run their callbacks here (``progress="thread"``: without waiting for
        the service thread's wake-up; polling: one :meth:`progress` round).
        Cheap when nothing completed; nothing once closed."""
        core = self._core
        if not core.inflight.closed:
            core.driver.settle()

    def progress_report(self) -> str:
        """What each of this agent's progress threads (pumps) is doing, for
        a log line: per worker, held, in progress, asleep or spinning, when
        it last progressed its worker, and its thread as the kernel sees it
        (``stall.pump``). A polling agent has none."""
        core = self._core
        with core.lock:
            if core.inflight.closed:
                return "closed"
            pumps = [core.driver.pump] + [lane.pump for lane in core.lanes]
            now = time.monotonic_ns()
            return "; ".join(stall.pump(stall.worker_name(w), p.handle if p is not None else None, now)
                             for w, p in enumerate(pumps))

    def get_notifications(self) -> list[Notification]:
        """Notifications received since the last call, in arrival order
        (received ones not yet settled are settled on this thread first)."""
        core = self._core
        core.require_open()
        core.driver.settle()
        with core.lock:
            return core.notifications.take()

    # ------------------------------------------------------------------ closing

    @property
    def closed(self) -> bool:
        return self._core.inflight.closed

    def wedged(self) -> bool:
        """Closed leaving its memory registered and its workers in place: a
        thread was stuck in UCX past the close's bounds (said in the log);
        a transfer could still write into the memory."""
        return self._core.wedged

    def close(self) -> None:
        """Let what is in flight finish (at most ``close_drain_s``), fail the
        rest, then tear down: lanes, remote keys and endpoints, memory,
        worker, context. Idempotent."""
        self._finalizer.detach()
        self._core.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        core = self._core
        return (f"Agent({self.name!r}, regions={len(core.memory.regions)}, peers={len(core.peers)}, "
                f"lanes={len(core.lanes) + 1}, inflight={self.inflight}, closed={self.closed})")
