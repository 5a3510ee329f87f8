"""The producer's lease table: which delayed blocks are held, for whom, until when.

Owns leases (request id -> block ids, epoch and generation, owner, expiry),
the answers to a consumer's RENEW / CONFIRM / RELEASE, and the request ids
``get_finished`` reports in ``done_sending`` (the only way a lease's blocks
go back to the engine).

What HELD means. A CONFIRM answers HELD to a claimant only if the lease's
blocks were held, unreleased and unexpired, from its grant until this
answer; a consumer that posted its reads after it was handed the lease and
confirms after they completed therefore read blocks no one reused. Once a
lease ends (released, expired, or its epoch replaced) it never comes back:
every later CONFIRM or RENEW answers GONE, whoever asks, except the one
retry this table recognises, the releasing CONFIRM's own claimant asking
again (its reads completed before that first CONFIRM was sent).

The state machine of one lease (``docs/rdma-connector.md`` draws it):

- *issued*: the producer scheduler's ``request_finished`` created it (epoch,
  generation, request id and a token, ``params.lease_token``) and the engine
  holds its blocks (``delay_free``). Its grant reaches this table only with
  the engine's next step, which may be long coming (vLLM stops stepping
  when no request is left), so a lease whose token verifies under the
  epoch's key and whose generation this table has not seen is known to be
  held: its blocks can only leave through this table's ``done_sending``.
- *granted*: in the table, unclaimed; the TTL runs from the grant.
- *claimed*: the first RENEW, CONFIRM or RELEASE that names it with a valid
  token records the caller's claim key as its owner (a claim may arrive
  while the lease is only issued; the grant then keeps it). From then on
  only the owner may renew, confirm or release it; anyone else gets CLAIMED
  and changes nothing. A router that retries the same params on another
  decode engine, or an engine that loads them twice, is refused instead of
  reading blocks the first loader may already have released.
- *ended*: released by its owner (RELEASE, or CONFIRM with ``release``),
  expired (no renewal within the TTL), or ended by a new epoch. A tombstone
  remembers how (bounded; a generation this table has seen but no longer
  remembers is GONE too).

A call naming a lease whose token does not verify is refused (UNKNOWN) and
records nothing, so nobody can claim, release or renew a lease they were
not handed. A call before this worker knows its epoch answers PENDING.

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
import enum
import heapq
import hmac
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from rdma_kv.connector.rdma.params import LeaseRef, lease_token
from rdma_kv.connector.rdma.wire import LeaseStatus
from rdma_kv.connector.types import BlockId, GroupBlockIds, RequestId, as_group_block_ids

__all__ = ["Lease", "LeaseCall", "LeaseTable"]

MAX_TOMBSTONES = 1 << 16
"""Ended leases remembered (a few hundred bytes each). A forgotten one is GONE
to everyone, its owner's retried CONFIRM included: a load error, never a lie."""
MAX_EARLY = 1 << 14
"""Claims recorded on leases issued but not yet shipped here. Past this a new
one is answered PENDING without being recorded (the caller asks again)."""

HELD, PENDING, GONE, CLAIMED, UNKNOWN = (LeaseStatus.HELD, LeaseStatus.PENDING, LeaseStatus.GONE,
                                         LeaseStatus.CLAIMED, LeaseStatus.UNKNOWN)


@dataclasses.dataclass(frozen=True)
class LeaseCall:
    """One lease named in a RENEW, CONFIRM or RELEASE, with the caller's claim."""

    ref: LeaseRef
    claim: bytes = dataclasses.field(repr=False)


class Ending(enum.Enum):
    RELEASED = "released"
    EXPIRED = "expired"
    EPOCH = "epoch"


@dataclasses.dataclass
class Lease:
    ref: LeaseRef
    block_ids: GroupBlockIds
    """Per KV-cache group (one group: ``((ids...),)``)."""
    ttl_s: float
    expires_at: float
    owner: bytes | None = dataclasses.field(default=None, repr=False)
    renewals: int = 0


@dataclasses.dataclass(frozen=True)
class _Tombstone:
    how: Ending
    confirmed_by: bytes | None = dataclasses.field(default=None, repr=False)
    """The claim whose CONFIRM released the lease: its retries read HELD."""


@dataclasses.dataclass
class _Early:
    """A claim on a lease issued but not yet shipped here."""

    owner: bytes = dataclasses.field(repr=False)
    released: bool = False
    confirmed: bool = False


