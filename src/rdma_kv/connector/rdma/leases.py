"""The producer's lease table: which delayed blocks are held for which consumer.

Owns leases (request id -> block ids, epoch and generation, expiry), their
renewal, release and expiry, the answers to a consumer's RENEW / CONFIRM /
RELEASE, and the request ids ``get_finished`` reports in ``done_sending``.

Why leases and generations. A producer that frees delayed blocks on a timer
while a consumer still reads them hands the consumer reused memory, and the
consumer decodes garbage with confidence. Here blocks stay held while the
consumer renews; a consumer that disappears stops renewing, the lease
expires and the blocks free (nothing stranded). And because the lease is
removed from this table *before* its request is reported in
``done_sending`` (the only way its blocks return to the engine), a CONFIRM
that finds the lease HELD after the consumer's reads completed proves the
blocks were never reused during those reads. A late CONFIRM of an expired
lease finds it GONE: the consumer reports a load error instead of
corrupting.

Generations come from the producer's scheduler (``request_finished``),
monotonically within an epoch (random per scheduler process). A generation
above the highest this table has seen is PENDING (granted, not yet shipped
to this worker); at or below it, and not held, it is GONE. An epoch other
than the scheduler's current one is GONE (a restarted producer never
confirms a lease of its previous life).

A grant reaches this table only with the producer engine's *next* step,
and an engine may not step again for a long time (vLLM stops stepping when
no request is left: the last prefill's grant waits for the next request).
So a CONFIRM of a PENDING lease (epoch known) answers HELD: its blocks can
only return to the engine through this table's ``done_sending``, which a
lease not yet granted here never reached, so they are still held. A CONFIRM
with release, or a RELEASE, of a PENDING lease is remembered (bounded), and
its grant, when it arrives, ends at once (``done_sending`` in that step).
RENEW of a PENDING lease stays PENDING: the TTL starts at the grant.

The reaper keeps a heap of (expiry, generation) and re-checks the live
expiry on pop, so renewals in any order are handled: it never assumes
sorted expiries.

Thread-safe (the side-channel threads and the engine thread share it).
Imports the standard library and the connector's ``params``, ``types`` and
``rdma.wire`` (for ``LeaseStatus``).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from rdma_kv.connector.rdma.params import LeaseRef
from rdma_kv.connector.rdma.wire import LeaseStatus
from rdma_kv.connector.types import BlockId, RequestId

__all__ = ["Lease", "LeaseTable"]

_RECENT_CONFIRMED = 8192


@dataclasses.dataclass
class Lease:
    ref: LeaseRef
    block_ids: tuple[BlockId, ...]
    ttl_s: float
    expires_at: float
    renewals: int = 0


class LeaseTable:
    """Leases of one producer worker. ``clock`` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._max_generation = 0
        self._leases: dict[int, Lease] = {}  # generation -> lease
        self._heap: list[tuple[float, int]] = []
        self._done: set[RequestId] = set()
        # Leases released by a CONFIRM(release=True): a retried CONFIRM whose
        # first reply was lost must still read HELD (the reads it covers
        # completed before the first CONFIRM was sent).
        self._confirmed = collections.OrderedDict[int, RequestId]()
        # PENDING leases a consumer confirmed-and-released or released before
        # their grant arrived: the grant ends them at once. Bounded: a lease
        # forgotten here is held until its TTL instead (slower, never unsafe).
        self._released_early = collections.OrderedDict[int, RequestId]()
        self.stats = collections.Counter[str]()

    # --- grants (from the producer scheduler, through step metadata) -------------

    def set_epoch(self, epoch: int) -> None:
        with self._lock:
            if self._epoch != epoch:
                if self._epoch is not None:
                    # A new scheduler incarnation: nothing it did not grant is held.
                    for lease in self._leases.values():
                        self._done.add(lease.ref.request_id)
                    self._leases.clear()
                    self._heap.clear()
                    self._confirmed.clear()
                    self._released_early.clear()
                    self._max_generation = 0
                self._epoch = epoch

    def grant(self, ref: LeaseRef, block_ids: Sequence[BlockId], ttl_s: float) -> None:
        now = self._clock()
        with self._lock:
            if self._epoch is None:
                self._epoch = ref.epoch
            if ref.epoch != self._epoch:
                raise ValueError(f"lease {ref} is of epoch {ref.epoch}, table epoch {self._epoch}")
            self._max_generation = max(self._max_generation, ref.generation)
            if self._released_early.pop(ref.generation, None) == ref.request_id:
                self._done.add(ref.request_id)  # read and released before it was shipped here
                self.stats["granted"] += 1
                self.stats["released_early"] += 1
                return
            lease = Lease(ref, tuple(block_ids), ttl_s, now + ttl_s)
            self._leases[ref.generation] = lease
            heapq.heappush(self._heap, (lease.expires_at, ref.generation))
            self.stats["granted"] += 1

    # --- consumer RPCs ---------------------------------------------------------------

    def _status(self, ref: LeaseRef) -> LeaseStatus:
        if self._epoch is None:
            return LeaseStatus.PENDING
        if ref.epoch != self._epoch:
            return LeaseStatus.GONE
        lease = self._leases.get(ref.generation)
        if lease is not None:
            return LeaseStatus.HELD if lease.ref.request_id == ref.request_id else LeaseStatus.GONE
        if ref.generation > self._max_generation:
            return LeaseStatus.PENDING
        return LeaseStatus.GONE

    def renew(self, refs: Iterable[LeaseRef]) -> list[LeaseStatus]:
        now = self._clock()
        out = []
        with self._lock:
            for ref in refs:
                status = self._status(ref)
                if status is LeaseStatus.HELD:
                    lease = self._leases[ref.generation]
                    lease.expires_at = now + lease.ttl_s  # the heap entry is re-checked on pop
                    lease.renewals += 1
                    self.stats["renewed"] += 1
                out.append(status)
        return out

    def confirm(self, refs: Iterable[LeaseRef], release: bool) -> list[LeaseStatus]:
        """HELD iff the lease is held now (hence was, since it was granted),
        or granted and not yet shipped here (its blocks never left the engine).
        Expiry is applied first: a lease past its expiry is never confirmed."""
        self.expire()
        out = []
        with self._lock:
            for ref in refs:
                status = self._status(ref)
                if status is LeaseStatus.GONE and self._confirmed.get(ref.generation) == ref.request_id \
                        and ref.epoch == self._epoch:
                    status = LeaseStatus.HELD  # a retry of a CONFIRM that already released it
                elif status is LeaseStatus.PENDING and self._epoch is not None:
                    status = LeaseStatus.HELD  # granted, not shipped: still held (module docstring)
                    if release:
                        self._confirmed[ref.generation] = ref.request_id  # retries read HELD
                        self._release_early(ref)
                elif status is LeaseStatus.HELD and release:
                    self._end(ref.generation, "released")
                    self._confirmed[ref.generation] = ref.request_id
                    while len(self._confirmed) > _RECENT_CONFIRMED:
                        self._confirmed.popitem(last=False)
                self.stats["confirmed" if status is LeaseStatus.HELD else "refused_confirm"] += 1
                out.append(status)
        return out

    def release(self, refs: Iterable[LeaseRef]) -> list[LeaseStatus]:
        out = []
        with self._lock:
            for ref in refs:
                status = self._status(ref)
                if status is LeaseStatus.HELD:
                    self._end(ref.generation, "released")
                elif status is LeaseStatus.PENDING and self._epoch is not None:
                    self._release_early(ref)
                out.append(status)
        return out

    def _release_early(self, ref: LeaseRef) -> None:
        """Remember a PENDING lease released before its grant (lock held)."""
        self._released_early[ref.generation] = ref.request_id
        for recent in (self._confirmed, self._released_early):
            while len(recent) > _RECENT_CONFIRMED:
                recent.popitem(last=False)

    def _end(self, generation: int, why: str) -> None:
        lease = self._leases.pop(generation)
        self._done.add(lease.ref.request_id)
        self.stats[why] += 1

    # --- reaper and done_sending --------------------------------------------------------

    def expire(self, now: float | None = None) -> list[RequestId]:
        """End every lease past its expiry; returns their request ids."""
        now = self._clock() if now is None else now
        expired = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, generation = heapq.heappop(self._heap)
                lease = self._leases.get(generation)
                if lease is None:
                    continue  # released earlier
                if lease.expires_at > now:  # renewed since this entry was pushed
                    heapq.heappush(self._heap, (lease.expires_at, generation))
                    continue
                self._end(generation, "expired")
                expired.append(lease.ref.request_id)
        return expired

    def take_done(self) -> set[RequestId]:
        """Requests whose lease ended since the last call (done_sending)."""
        self.expire()
        with self._lock:
            done, self._done = self._done, set()
            return done

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((lease.expires_at for lease in self._leases.values()), default=None)

    # --- introspection (stats, leak checks) -------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def held_block_ids(self) -> set[BlockId]:
        with self._lock:
            return {b for lease in self._leases.values() for b in lease.block_ids}

    def leases(self) -> list[Lease]:
        with self._lock:
            return [dataclasses.replace(lease) for lease in self._leases.values()]
