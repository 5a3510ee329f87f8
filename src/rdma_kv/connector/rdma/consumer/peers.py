"""The consumer's peer directory: the producer ranks it reads from, and every slot table.

Owns, for one consumer rank:

- :class:`LocalKV`: this rank's registered KV cache as a reader sees it,
  one frozen record the worker builds once its KV caches are registered
  (transport, geometry, whole-block slot table and its prepared list,
  compatibility record, rank share).
- the **rank plan** for a producer engine (:meth:`PeerDirectory.plan`:
  ``topology.plan_ranks`` from this rank's share, the producer's TP size
  and the model's KV heads).
- one :class:`PeerState` per producer rank, CONNECTING -> READY (HANDSHAKE
  over the side channel: the reply's engine, compatibility record and rank
  share checked against the plan, its agent metadata imported into the
  transport) or FAILED. A FAILED peer is forgotten :data:`PEER_RETRY_S`
  after its failure (:meth:`PeerState.forgotten`, the one retry rule): the
  next load handshakes again; a load that finds it FAILED before then fails
  at once. A peer whose HANDSHAKE was not answered in time
  (``PeerTimeout``) by a producer that answered this rank's client before
  (``PeerTimeout.answered_before``, remembered by the client pool past an
  idle client's close: stalled, or starved of CPU a while, as
  a process on a loaded host is for seconds) is STALLED instead: its
  loads, and the new loads that find it, wait on it as on a CONNECTING
  peer, each saying why (``LoadState.waiting_on``), and a step dials it
  again once ``PEER_RETRY_S`` passed (:meth:`PeerDirectory.redial`: a
  new CONNECTING peer with the loads still waiting; none: it is
  forgotten), until it answers or their ``load_timeout_s`` fails them.
  Before, such a peer was FAILED and every load waiting on it recomputed.
  An address that never answered this rank (a port a request named that
  accepts and never answers, a host that is not there, a producer met
  first while it stalls) still fails its loads at once: a decode's loads
  must not wait ``load_timeout_s`` on an address a client chose. A READY
  peer whose producer re-registered its KV cache since (sleep mode) is
  dropped for a new one once a handshake says so: a load's params naming a
  newer registration are a client's word, checked first
  (:meth:`PeerDirectory._check`; the peer reads on meanwhile). A READY peer that no
  load has used for the client pool's ``idle_s`` and that no load in the
  book reads from is forgotten too, its transport peer removed
  (:meth:`PeerDirectory.prune`): a producer that left after its last load
  (scaled down, restarted at another address) kept its endpoint, keys and
  slot tables for the consumer's life.
- every **slot table** a read uses, prepared with the transport once: this
  rank's own per head slice, and each peer's per head slice (whole blocks
  when both sides hold the same heads).

Loads wait on a CONNECTING or STALLED peer (``PeerState.waiting``); when
its handshake ends (READY or FAILED; not STALLED), the directory hands them
to ``on_handshake`` without its lock.
Handshakes run on the RPC threads. Lock discipline: peer state is guarded
by the consumer's lock (handed in); tables are prepared under a lock of
their own, never the consumer's, which the transport's completion
callbacks take (holding it here deadlocked a load with two sources).

The records (``LocalKV``, ``Connection``, ``PeerState``) are in
``peerstate``. Imports the standard library, ``rdma_kv.errors`` and the
connector's ``types`` and ``rdma`` modules ``wire``, ``meta``,
``heldwords``, ``slots``, ``topology``, ``stats``, ``sideclient``,
``auth``, ``settings`` and the consumer's ``records``, ``peerstate`` and ``clients``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.peerstate import (
    Connection,
    LocalKV,
    PeerKey,
    PeerStage,
    PeerState,
    Table,
    Waiter,
)
from rdma_kv.connector.rdma.consumer.records import LoadState, Source
from rdma_kv.connector.rdma.heldwords import checked_words
from rdma_kv.connector.rdma.meta import PeerAddress
from rdma_kv.connector.rdma.slots import HeadSlice, SlotTable
from rdma_kv.connector.rdma.stats import ConsumerCounters, Tally
from rdma_kv.connector.rdma.topology import RankPlan, Read, plan_ranks
from rdma_kv.connector.types import EngineId
from rdma_kv.errors import HandshakeError, PeerTimeout

__all__ = ["PEER_RETRY_S", "Connection", "LocalKV", "PeerDirectory", "PeerStage", "PeerState", "Table"]

logger = logging.getLogger(__name__)

PEER_RETRY_S = 1.0
"""A peer whose handshake or reads failed is not dialled again for this long
(nor one whose handshake was not answered: STALLED)."""

class PeerDirectory:
    """The producer ranks one consumer rank reads from. Methods marked
    "lock held" expect the consumer's lock (``lock``) held by the caller."""

    def __init__(self, local: LocalKV, engine_id: EngineId, tp_rank: int, lock: threading.RLock,
                 pool: ClientPool, counters: Tally[ConsumerCounters], clock: Callable[[], float],
                 on_handshake: Callable[[PeerState, list[Waiter]], None]) -> None:
        self._local = local
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._lock = lock
        self._pool = pool
        self._counters = counters
        self._clock = clock
        self._on_handshake = on_handshake
        self.introduce: Callable[[PeerState, str, bytes], None] | None = None
        """Push mode: the handshake's last step (``Pushes.introduce``), once
        the transport peer is made; its failure fails the handshake."""
        self._peers: dict[PeerKey, PeerState] = {}
        self._tables_lock = threading.Lock()
        self._local_tables: dict[HeadSlice | None, Table] = {None: (local.slots, local.prepared)}

    def plan(self, address: PeerAddress) -> RankPlan:
        """What this rank reads from the producer at ``address``; raises
        ``ConfigError`` when the two TP sizes cannot share the model's heads."""
        compat, rank = self._local.compat, self._local.rank
        return plan_ranks(self._tp_rank, rank.tp_size, address.tp_size, max(1, compat.total_kv_heads),
                          compat.kv_layout == "MLA", self._local.group_heads)

    def __len__(self) -> int:
        return len(self._peers)

    def confirmed(self, address: PeerAddress, ranks: Collection[int]) -> bool:
        """Whether one of producer ranks ``ranks`` at ``address`` is READY
        under that very address: its handshake confirmed the engine's TP
        size (``_ask``), which the request's params only claim. Takes the lock."""
        with self._lock:
            for rank in ranks:
                peer = self._peers.get(address.rank_key(rank))
                if peer is not None and peer.state is PeerStage.READY and peer.address == address:
                    return True
        return False

    # --- finding a peer (lock held) -----------------------------------------------------------

    def _known(self, address: PeerAddress, rank: int, now: float) -> PeerState | None:
        key = address.rank_key(rank)
        peer = self._peers.get(key)
        if peer is not None and peer.forgotten(now, PEER_RETRY_S):
            self._drop(peer)
            return self._peers.get(key)  # (the dialling its check's loads went to, if any)
        return peer

    def _drop(self, peer: PeerState) -> None:
        """Forget FAILED ``peer``; the loads waiting on its check, if any,
        go to a new dialling of the producer rank (the check would never be
        dialled again: ``redial`` dials the checks of READY peers only; a
        review found them waiting out their deadline). Lock held."""
        del self._peers[peer.key]
        check, peer.checking = peer.checking, None
        if check is None:
            return
        live = [(load, src) for load, src in check.waiting if not load.stage.terminal and load.error is None]
        check.waiting = live  # (taken by the new dialling: the check's own end hands none)
        if live:
            self._connect(peer.address, peer.rank, stalled=check)
        check.waiting = []

    def peer_for(self, load: LoadState, src: Source, now: float) -> tuple[PeerState, Connection] | str | None:
        """The READY peer (and its connection) to read ``src`` of ``load``
        from now; None when the load waits for the peer's handshake (started
        if needed); or why the load cannot read from it. Lock held."""
        spec, rank = load.spec, src.read.rank
        peer = self._known(spec.peer, rank, now)
        orphans: list[Waiter] = []
        if peer is not None and peer.connection is not None and peer.connection.registration < spec.registration:
            if peer.state is PeerStage.READY:  # the params say it re-registered: a handshake checks first
                return self._check(peer, load, src)
            if peer.checking is not None:  # (loads waiting on its check go to the new dialling)
                orphans, peer.checking.waiting, peer.checking = peer.checking.waiting, [], None
            self._forget(peer)  # failed already: its loads are gone, dialled again at once
            peer = None
        if peer is None:
            peer = self._connect(spec.peer, rank)
            if peer is None:
                return "the worker is shutting down"
            peer.waiting += orphans
        if peer.state is PeerStage.FAILED:
            return f"producer {spec.peer.engine_id!r} rank {rank} is unavailable: {peer.error}"
        peer.used_at = now
        if peer.state is not PeerStage.READY or peer.connection is None:
            peer.waiting.append((load, src))
            if peer.stalled_since is not None and peer.error is not None:
                load.waiting_on = peer.error  # STALLED, or dialled again after it
            return None
        return peer.connection.stale_for(spec.registration, peer) or (peer, peer.connection)

    def _check(self, peer: PeerState, load: LoadState, src: Source) -> str | None:
        """``load`` names a newer registration than READY ``peer``'s: it
        waits on a handshake that asks the producer. ``peer`` stays in use
        (its loads read on) until the reply shows a newer registration
        (``_superseded``): the params are a client's word, and forgetting
        the peer fences its transport peer, which fails every read in flight
        through it (a review: one request whose params added 1 to the
        registration failed every other load from that producer). Lock held."""
        check = peer.checking
        if check is None:
            check = self._dial_check(peer)
            if check is None:
                return "the worker is shutting down"
            self._counters.add("registration_checks")
        check.waiting.append((load, src))
        if check.stalled_since is not None and check.error is not None:
            load.waiting_on = check.error  # STALLED, or dialled again after it
        return None

    def _dial_check(self, peer: PeerState, stalled: PeerState | None = None) -> PeerState | None:
        """A check of ``peer`` (``_check``) dialled, ``peer.checking`` from
        now; ``stalled``: the STALLED check it dials again (``redial``),
        whose loads and stall it takes over. None once the RPC threads are
        shut down. Lock held."""
        check = PeerState(peer.address, peer.rank, used_at=self._clock(), replaces=peer)
        if stalled is not None:
            check.waiting, check.used_at = stalled.waiting, stalled.used_at
            check.stalled_since, check.unanswered, check.error = stalled.stalled_since, stalled.unanswered, stalled.error
        if not self._pool.submit(self._handshake, check, to=peer.address.rank_address(peer.rank)):
            peer.checking = None
            return None
        peer.checking = check
        return check

    def preconnect(self, address: PeerAddress) -> None:
        """Start the handshakes with the producer ranks at ``address`` this
        rank reads, so that the first load from them finds the peers READY or
        CONNECTING. A peer already known, or failed less than
        ``PEER_RETRY_S`` ago, is left alone. Never raises."""
        try:
            ranks = sorted({read.rank for read in self.plan(address).reads})
        except Exception:
            return  # no plan: the load fails with the reason
        with self._lock:
            for rank in ranks:
                known = self._known(address, rank, self._clock())
                if known is not None:
                    known.used_at = self._clock()  # a load from it is on its way
                    continue
                if self._connect(address, rank) is None:
                    return
                self._counters.add("preconnects")

    def _connect(self, address: PeerAddress, rank: int, stalled: PeerState | None = None) -> PeerState | None:
        """A new CONNECTING peer, its handshake submitted to the RPC threads
        (None once they are shut down); ``stalled``: the STALLED peer it
        dials again, whose waiting loads and stall it takes over. Lock held."""
        peer = PeerState(address, rank, used_at=self._clock())
        if stalled is not None:
            peer.waiting, peer.used_at = stalled.waiting, stalled.used_at
            peer.stalled_since, peer.unanswered = stalled.stalled_since, stalled.unanswered
            peer.error = stalled.error  # what they wait on, until it answers (cleared then)
        self._peers[peer.key] = peer
        if not self._pool.submit(self._handshake, peer, to=address.rank_address(rank)):
            del self._peers[peer.key]
            return None
        return peer

    # --- the handshake (RPC thread) ------------------------------------------------------------

    def _handshake(self, peer: PeerState) -> None:
        """Make ``peer`` READY or FAILED, then hand its waiting loads over;
        or STALLED (:meth:`_stalled`), its loads left waiting."""
        address, t0, began = peer.address, time.perf_counter(), self._clock()
        name = None
        try:
            reply = self._ask(peer)
            if peer.replaces is not None and not self._superseded(peer, reply):
                return
            geometry = reply.geometry.to_geometry()
            words = checked_words(reply.words, geometry.num_blocks)
            # Push mode: one endpoint, on the transport's own worker (``paired``), as the
            # producer imports this decode, so that UCX pairs the two and the fence closes
            # the connection the producer's writes cross.
            name = self._local.transport.add_peer(reply.agent_metadata, name=peer.transport_name,
                                                  paired=self.introduce is not None)
            if self.introduce is not None:
                self.introduce(peer, name, reply.life)
        except Exception as exc:
            if name is not None:
                self._remove(name, fence=self.introduce is not None)
            host, port = address.rank_address(peer.rank)
            reason = f"handshake with {host}:{port} failed: {exc}"
            with self._lock:
                stalled = self._stalled(peer, exc, began)
                if stalled is None and peer.replaces is not None and peer.replaces.checking is peer:
                    peer.replaces.checking = None  # (a check: its loads fail, the peer it checked reads on)
                if stalled is None:
                    peer.state, peer.error, peer.failed_at = PeerStage.FAILED, reason, self._clock()
                    waiting, peer.waiting = peer.waiting, []
            if stalled is not None:
                # Its loads wait: said once per stall (then at DEBUG, each time it is dialled again).
                log, waits = stalled
                log("producer %r: %s; %d load(s) wait on it", address.engine_id, peer.error, waits)
                return
            # Said once it holds: a load that starts after the warning finds the peer FAILED.
            logger.warning("producer %r: %s", address.engine_id, reason)
        else:
            with self._lock:
                peer.state = PeerStage.READY
                peer.connection = Connection(name, geometry, reply.registration, time.perf_counter() - t0,
                                             words=words,
                                             life=reply.life)
                waiting, peer.waiting = peer.waiting, []
                self._counters.add("handshakes")
                for load, _ in waiting:
                    if peer.error is not None and load.waiting_on == peer.error:
                        load.waiting_on = ""  # answered: no longer what the load waits on
                peer.error = None  # (carried from a STALLED peer: _connect)
            if peer.stalled_since is not None:
                logger.info("producer %r rank %d answered the HANDSHAKE after %.1f s not answering it",
                            address.engine_id, peer.rank, self._clock() - peer.stalled_since)
        self._on_handshake(peer, waiting)

    def _superseded(self, check: PeerState, reply: wire.HandshakeReply) -> bool:
        """A check's reply (``_check``): True when the producer did
        re-register past the peer checked, which is then forgotten (its keys
        are void), ``check`` taking its place and going on as a new peer's
        handshake. Otherwise its loads are handed back (the peer checked
        refuses them: ``Connection.stale_for``), or to the peer that took
        the place meanwhile. Called without the lock (RPC thread)."""
        old = check.replaces
        assert old is not None
        with self._lock:
            if old.checking is check:
                old.checking = None
            current = self._peers.get(check.key)
            newer = old.connection is not None and reply.registration > old.connection.registration
            if newer and current is old:
                self._forget(old)
                current = None
            if newer and current is None:
                self._peers[check.key] = check
                check.replaces = None
                return True
            to = current if newer and current is not None else old
            waiting, check.waiting = check.waiting, []
            check.state = PeerStage.FAILED
            if to.state in (PeerStage.CONNECTING, PeerStage.STALLED):
                to.waiting += waiting
                return False
        self._on_handshake(to, waiting)
        return False

    def _stalled(self, peer: PeerState, exc: Exception, began: float) -> tuple[Callable[..., None], int] | None:
        """Make ``peer`` STALLED if its producer did not answer the
        HANDSHAKE that ``began`` then, and answered this rank before
        (``PeerTimeout.answered_before``): its loads stay waiting on it,
        told why. The logger method to say so with and how many loads
        wait; None if not (it fails). Lock held."""
        current = self._peers.get(peer.key) if peer.replaces is None else peer.replaces.checking
        if not (isinstance(exc, PeerTimeout) and exc.answered_before) or current is not peer:
            return None  # (not in the directory: the worker cleared it, the loads failed)
        now, first = self._clock(), peer.stalled_since is None
        if peer.stalled_since is None:
            peer.stalled_since = began
        peer.unanswered += 1
        host, port = peer.address.rank_address(peer.rank)
        # peer.error: what its waiting loads wait on (peer_for and the handshake's end compare it).
        peer.state, peer.failed_at = PeerStage.STALLED, now
        peer.error = (f"the HANDSHAKE with {peer.address.engine_id!r} rank {peer.rank} ({host}:{port}) was not "
                      f"answered for {now - peer.stalled_since:.1f} s ({peer.unanswered} call(s), made again "
                      f"each {PEER_RETRY_S:g} s; the last: {exc})")
        peer.waiting = [(load, src) for load, src in peer.waiting if not load.stage.terminal]
        for load, _ in peer.waiting:
            load.waiting_on = peer.error
        self._counters.add("handshakes_unanswered")
        return (logger.warning if first else logger.debug), len(peer.waiting)

    def redial(self, now: float) -> None:
        """Dial again each STALLED peer whose ``PEER_RETRY_S`` passed: a new
        CONNECTING peer that takes over the loads still waiting on it (those
        that failed meanwhile, at their deadline, dropped); with none left
        it is forgotten. Lock held (a step: ``RdmaConsumer.get_finished``)."""
        for key, peer in list(self._peers.items()):
            check = peer.checking
            if check is not None and check.state is PeerStage.STALLED and now - check.failed_at >= PEER_RETRY_S \
                    and peer.state is PeerStage.READY:  # (a failed peer's: its loads go on when it is dropped)
                check.waiting = [(load, src) for load, src in check.waiting
                                 if not load.stage.terminal and load.error is None]
                if not check.waiting:
                    peer.checking = None
                elif self._dial_check(peer, stalled=check) is None:
                    return
            if peer.state is not PeerStage.STALLED or now - peer.failed_at < PEER_RETRY_S:
                continue
            del self._peers[key]
            peer.waiting = [(load, src) for load, src in peer.waiting
                            if not load.stage.terminal and load.error is None]
            if peer.waiting and self._connect(peer.address, peer.rank, stalled=peer) is None:
                return  # the RPC threads are shut down: the loads fail at their deadline

    def _ask(self, peer: PeerState) -> wire.HandshakeReply:
        """HANDSHAKE with ``peer``; the reply, its engine, KV cache and rank share checked."""
        address, compat = peer.address, self._local.compat
        client = self._pool.get(*address.rank_address(peer.rank))
        reply = client.handshake(wire.Handshake(wire.PROTOCOL_VERSION, self._engine_id, self._local.rank, compat))
        if reply.engine_id != address.engine_id:
            raise HandshakeError(
                f"expected producer engine {address.engine_id!r} at {client.address}, found "
                f"{reply.engine_id!r}; the request's kv_transfer_params point at another engine")
        mismatches = compat.mismatches(reply.compat, mine="consumer", theirs="producer")
        if mismatches:
            diff = "; ".join(mismatches)
            raise HandshakeError(f"producer {reply.engine_id!r} has an incompatible KV cache: {diff}")
        expected = wire.RankInfo(peer.rank, address.tp_size, self.plan(address).remote_heads)
        if reply.rank != expected:
            raise HandshakeError(
                f"producer {reply.engine_id!r} at {client.address} is rank {reply.rank.tp_rank} of "
                f"{reply.rank.tp_size} with {reply.rank.num_kv_heads} KV heads; expected rank "
                f"{expected.tp_rank} of {expected.tp_size} with {expected.num_kv_heads} (the "
                "kv_transfer_params' tp_size, or the producer's ports, are wrong)")
        return reply

    # --- failures ---------------------------------------------------------------------------------

    def _forget(self, peer: PeerState) -> None:
        """Drop a peer whose metadata is void. Lock held (the transport call
        takes the transport's lock only)."""
        del self._peers[peer.key]
        peer.state, peer.error = PeerStage.FAILED, "re-registered"
        if peer.connection is not None:
            self._remove(peer.connection.name, fence=True)

    def failed(self, peer: PeerState, reason: str) -> None:
        """``peer``'s reads, confirmation or push failed: it is FAILED (dialled
        again after ``PEER_RETRY_S``) and its transport peer removed, fenced
        (a restarted producer has a new agent; in push mode no write of the
        producer's may land once its blocks go back: ``_remove``). Called
        without the lock held."""
        with self._lock:
            if self._peers.get(peer.key) is not peer or peer.state is not PeerStage.READY:
                return
            peer.state, peer.error, peer.failed_at = PeerStage.FAILED, reason, self._clock()
        if peer.connection is not None:
            self._remove(peer.connection.name, fence=True)

    def _remove(self, name: str, fence: bool = False) -> None:
        """Remove transport peer ``name``. ``fence`` (a failed peer): its
        endpoints force-closed, so that nothing it still sends is applied
        here afterwards -- a graceful close is no fence against the
        producer's own writes (``Agent.remove_peer``), and push mode hands a
        failed push's blocks back right after this."""
        try:
            closed = self._local.transport.remove_peer(name, fence=fence)
        except Exception:
            return  # already gone (the transport failed it itself, or closed)
        if fence and closed is False:
            logger.warning("the endpoint to %r is left open (a flush of it outstanding): writes it still "
                           "carries could land until the flush ends", name)

    def prune(self, now: float, reading: Callable[[], set[PeerKey]]) -> list[str]:
        """Forget the peers :meth:`PeerState.forgotten`, and the READY ones
        no load found for the client pool's ``idle_s`` that no load in the
        book reads from (``reading()``, asked only when one is idle), so that
        producers that come and go do not accumulate. Returns the transport
        names of the latter, for :meth:`remove` once the lock is released.
        A STALLED peer is left to :meth:`redial` (it holds no transport
        peer; with no load waiting on it, that forgets it). Lock held."""
        idle_s, idle = self._pool.idle_s, []
        for key, peer in list(self._peers.items()):
            if peer.forgotten(now, PEER_RETRY_S):
                self._drop(peer)
            elif peer.state is PeerStage.READY and now - peer.used_at >= idle_s and not peer.waiting:
                idle.append(peer)
        if not idle:
            return []
        busy = reading()
        names = []
        for peer in idle:
            if peer.key not in busy and peer.connection is not None:
                del self._peers[peer.key]
                # A call still holding it (a RELEASE on an RPC thread) finds it no longer READY.
                peer.state, peer.error = PeerStage.FAILED, f"idle for {now - peer.used_at:.0f} s: forgotten"
                names.append(peer.connection.name)
                self._counters.add("peers_forgotten")
        return names

    def remove(self, names: list[str]) -> None:
        """Remove transport peers ``prune`` forgot. Called without the lock."""
        for name in names:
            self._remove(name)

    def clear(self) -> None:
        """Forget every peer (the transport is about to close). Lock held."""
        self._peers.clear()

    def addresses(self) -> set[tuple[str, int]]:
        """The side channels of the peers known. Lock held."""
        return {p.address.rank_address(p.rank) for p in self._peers.values()}

    # --- slot tables ---------------------------------------------------------------------------

    def local_table(self, heads: HeadSlice | None) -> Table:
        """This rank's slot table cut to ``heads`` (None: whole blocks),
        prepared; made once per slice, shared by reads and pushes. Called
        without the consumer's lock."""
        with self._tables_lock:
            mine = self._local_tables.get(heads)
            if mine is None:
                slots = SlotTable(self._local.geometry, heads)
                mine = self._local_tables[heads] = (slots, self._local.transport.prep_local(slots.descs))
            return mine

    def tables(self, plan: RankPlan, read: Read, peer: Connection) -> tuple[Table, Table]:
        """(local, remote) prepared slot tables for ``read`` through ``peer``;
        raises ``ValueError`` (once, when the remote table is first made) if
        their rows do not pair (``SlotTable.mismatch``: bytes per block,
        layer, KV-cache group). Called without the consumer's
        lock (preparing calls the transport)."""
        whole = plan.whole(read)
        local = None if whole else HeadSlice(read.local_first, read.count, plan.local_heads)
        remote = None if whole else HeadSlice(read.remote_first, read.count, plan.remote_heads)
        transport = self._local.transport
        mine = self.local_table(local)
        with self._tables_lock:
            theirs = peer.tables.get(remote)
            if theirs is None:
                slots = SlotTable(peer.geometry, remote)
                why = mine[0].mismatch(slots)
                if why is not None:
                    raise ValueError(f"the geometry producer rank {read.rank} announced does not pair with "
                                     f"this rank's: {why}")
                theirs = peer.tables[remote] = (slots, transport.prep_remote(peer.name, slots.descs))
        return mine, theirs