class LeaseTable:
    """Leases of one producer worker. ``clock`` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._key = b""
        self._max_generation = 0
        self._leases: dict[int, Lease] = {}  # generation -> lease
        self._heap: list[tuple[float, int]] = []
        self._done: set[RequestId] = set()
        self._ended = collections.OrderedDict[int, _Tombstone]()
        self._early: dict[int, _Early] = {}
        self.stats = collections.Counter[str]()

    # --- grants (from the producer scheduler, through step metadata) -------------

    def set_epoch(self, epoch: int, key: bytes) -> None:
        """The scheduler's epoch and lease key (every step's metadata). A new
        epoch is a new scheduler incarnation: every lease of the old one ends."""
        with self._lock:
            if self._epoch == epoch:
                return
            for lease in self._leases.values():
                self._done.add(lease.ref.request_id)
                self.stats[Ending.EPOCH.value] += 1
            self._leases.clear()
            self._heap.clear()
            self._ended.clear()
            self._early.clear()
            self._max_generation = 0
            self._epoch, self._key = epoch, key

    def grant(self, ref: LeaseRef, block_ids: Sequence[BlockId] | Sequence[Sequence[BlockId]],
              ttl_s: float) -> None:
        """Hold ``block_ids`` (per group, or a flat sequence for one group)
        under ``ref`` for ``ttl_s`` unless renewed."""
        groups = as_group_block_ids(block_ids)
        now = self._clock()
        with self._lock:
            if ref.epoch != self._epoch:
                raise ValueError(f"lease {ref} is of epoch {ref.epoch}, table epoch {self._epoch}")
            if ref.generation in self._leases or ref.generation in self._ended:
                raise ValueError(f"lease {ref} was granted already")
            self._max_generation = max(self._max_generation, ref.generation)
            self.stats["granted"] += 1
            early = self._early.pop(ref.generation, None)
            lease = Lease(ref, groups, ttl_s, now + ttl_s,
                          owner=early.owner if early is not None else None)
            if early is not None and early.released:
                # Its owner read, confirmed and released it before the grant got here.
                self._done.add(ref.request_id)
                self._bury(ref.generation, Ending.RELEASED, early.owner if early.confirmed else None)
                self.stats["released_early"] += 1
                return
            self._leases[ref.generation] = lease
            heapq.heappush(self._heap, (lease.expires_at, ref.generation))

    # --- consumer calls ----------------------------------------------------------------

    def _verify(self, ref: LeaseRef) -> LeaseStatus | None:
        """None when the table may act on ``ref``; else the answer (lock held)."""
        if self._epoch is None:
            return PENDING  # no step metadata yet: nothing is known, nothing is recorded
        if ref.epoch != self._epoch:
            return GONE  # another incarnation of the producer
        expected = lease_token(self._key, ref.epoch, ref.generation, ref.request_id)
        if not hmac.compare_digest(expected, ref.token):
            self.stats["refused_unknown"] += 1
            return UNKNOWN
        return None

    def _early_claim(self, call: LeaseCall) -> _Early | LeaseStatus:
        """The claim record of an issued, unshipped lease, made for ``call``
        if there is none (lock held)."""
        early = self._early.get(call.ref.generation)
        if early is None:
            if len(self._early) >= MAX_EARLY:
                return PENDING
            early = self._early[call.ref.generation] = _Early(call.claim)
        if early.owner != call.claim:
            self.stats["refused_claimed"] += 1
            return CLAIMED
        return early

    def _claim(self, lease: Lease, claim: bytes) -> bool:
        """Own an unclaimed lease; True when ``claim`` owns it (lock held)."""
        if lease.owner is None:
            lease.owner = claim
        if lease.owner != claim:
            self.stats["refused_claimed"] += 1
            return False
        return True

    def renew(self, calls: Iterable[LeaseCall]) -> list[LeaseStatus]:
        """HELD (expiry pushed back), PENDING (issued, not shipped: the TTL
        starts at the grant), GONE, CLAIMED or UNKNOWN."""
        self.expire()
        return self._each(calls, self._renew_one)

    def confirm(self, calls: Iterable[LeaseCall], release: bool) -> list[LeaseStatus]:
        """HELD iff the lease's blocks were held from its grant until now and
        ``claim`` owns it (claiming it if no one did); with ``release`` the
        lease then ends. Expiry is applied first: a lease past its expiry is
        never confirmed."""
        self.expire()
        return self._each(calls, lambda call: self._confirm_one(call, release))

    def release(self, calls: Iterable[LeaseCall]) -> list[LeaseStatus]:
        """HELD (it was held; now released), PENDING (issued, not shipped: it
        ends when its grant arrives), GONE, CLAIMED or UNKNOWN."""
        return self._each(calls, self._release_one)

    def _each(self, calls: Iterable[LeaseCall], act: Callable[[LeaseCall], LeaseStatus]) -> list[LeaseStatus]:
        """``act`` on every call whose token verifies, under the lock."""
        out = []
        with self._lock:
            for call in calls:
                status = self._verify(call.ref)
                out.append(act(call) if status is None else status)
        return out

    # Each ``_*_one`` sees a verified call, with the lock held, in one of
    # three places: a live lease, an ended one (a generation at or below the
    # highest granted), or an issued one not yet shipped here.

    def _renew_one(self, call: LeaseCall) -> LeaseStatus:
        lease = self._leases.get(call.ref.generation)
        if lease is not None:
            if not self._claim(lease, call.claim):
                return CLAIMED
            lease.expires_at = self._clock() + lease.ttl_s  # the heap entry is re-checked on pop
            lease.renewals += 1
            self.stats["renewed"] += 1
            return HELD
        if call.ref.generation <= self._max_generation:
            return GONE
        early = self._early_claim(call)
        if isinstance(early, LeaseStatus):
            return early
        return GONE if early.released else PENDING

    def _confirm_one(self, call: LeaseCall, release: bool) -> LeaseStatus:
        status = self._confirm_status(call, release)
        self.stats["confirmed" if status is HELD else "refused_confirm"] += 1
        return status

    def _confirm_status(self, call: LeaseCall, release: bool) -> LeaseStatus:
        gen = call.ref.generation
        lease = self._leases.get(gen)
        if lease is not None:
            if not self._claim(lease, call.claim):
                return CLAIMED
            if release:
                self._end(gen, Ending.RELEASED, confirmed_by=call.claim)
            return HELD
        if gen <= self._max_generation:
            tomb = self._ended.get(gen)
            if tomb is not None and tomb.confirmed_by is not None and tomb.confirmed_by == call.claim:
                return HELD  # the releasing CONFIRM's retry: its reads preceded that CONFIRM
            return GONE
        # Issued, not shipped here: its blocks cannot have left the engine.
        early = self._early_claim(call)
        if isinstance(early, LeaseStatus):
            return early
        if early.released:
            return HELD if early.confirmed else GONE
        if release:
            early.released = early.confirmed = True
        return HELD

    def _release_one(self, call: LeaseCall) -> LeaseStatus:
        gen = call.ref.generation
        lease = self._leases.get(gen)
        if lease is not None:
            if not self._claim(lease, call.claim):
                return CLAIMED
            self._end(gen, Ending.RELEASED)
            return HELD
        if gen <= self._max_generation:
            return GONE
        early = self._early_claim(call)
        if isinstance(early, LeaseStatus):
            return early
        early.released = True
        return PENDING

    def _end(self, generation: int, how: Ending, confirmed_by: bytes | None = None) -> None:
        lease = self._leases.pop(generation)
        self._done.add(lease.ref.request_id)
        self._bury(generation, how, confirmed_by)

    def _bury(self, generation: int, how: Ending, confirmed_by: bytes | None) -> None:
        self._ended[generation] = _Tombstone(how, confirmed_by)
        while len(self._ended) > MAX_TOMBSTONES:
            self._ended.popitem(last=False)
        self.stats[how.value] += 1

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
                    continue  # ended earlier
                if lease.expires_at > now:  # renewed since this entry was pushed
                    heapq.heappush(self._heap, (lease.expires_at, generation))
                    continue
                self._end(generation, Ending.EXPIRED)
                expired.append(lease.ref.request_id)
        return expired

    def take_done(self) -> set[RequestId]:
        """Requests whose lease ended since the last call (done_sending)."""
        self.expire()
        with self._lock:
            done, self._done = self._done, set()
            return done

    # --- introspection (stats, leak checks) -------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def held_block_ids(self) -> set[BlockId]:
        with self._lock:
            return {b for lease in self._leases.values() for group in lease.block_ids for b in group}

    def leases(self) -> list[Lease]:
        with self._lock:
            return [dataclasses.replace(lease) for lease in self._leases.values()]
