"""Push mode, the producer's side: writing a lease's blocks into a decode's KV cache.

Owns :class:`PushWriter`: the decode ranks that introduced their KV cache
(PUSH_HELLO: agent metadata, geometry, registration; each known by engine
id, rank and its worker's incarnation), and the pushes (one
per decode allocation ``token``): PUSH checks the lease, writes, and the
transport notifies the decode once every write is remotely complete;
PUSH_QUERY answers where a push is, or aborts it.

What a push may write, and when (the never-silent argument in full:
docs/rdma-connector.md, "Push mode"):

- **Only the lease's blocks, only into the allocation named.** PUSH carries
  the lease as RENEW/CONFIRM do (token, binding, claim): FORGED, UNKNOWN,
  GONE or CLAIMED write nothing. The producer block ids must be among the
  lease's (per group); the decode block ids are the decode's allocation for
  this request, and its ``token`` is random per allocation. One push per
  lease and decode rank: a second PUSH under the same lease from the same
  rank (a replay, a stale registration) is refused.
- **From blocks that stay held.** The lease is pinned while its writes are
  in flight (``LeaseTable.pin_for_push``): no expiry or reclaim frees the
  source blocks under a write.
- **Completion is never early.** The writes are posted with the decode's
  token as their notification: the transport flushes every endpoint that
  carried a part before it sends the notification (``csrc/post.c``), so the
  decode sees the token only after every byte landed.
- **Bounded.** Every write batch has the transfer timeout
  (``read_timeout_s``, the pull reads' own); ``writes_end_within_s`` in the
  answer says so. Once a push resolved (DONE, FAILED, ABORTED), nothing for
  it is posted again, and the lease is released (its blocks go back to the
  prefill engine through ``done_sending``).

Concurrent dispatch (PUSH_REG under a router's transfer id) and the
layer-wise writes are the other half of the writer: ``pushreg``
(:class:`pushreg.ConcurrentDispatch`, which :class:`PushWriter` extends);
the records both halves keep are ``pushstate``'s.

Runs on the side channel's loop thread (posting does not block) and the
transport's progress thread (completions). Imports numpy, the standard
library, ``rdma_kv.errors``, the connector's ``geometry``, and its ``rdma`` modules
``fences``, ``leases``, ``meta``, ``pushreg``, ``pushstate``, ``slots``, ``stats``,
``transport_api`` and ``wire``. Never the consumer's modules.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.fences import FenceFactory
from rdma_kv.connector.rdma.leases import LeaseCall, LeaseTable
from rdma_kv.connector.rdma.pushreg import ConcurrentDispatch, Planned
from rdma_kv.connector.rdma.pushstate import (
    ABORTED,
    DONE,
    FAILED,
    FORGET_AFTER_S,
    MAX_DECODES,
    MAX_REMEMBERED,
    PENDING,
    REFUSED,
    RUNNING,
    UNKNOWN,
    WAITING,
    Decode,
    DecodeKey,
    PushEntry,
    decode_key,
    decode_name,
    describe,
    heads,
)
from rdma_kv.connector.rdma.slots import HeadSlice, SlotTable
from rdma_kv.connector.rdma.stats import MAX_RECORDS, PushCounters, PushRecord, Tally
from rdma_kv.connector.rdma.transport_api import PreparedList, TransferHandle, Transport
from rdma_kv.errors import PeerError

__all__ = ["PUSH_NOTIFY_PREFIX", "PushWriter"]

logger = logging.getLogger(__name__)

PUSH_NOTIFY_PREFIX = wire.PUSH_NOTIFY_PREFIX


class PushWriter(ConcurrentDispatch):
    """The producer rank's pushes."""

    def __init__(self, transport: Transport, geometry: KVCacheGeometry, leases: LeaseTable,
                 write_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 wait_s: float = 30.0, block_size: int = 0, layerwise: bool = True,
                 fences: FenceFactory | None = None) -> None:
        self._transport = transport
        self._geometry = geometry
        self._leases = leases
        self._write_timeout_s = write_timeout_s
        self._wait_s = wait_s
        """How long a registration waits for its prefill (concurrent dispatch)."""
        self._block_size = block_size  # tokens per block (concurrent dispatch maps tokens to blocks)
        self.layerwise = layerwise
        """Write each layer as it is stored."""
        self._fences = fences
        """A CUDA KV cache's: a layer is written once its fence passed (``fences``)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._decodes: collections.OrderedDict[DecodeKey, Decode] = collections.OrderedDict()
        """Least recently used first (a push or registration from a decode moves it last)."""
        self._pushes: collections.OrderedDict[bytes, PushEntry] = collections.OrderedDict()
        self._retired: list[str] = []
        """Transport peers of decodes forgotten after a failed write, to remove (side channel thread)."""
        self._imports = 0
        """Imports of decodes made (each named apart: ``hello``)."""
        self.life = b""
        """The life of the transport this pusher writes through (``ProducerHandler``
        sets it before publishing the pusher): a PUSH_HELLO naming another is refused."""
        self._generations: set[tuple[int, int]] = set()  # (lease, reader) pushed: a second PUSH is refused
        self._own: dict[HeadSlice | None, tuple[SlotTable, PreparedList]] = {}
        self._counts = Tally(PushCounters)  # counted under self._lock
        self._records: collections.deque[PushRecord] = collections.deque(maxlen=MAX_RECORDS)  # under the lock
        self._init_concurrent()

    # --- PUSH_HELLO ------------------------------------------------------------------------

    def hello(self, request: wire.PushHello) -> wire.PushReply:
        if request.life and self.life and request.life != self.life:
            # The handshake was answered by the transport before this one (the
            # producer slept and woke since): the link is to a worker that is
            # gone, and ``ordinal`` counts the decode's endpoints to it.
            # Nothing is imported or recorded; the decode dials again.
            return wire.PushReply(REFUSED, "PUSH_HELLO for another life of this producer's transport (it slept "
                                           "and woke since the handshake): dial again")
        key = decode_key(request)
        geometry = request.geometry.to_geometry()
        with self._lock:
            old = self._decodes.get(key)
            if old is not None and old.registration == request.registration and old.link == request.link:
                return wire.PushReply(DONE, "known")
            if old is not None and request.registration < old.registration:
                # An introduction of the decode's KV cache from before it slept,
                # delayed: its worker and its blocks are gone. Nothing is replaced.
                return wire.PushReply(REFUSED, f"PUSH_HELLO out of date: registration {request.registration}, "
                                               f"this rank imported the decode's registration {old.registration}")
            if old is not None and old.registration == request.registration and request.ordinal \
                    and old.ordinal >= request.ordinal:
                # An introduction older than the link imported (delayed on another
                # connection): importing it would pair with none of the decode's live
                # endpoints. Nothing is replaced. (Compared within one registration
                # only: a decode that woke from sleep has a new worker, whose links
                # count from 1 again.)
                return wire.PushReply(REFUSED, f"PUSH_HELLO out of date: link endpoint {request.ordinal}, "
                                               f"this rank imported the decode's endpoint {old.ordinal}")
            if old is not None:
                # A new registration of this decode (it slept and woke): the
                # old one's block ids mean nothing in the new cache. Or a new
                # link: the decode dialled this rank again, and only an
                # endpoint made afresh pairs with its new one, which is what
                # its fence closes (versions.py, 13 and 14). Retired before its
                # peer is replaced (its transfers in flight fail), so that
                # nothing prepares a write for it from here on (``_tables``
                # checks again once prepared).
                del self._decodes[old.key]
            elif (full := self._no_room()) is not None:
                return full
            gone, self._retired = self._retired, []  # (names are unique per import: none is in use)
            self._imports += 1
            name = f"{decode_name(key)}/{self._imports}"
        for retired in gone:  # (peers are removed on this thread, never in a completion callback)
            self._transport.remove_peer(retired)
        if old is not None:
            # The decode's old link is closed on its side (it fenced it before it
            # dialled again) or belongs to its old registration: that import goes,
            # forced (its writes in flight fail; what they queued over TCP may still
            # land, which the decode's fence of that link stops, not this close),
            # whatever comes of the new one.
            # Each import has a name of its own, so that nothing resolved by the
            # old name later (a layer-wise push's flush and notification, after
            # its link check) can reach the new link, whose endpoint carried none
            # of that push's writes: it meets PeerError and the push fails.
            try:
                self._transport.remove_peer(old.name, fence=True)
            except PeerError:
                pass
        # Named by the decode worker it introduces itself as (engine, rank and
        # incarnation) and this import's number, not by its metadata's own
        # name: another decode's metadata cannot replace this one's peer, even
        # under the same engine id.
        # ``paired``: every write to the decode on this one endpoint (none striped onto a
        # lane's), which UCX pairs with the decode's endpoint for this link, the one its
        # fence closes. A lane's endpoint pairs with none of the decode's: a striped write
        # abandoned by this side landed in 80 of 80 blocks the decode had fenced and freed
        # (test_netns_late_bytes.py's push-striped).
        # ``ordinal``: this import is made the decode's link's number among this worker's
        # endpoints to the decode's (links it never imported are made up), so the two pair
        # even after an introduction whose answer the decode never got.
        try:
            name = self._transport.add_peer(request.agent_metadata, name=name, paired=True,
                                            ordinal=request.ordinal or None)
        except PeerError as exc:
            return wire.PushReply(REFUSED, f"PUSH_HELLO not imported: {exc}")
        with self._lock:
            # Room is made once the import is made: a decode whose import the
            # transport refuses (its count of endpoints unknown, past UCX's
            # 65,535) forgets nobody (a review: each of its dials, a second
            # apart, evicted a healthy idle decode, whose next push was refused).
            room = None if key in self._decodes else self._make_room()
            if not isinstance(room, wire.PushReply):
                self._decodes[key] = Decode(name, geometry, request.registration, key, request.link,
                                            request.ordinal)
                self._counts.add("hellos")
        if isinstance(room, wire.PushReply):  # every decode got a push under way meanwhile
            with contextlib.suppress(PeerError):
                self._transport.remove_peer(name, fence=True)
            return room
        if room is not None:
            self._transport.remove_peer(room)
        return wire.PushReply(DONE, "introduced")

    def _no_room(self) -> wire.PushReply | None:
        """REFUSED when one more decode would find no room (:meth:`_make_room`),
        before anything is imported for it; None otherwise. Under the lock."""
        if len(self._decodes) < MAX_DECODES or self._idle_decode() is not None:
            return None
        return wire.PushReply(REFUSED, f"this producer rank serves {MAX_DECODES} decode ranks, each with a "
                                       "push under way: introduce this one again once one has ended")

    def _idle_decode(self) -> DecodeKey | None:
        """The least recently used decode with no push running or waiting. Under the lock."""
        busy = set()
        for entry in self._pushes.values():
            if entry.state in (RUNNING, WAITING):
                if entry.decode is not None:
                    busy.add(entry.decode.key)
                if entry.reg is not None:
                    busy.add(decode_key(entry.reg))
        return next((key for key in self._decodes if key not in busy), None)

    def _make_room(self) -> str | wire.PushReply | None:
        """Room for one more decode (under the lock): below MAX_DECODES, none
        needed (None); else the least recently used decode with no push
        running or waiting is forgotten (it introduces itself again if it
        comes back), and its transport peer's name returned; REFUSED when
        every one has a push under way."""
        if len(self._decodes) < MAX_DECODES:
            return None
        victim = self._idle_decode()
        if victim is None:
            return self._no_room()
        old = self._decodes.pop(victim)
        self._counts.add("decodes_forgotten")
        return old.name

    # --- PUSH --------------------------------------------------------------------------------

    def push(self, request: wire.Push) -> wire.PushReply:
        token = request.token
        found = self._introduced(request)
        if isinstance(found, wire.PushReply):
            return found
        decode = found
        with self._lock:
            replayed = (request.lease.generation, request.lease.reader) in self._generations
        if replayed:
            self._count("refused")
            return wire.PushReply(REFUSED, f"lease {request.lease.generation} was already pushed to decode rank "
                                           f"{request.lease.reader}: a replayed or stale registration writes nothing")
        w = request.lease
        call = LeaseCall(w.ref(), w.claim, w.reader, w.readers)
        status, lease_blocks = self._leases.pin_for_push(call)
        if status is wire.LeaseStatus.PENDING:
            return wire.PushReply(PENDING, "the lease's grant has not reached this worker yet")
        if status is not wire.LeaseStatus.HELD:
            self._count("refused")
            return wire.PushReply(REFUSED, f"lease {status.name}")
        entry = PushEntry(call, token=token, started_at=self._clock(), decode=decode)
        try:
            planned = self._plan(request.remote_block_ids, request.local_block_ids, request.remote_heads,
                                 request.local_heads, decode, lease_blocks)
        except ValueError as exc:
            self._leases.unpin(w.generation)
            self._count("refused")
            return wire.PushReply(REFUSED, str(exc))
        with self._lock:
            self._generations.add((w.generation, w.reader))
            self._remember(token, entry)
        self._write(entry, planned, decode.name)
        with self._lock:
            return self._answer(entry)

    def _introduced(self, request: wire.Push | wire.PushReg) -> Decode | wire.PushReply:
        """The decode rank ``request`` comes from, introduced under its
        registration; else the answer: the push's state when its token is
        known (the decode asking again), REFUSED when the decode is unknown."""
        with self._lock:
            known = self._pushes.get(request.token)
            if known is not None:
                return self._answer(known)
            decode = self._introduced_as(request)
            if decode is not None:
                self._decodes.move_to_end(decode.key)
        if decode is None:
            return wire.PushReply(REFUSED, f"{describe(decode_key(request))} registration {request.registration} "
                                           "did not introduce its KV cache (PUSH_HELLO) to this producer rank")
        return decode

    def _write(self, entry: PushEntry, planned: Planned,
               decode: str) -> None:
        """Post ``entry``'s writes, notified with its token once remotely complete."""
        src, dst, own_prep, dst_prep = planned
        try:
            xfer = self._transport.write_prepared(own_prep, src, dst_prep, dst,
                                                  notify=PUSH_NOTIFY_PREFIX + entry.token,
                                                  timeout_s=self._write_timeout_s)
        except Exception as exc:  # nothing posted: a post that raises leaves nothing in flight
            rid = entry.call.ref.request_id if entry.call is not None else "?"
            logger.warning("push of %r to %r: posting the writes failed: %s", rid, decode, exc)
            self._resolve(entry, None, f"posting the writes failed: {exc}")
            return
        entry.nbytes = xfer.nbytes
        xfer.add_done_callback(lambda x: self._resolve(entry, x, None))

    def _plan(self, remote_ids: list[list[int]], local_ids: list[list[int]], remote_heads: wire.HeadsWire | None,
              local_heads: wire.HeadsWire | None, decode: Decode, lease_blocks: tuple[tuple[int, ...], ...]
              ) -> Planned:
        """(source slots, destination slots, their prepared lists); ValueError
        naming what is wrong (nothing posted then)."""
        remote = [np.asarray(g, dtype=np.int64) for g in remote_ids]
        local = [np.asarray(g, dtype=np.int64) for g in local_ids]
        if len(remote) != len(lease_blocks) or len(local) != len(lease_blocks):
            raise ValueError(f"{len(remote)} and {len(local)} groups of block ids for a lease of "
                             f"{len(lease_blocks)} groups")
        for i, (mine, held) in enumerate(zip(remote, lease_blocks)):
            outside = np.setdiff1d(mine, np.asarray(held, dtype=np.int64))
            if outside.size:
                raise ValueError(f"producer block(s) {outside[:8].tolist()} of group {i} are not the lease's: "
                                 "a push writes only the blocks its lease holds")
            if mine.size != local[i].size:
                raise ValueError(f"group {i}: {mine.size} producer blocks for {local[i].size} decode blocks")
        own, dst = self._tables(decode, remote_heads, local_heads)
        return own[0].indices(remote, "producer"), dst[0].indices(local, "decode"), own[1], dst[1]

    def _tables(self, decode: Decode, remote_heads: wire.HeadsWire | None, local_heads: wire.HeadsWire | None
                ) -> tuple[tuple[SlotTable, PreparedList], tuple[SlotTable, PreparedList]]:
        """This rank's and the decode's slot tables, prepared (made once per head slice)."""
        own_heads = heads(remote_heads)
        dst_heads = heads(local_heads)
        with self._lock:
            own = self._own.get(own_heads)
            dst = decode.tables.get(dst_heads)
        if own is None:
            table = SlotTable(self._geometry, own_heads)
            own = (table, self._transport.prep_local(table.descs))
            with self._lock:
                self._own[own_heads] = own
        if dst is None:
            table = SlotTable(decode.geometry, dst_heads)
            why = own[0].mismatch(table)
            if why is not None:
                raise ValueError(f"the geometry the decode introduced does not pair with this producer's "
                                 f"(or the head slices do not match): {why}")
            try:
                prepared: PreparedList | None = self._transport.prep_remote(decode.name, table.descs)
            except PeerError as exc:  # (its import removed meanwhile: a new link or registration replaced it)
                prepared, gone = None, exc
            with self._lock:
                if self._decodes.get(decode.key) is not decode:
                    # Re-registered (or forgotten, or introduced on a new link)
                    # while this was prepared: not written through this import.
                    raise ValueError(f"{describe(decode.key)} re-registered its KV cache: registration "
                                     f"{decode.registration}'s block ids are not written")
                if prepared is None:
                    raise ValueError(f"{describe(decode.key)}: its import is gone ({gone})")
                dst = (table, prepared)
                decode.tables[dst_heads] = dst
        return own, dst

    def _resolve(self, entry: PushEntry, xfer: TransferHandle | None, error: str | None) -> None:
        """The push's writes resolved (``xfer`` done or failed), or were never
        posted (``error``): nothing more is written for it; unpin and release
        the lease (its blocks go back to the engine)."""
        failure = error if error is not None else (None if xfer is None or xfer.error is None
                                                  else f"writes failed: {xfer.error}")
        if failure is not None and xfer is not None and xfer.abandoned:
            # Failed at its deadline while UCX still held it (a flush to the decode outstanding):
            # its bytes may still arrive. The decode fences this producer before its blocks go back.
            failure += (" (abandoned by the producer's transport, its bytes possibly still on their way: "
                        "the decode fences this producer before the blocks go back)")
        with self._lock:
            if entry.state not in (RUNNING, WAITING):
                return  # resolved already
            if failure is not None:  # even if aborted: the decode must know the batch broke (pushes.py)
                entry.state, entry.detail = FAILED, failure
            elif entry.aborted:
                entry.state, entry.detail = ABORTED, "aborted by the decode (its writes had completed)"
            elif entry.expired:
                entry.state = REFUSED  # its layer-wise writes are flushed; no prefill finished in time
                entry.detail = (f"no prefill under transfer id {entry.reg.transfer_id if entry.reg else '?'!r} "
                                f"finished on this producer within {self._wait_s:g} s")
            else:
                entry.state = DONE
            entry.resolved_at = self._clock()
            self._counts.add(entry.state.value)
            if entry.state is FAILED and entry.decode is not None:
                # A failed write may have failed the transport's endpoint to the decode (a deadline
                # closes it): forget the decode, so that its next PUSH is answered "introduce your KV
                # cache" and its PUSH_HELLO imports its metadata afresh (else every later push to it
                # fails against the dead endpoint). A newer introduction is kept.
                if self._decodes.get(entry.decode.key) is entry.decode:
                    del self._decodes[entry.decode.key]
                    self._retired.append(entry.decode.name)  # its peer, removed at the next PUSH_HELLO
            if failure is None and xfer is not None:  # remotely complete, whatever the decode then wanted
                self._counts.add("written_bytes", entry.nbytes)
                self._counts.add("overlapped_bytes", entry.overlapped_nbytes)
            self._record(entry)
        if entry.call is not None:
            self._leases.unpin(entry.call.ref.generation)
            self._leases.release([entry.call])

    # --- PUSH_QUERY ----------------------------------------------------------------------------

    def query(self, request: wire.PushQuery) -> wire.PushReply:
        self.reap()
        with self._lock:
            entry = self._pushes.get(request.token)
            if entry is None and request.abort:
                # The decode gives up on an allocation this rank never took. Its PUSH may
                # still be on its way (sent before this query, answered too late for the
                # decode): remembered as ABORTED, it is answered that, and writes nothing.
                now = self._clock()
                entry = PushEntry(None, state=ABORTED, detail="aborted by the decode before its PUSH arrived",
                                  resolved_at=now, token=request.token, started_at=now)
                self._remember(request.token, entry)
                self._counts.add("aborted_unknown")
                return wire.PushReply(UNKNOWN, "no push of this token on this producer rank; a PUSH of it arriving "
                                               "later is refused")
            if entry is None:
                return wire.PushReply(UNKNOWN, "no push of this token on this producer rank")
            if request.abort and entry.state is WAITING and entry.written_upto < 0 and not entry.outstanding:
                entry.state, entry.detail, entry.resolved_at = ABORTED, "aborted before anything was posted", \
                    self._clock()
                self._counts.add("aborted")
                self._record(entry)
                return self._answer(entry)
            if request.abort and entry.state is WAITING and not entry.aborted:
                entry.aborted = True  # layer-wise writes went out: flushed before it answers ABORTED
                flush_now = entry
            else:
                flush_now = None
            if request.abort and entry.state is RUNNING and not entry.aborted:
                # Posted writes cannot be recalled: they resolve within the
                # timeout; the decode waits for that answer before reusing its blocks.
                entry.aborted = True
                self._counts.add("abort_asked")
            answer = self._answer(entry)
        if flush_now is not None:
            self._finish_layerwise(flush_now)
            with self._lock:
                answer = self._answer(flush_now)
        return answer

    # --- bookkeeping (lock held) ---------------------------------------------------------------

    def known(self, token: bytes) -> wire.PushReply | None:
        """The answer for a push of ``token`` this rank took (a PUSH or
        PUSH_REG sent again); None when it took none."""
        with self._lock:
            entry = self._pushes.get(token)
            return self._answer(entry) if entry is not None else None

    def _answer(self, entry: PushEntry) -> wire.PushReply:
        within = {RUNNING: self._write_timeout_s,
                  WAITING: max(0.0, entry.wait_until - self._clock()) + self._write_timeout_s}.get(entry.state, 0.0)
        return wire.PushReply(entry.state, entry.detail, within)

    def _remember(self, token: bytes, entry: PushEntry) -> None:
        self._pushes[token] = entry
        now = self._clock()
        while self._pushes:
            old = next(iter(self._pushes.values()))
            forget = len(self._pushes) > MAX_REMEMBERED or (
                old.resolved_at is not None and now - old.resolved_at > FORGET_AFTER_S)
            if not forget or old.state in (RUNNING, WAITING):
                break
            self._pushes.popitem(last=False)
            if old.call is not None:
                self._generations.discard((old.call.ref.generation, old.call.reader))

    def _record(self, entry: PushEntry) -> None:
        """``entry`` resolved: its per-request record."""
        if entry.call is not None:
            rid = str(entry.call.ref.request_id)
        else:
            rid = f"transfer:{entry.reg.transfer_id}" if entry.reg is not None else "?"
        end = entry.resolved_at if entry.resolved_at is not None else self._clock()
        self._records.append(PushRecord(request_id=rid, outcome=entry.state.value, nbytes=entry.nbytes,
                                        overlapped_nbytes=entry.overlapped_nbytes,
                                        total_s=max(0.0, end - entry.started_at)))

    def running(self) -> int:
        with self._lock:
            return sum(p.state in (RUNNING, WAITING) for p in self._pushes.values())

    def take_counters(self) -> PushCounters:
        """Push events since the last call."""
        with self._lock:
            return self._counts.take()

    def take_records(self) -> tuple[PushRecord, ...]:
        """Pushes resolved since the last call."""
        with self._lock:
            out = tuple(self._records)
            self._records.clear()
            return out

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts.add(name)

