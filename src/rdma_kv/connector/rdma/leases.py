"""The producer's lease table: which delayed blocks are held, for whom, until when.

Owns leases (request id -> block ids, epoch and generation, the owner's
claim and how many consumer ranks read it, expiry and lifetime), the
answers to a consumer's RENEW / CONFIRM / RELEASE and its read pins, and
the request ids ``get_finished`` reports in ``done_sending`` (the only way
a lease's blocks go back to the engine).

The guarantee: a CONFIRM answers HELD only to the lease's owner, and only
if its blocks were held, unreleased and unexpired, from its grant until
the answer; a lease that ended never comes back (GONE to every later call,
whoever asks), except to the retried CONFIRM of a reader whose first
CONFIRM released it while it lived. The rules behind it are specified in
``docs/rdma-connector.md``, "Leases and validate-after-read": the states
of one lease (issued, granted, claimed, ended) and the answer to every call
in each, readers (heterogeneous TP), tokens (UNKNOWN, FORGED,
``WRONG_TOKENS_PER_CALL``), read pins and a push's pin, the lifetime bound
(``max_s``) and ``reclaim``, and what an ended lease leaves behind. The
tests hold this table to that text (``tests/rdma/test_leases*.py``,
``tests/faults/test_lease_*.py``, ``tests/security/``).

Thread-safe (the side-channel threads and the engine thread share it).
Its records (a call, a lease, a claim, an ending, a tombstone) are
``leaserecords``, re-exported here where the producer's modules use them;
its pins are ``leasepins``, its memory of ended leases ``tombstones`` and
its reaper's heap of (expiry, generation), re-checked on pop so that
renewals in any order are handled, ``leaseheap``, each called under its
lock; the tokens a call's leases should carry are computed before the
lock, by ``leasetokens``. The held words (``heldwords``), when attached,
name each live lease in its blocks' words: written at the grant, taken out
at the ending, before the request can reach ``done_sending``.

Imports the standard library and the connector's ``params``, ``types``,
``rdma.leaserecords``, ``rdma.leasetokens``, ``rdma.leasepins``, ``rdma.tombstones``,
``rdma.leaseheap``, ``rdma.heldwords``, ``rdma.stats`` (its counters) and ``rdma.wire`` (for ``LeaseStatus``).
"""

from __future__ import annotations

import dataclasses
import hmac
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from rdma_kv.connector.rdma.heldwords import HeldWords
from rdma_kv.connector.rdma.leaseheap import ExpiryHeap
from rdma_kv.connector.rdma.leasepins import Pins
from rdma_kv.connector.rdma.leaserecords import Claim, Ending, Lease, LeaseCall
from rdma_kv.connector.rdma.leasetokens import WRONG_TOKENS_PER_CALL, expected_tokens
from rdma_kv.connector.rdma.params import LeaseRef, lease_token
from rdma_kv.connector.rdma.stats import LeaseCounters, Tally
from rdma_kv.connector.rdma.tombstones import Tombstones
from rdma_kv.connector.rdma.wire import LeaseStatus
from rdma_kv.connector.types import BlockId, GroupBlockIds, RequestId, as_group_block_ids

__all__ = ["WRONG_TOKENS_PER_CALL", "Ending", "Lease", "LeaseCall", "LeaseTable"]

MAX_EARLY = 1 << 14
"""Claims recorded on leases issued but not yet shipped here. Past this a new
one is answered PENDING without being recorded (the caller asks again)."""

HELD, PENDING, GONE, CLAIMED, UNKNOWN, FORGED = (
    LeaseStatus.HELD, LeaseStatus.PENDING, LeaseStatus.GONE, LeaseStatus.CLAIMED, LeaseStatus.UNKNOWN,
    LeaseStatus.FORGED)

PIN_RECHECK_S = 0.1
"""How soon a due lease that a push pins is looked at again."""


class LeaseTable:
    """Leases of one producer worker, each held at most ``max_s`` after its
    grant. ``clock`` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_s: float = 300.0,
                 pin_s: float = 10.0) -> None:
        if not max_s > 0:
            raise ValueError(f"a lease's max lifetime must be > 0 s, got {max_s}")
        if not pin_s >= 0:
            raise ValueError(f"a read pin's longest hold must be >= 0 s, got {pin_s}")
        self._clock = clock
        self.max_s = max_s
        self.pin_s = pin_s
        """The longest a read pin holds a lease (the producer's
        ``read_timeout_s``). 0: pins grant nothing (consumers CONFIRM)."""
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._key = b""
        self._max_generation = 0
        self._leases: dict[int, Lease] = {}  # generation -> lease
        self._heap = ExpiryHeap()
        self._done: set[RequestId] = set()
        self._ended = Tombstones()
        self._early: dict[int, Claim] = {}
        self._pins = Pins()
        self._counts = Tally(LeaseCounters)
        self._words: HeldWords | None = None

    def attach_words(self, words: HeldWords | None) -> None:
        """Keep ``words`` (``heldwords``) in step with the live leases from
        now on: each live lease's tag written into its blocks' words, and
        taken out before its request goes to ``done_sending``."""
        with self._lock:
            if words is not None:
                words.clear()
                for lease in self._leases.values():
                    words.hold_lease(lease.ref.token, lease.ref.binding, lease.block_ids)
            self._words = words

    # --- grants (from the producer scheduler, through step metadata) -------------

    def set_epoch(self, epoch: int, key: bytes) -> None:
        """The scheduler's epoch and lease key (every step's metadata). A new
        epoch is a new scheduler incarnation: every lease of the old one ends."""
        with self._lock:
            if self._epoch == epoch:
                return
            if self._words is not None:
                self._words.clear()  # before their blocks go back (done_sending)
            for lease in self._leases.values():
                self._done.add(lease.ref.request_id)
                self._counts.add(Ending.EPOCH.value)
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
            self._counts.add("granted")
            early = self._early.pop(ref.generation, None)
            if early is not None and early.all_released:
                # Every reader read, confirmed and released it before the grant got here.
                self._done.add(ref.request_id)
                self._bury(ref.generation, Ending.RELEASED, early)
                self._counts.add("released_early")
                return
            lease = Lease(ref, groups, ttl_s, min(now + ttl_s, now + self.max_s), now, now + self.max_s,
                          claim=early)
            self._leases[ref.generation] = lease
            self._heap.push(lease.expires_at, ref.generation)
            if self._words is not None:
                self._words.hold_lease(ref.token, ref.binding, groups)

    # --- consumer calls ----------------------------------------------------------------

    def _verify(self, ref: LeaseRef, expected: bytes | None = None) -> LeaseStatus | None:
        """None when the table may act on ``ref``; else the answer (lock
        held). ``expected``: its token, computed under the current key
        beforehand (``leasetokens``), else here."""
        if self._epoch is None:
            return PENDING  # no step metadata yet: nothing is known, nothing is recorded
        if ref.epoch != self._epoch:
            return GONE  # another incarnation of the producer
        if expected is None:
            expected = lease_token(self._key, ref.epoch, ref.generation, ref.request_id, ref.binding)
        if not hmac.compare_digest(expected, ref.token):
            lease = self._leases.get(ref.generation)
            if lease is not None and hmac.compare_digest(lease.ref.token, ref.token):
                # The token this table granted, presented with other blocks:
                # params edited to read what another request holds.
                self._counts.add("refused_forged")
                return FORGED
            self._counts.add("refused_unknown")
            return UNKNOWN
        return None

    def _early_claim(self, call: LeaseCall) -> Claim | LeaseStatus:
        """The claim on an issued, unshipped lease, made for ``call`` if there
        is none; CLAIMED if ``call`` is not its owner (lock held)."""
        early = self._early.get(call.ref.generation)
        if early is None:
            if len(self._early) >= MAX_EARLY:
                return PENDING
            early = self._early[call.ref.generation] = Claim(call.claim, call.readers)
        return early if self._admits(early, call) else CLAIMED

    def _owner(self, lease: Lease, call: LeaseCall) -> Claim | None:
        """The lease's owner, ``call``'s claim if it had none; None when
        ``call`` is not the owner's (lock held)."""
        if lease.claim is None:
            lease.claim = Claim(call.claim, call.readers)
        return lease.claim if self._admits(lease.claim, call) else None

    def _admits(self, claim: Claim, call: LeaseCall) -> bool:
        if claim.admits(call):
            return True
        # Another consumer's claim, or the owner's with another reader count
        # (its ranks disagree on who reads this producer rank): either way
        # the call must not count towards the owner's releases.
        self._counts.add("refused_claimed" if call.claim != claim.owner else "refused_readers")
        return False

    def renew(self, calls: Iterable[LeaseCall]) -> list[LeaseStatus]:
        """HELD (expiry pushed back, for every reader), PENDING (issued, not
        shipped: the TTL starts at the grant), GONE, CLAIMED or UNKNOWN."""
        self.expire()
        return self._each(calls, self._renew_one)

    def pin(self, calls: Iterable[LeaseCall]) -> tuple[list[LeaseStatus], float]:
        """A RENEW with ``pin``: the answers of :meth:`renew`, each HELD lease
        also pinned until ``min(now + pin_s, its expiry)`` (``leasepins``);
        and the shortest pin granted, in seconds from now (0 when no lease
        was HELD, or ``pin_s`` is 0)."""
        self.expire()
        granted: list[float] = []

        def pin_one(call: LeaseCall) -> LeaseStatus:
            status = self._renew_one(call)
            if status is not HELD:
                return status
            pinned_s = self._pins.read_pin(self._leases[call.ref.generation], self._clock(), self.pin_s)
            if pinned_s is None:
                # HELD, but not pinned now (pins closed, or a reclaim waits for
                # its earlier pin to end): the one pinned_s of the reply must
                # not cover it, so the whole batch is answered 0 and CONFIRMs.
                # Before, the batch's other leases set pinned_s, and this
                # lease's reader trusted reads landing after its blocks were
                # handed back (a second reader of the lease, pinning in a batch).
                granted.append(0.0)
                return status
            granted.append(pinned_s)
            self._counts.add("pinned")
            return status

        statuses = self._each(calls, pin_one)
        return statuses, min(granted, default=0.0)

    def close_pins(self) -> None:
        """Grant no read pin from now on (pins answer ``pinned_s`` 0: their
        consumers CONFIRM); the producer is about to unregister its KV cache."""
        with self._lock:
            self._pins.open = False

    def open_pins(self) -> None:
        with self._lock:
            self._pins.open = True

    def pinned_for(self) -> float:
        """Seconds until the last read pin of a live lease ends (0: none is pinned)."""
        with self._lock:
            now = self._clock()
            return max([lease.pinned_until - now for lease in self._leases.values()] + [0.0])

    def confirm(self, calls: Iterable[LeaseCall], release: bool) -> list[LeaseStatus]:
        """HELD iff the lease's blocks were held from its grant until now and
        the call is its owner's (claiming it if no one did); with ``release``
        the caller's reader is then released, and the lease ends once all its
        readers are. Expiry is applied first: a lease past its expiry is
        never confirmed."""
        self.expire()
        return self._each(calls, lambda call: self._confirm_one(call, release))

    def release(self, calls: Iterable[LeaseCall]) -> list[LeaseStatus]:
        """HELD (it was held; this reader is released, and the lease ended if
        it was the last), PENDING (issued, not shipped: it ends when its grant
        arrives, if all its readers released by then), GONE, CLAIMED or UNKNOWN."""
        return self._each(calls, self._release_one)

    def _each(self, calls: Iterable[LeaseCall], act: Callable[[LeaseCall], LeaseStatus]) -> list[LeaseStatus]:
        """``act`` on every call whose token verifies, under the lock. The
        tokens are computed before it is taken (an HMAC each: 4,096 leases
        of made-up tokens took 15 ms under the lock that the engine thread's
        ``take_done`` and step wait for), in order, and only up to the
        ``WRONG_TOKENS_PER_CALL``-th that does not verify: the leases after
        it are answered PENDING, unverified (``calls`` may build each
        :class:`LeaseCall` as it is read: ``producer.WireCalls``)."""
        if not isinstance(calls, Sequence):
            calls = list(calls)
        with self._lock:
            epoch, key = self._epoch, self._key
        examined, tokens = expected_tokens(calls, epoch, key)
        out = []
        with self._lock:
            if (self._epoch, self._key) != (epoch, key):
                tokens = [None] * len(examined)  # a new epoch meanwhile (sleep, wake): computed here again
            wrong = 0
            for call, expected in zip(examined, tokens):
                if wrong == WRONG_TOKENS_PER_CALL:
                    break  # (only after a new epoch: ``expected_tokens`` stopped here already otherwise)
                status = self._verify(call.ref, expected)
                if status is None:
                    out.append(act(call))
                else:
                    wrong += status is UNKNOWN or status is FORGED
                    out.append(status)
            if len(out) < len(calls):
                self._counts.add("unverified", len(calls) - len(out))
                out.extend([PENDING] * (len(calls) - len(out)))
        return out

    # Each ``_*_one`` sees a verified call, with the lock held, in one of
    # three places: a live lease, an ended one (a generation at or below the
    # highest granted), or an issued one not yet shipped here.

    def _renew_one(self, call: LeaseCall) -> LeaseStatus:
        lease = self._leases.get(call.ref.generation)
        if lease is not None:
            if self._owner(lease, call) is None:
                return CLAIMED
            # Never past its lifetime; the heap entry is re-checked on pop.
            lease.expires_at = min(self._clock() + lease.ttl_s, lease.ends_at)
            lease.renewals += 1
            self._counts.add("renewed")
            return HELD
        if call.ref.generation <= self._max_generation:
            return GONE
        early = self._early_claim(call)
        if isinstance(early, LeaseStatus):
            return early
        return GONE if early.all_released else PENDING

    def _confirm_one(self, call: LeaseCall, release: bool) -> LeaseStatus:
        status = self._confirm_status(call, release)
        self._counts.add("confirmed" if status is HELD else "refused_confirm")
        return status

    def _confirm_status(self, call: LeaseCall, release: bool) -> LeaseStatus:
        gen = call.ref.generation
        lease = self._leases.get(gen)
        if lease is not None:
            owner = self._owner(lease, call)
            if owner is None:
                return CLAIMED
            if release:
                self._release_reader(lease, owner, call.reader, confirmed=True)
            return HELD
        if gen <= self._max_generation:
            tomb = self._ended.get(gen)
            if tomb is not None and tomb.recognises(call):
                return HELD  # a releasing CONFIRM's retry: its reads preceded that CONFIRM
            return GONE
        # Issued, not shipped here: its blocks cannot have left the engine.
        early = self._early_claim(call)
        if isinstance(early, LeaseStatus):
            return early
        if early.all_released:  # ends when its grant arrives
            return HELD if call.reader in early.confirmed else GONE
        if release:
            early.release(call.reader, confirmed=True)
        return HELD

    def pin_for_push(self, call: LeaseCall) -> tuple[LeaseStatus, GroupBlockIds]:
        """Push mode: HELD and the lease's block ids, the lease now *pinned*
        (no expiry, lifetime bound or reclaim ends it until :meth:`unpin`:
        the producer is writing from its blocks, and they must not be
        reused under the write; ``leasepins``); else the refusal (PENDING:
        its grant has not reached this worker yet) and nothing pinned."""
        self.expire()
        with self._lock:
            status = self._verify(call.ref)
            if status is not None:
                return status, ()
            lease = self._leases.get(call.ref.generation)
            if lease is None:
                return (GONE if call.ref.generation <= self._max_generation else PENDING), ()
            if self._owner(lease, call) is None:
                return CLAIMED, ()
            self._pins.push(call.ref.generation)
            return HELD, lease.block_ids

    def unpin(self, generation: int) -> None:
        """A push from lease ``generation`` resolved. Pins are counted (one per
        push: ``leasepins``); at the last unpin the lease may end again: an
        expiry that fell due meanwhile applies at the next reap, a release
        of its last reader now."""
        with self._lock:
            if not self._pins.unpush(generation):
                return
            lease = self._leases.get(generation)
            if lease is not None and lease.claim is not None and lease.claim.all_released:
                self._end(generation, Ending.RELEASED)

    def _release_one(self, call: LeaseCall) -> LeaseStatus:
        gen = call.ref.generation
        lease = self._leases.get(gen)
        if lease is not None:
            owner = self._owner(lease, call)
            if owner is None:
                return CLAIMED
            self._release_reader(lease, owner, call.reader, confirmed=False)
            return HELD
        if gen <= self._max_generation:
            return GONE
        early = self._early_claim(call)
        if isinstance(early, LeaseStatus):
            return early
        early.release(call.reader, confirmed=False)
        return PENDING

    def _release_reader(self, lease: Lease, owner: Claim, reader: int, confirmed: bool) -> None:
        """Reader ``reader`` of a live lease is done with it; the last ends it."""
        if reader not in owner.released:
            self._counts.add("reader_released")
        owner.release(reader, confirmed)
        if owner.all_released and not self._pins.pushing(lease.ref.generation):  # else at the last unpin
            self._end(lease.ref.generation, Ending.RELEASED)

    def _end(self, generation: int, how: Ending) -> None:
        lease = self._leases.pop(generation)
        self._pins.ended(generation)
        if self._words is not None:
            self._words.drop_lease(lease.ref.token, lease.ref.binding, lease.block_ids)  # before the blocks go back
        self._done.add(lease.ref.request_id)
        self._bury(generation, how, lease.claim)
        self._heap.compact(self._leases)  # entries of leases that ended before their expiry

    def _bury(self, generation: int, how: Ending, claim: Claim | None) -> None:
        self._ended.bury(generation, how, claim)
        self._counts.add(how.value)

    # --- reaper and done_sending --------------------------------------------------------

    def expire(self, now: float | None = None) -> list[RequestId]:
        """End every lease past its expiry; returns their request ids."""
        now = self._clock() if now is None else now
        expired = []
        with self._lock:
            while (generation := self._heap.pop_due(now)) is not None:
                lease = self._leases.get(generation)
                if lease is None:
                    continue  # ended earlier
                if self._pins.reclaim_due(lease, now):
                    self._end(generation, Ending.RECLAIMED)  # reclaimed while its read pin held it
                    expired.append(lease.ref.request_id)
                    continue
                if lease.expires_at > now:  # renewed since this entry was pushed
                    self._heap.push(lease.expires_at, generation)
                    continue
                if self._pins.pushing(generation):  # a push writes from it: look again shortly
                    self._heap.push(now + PIN_RECHECK_S, generation)
                    continue
                # Its last renewal was cut short by the lifetime bound: that, not the TTL, ended it.
                how = Ending.LIFETIME if lease.expires_at >= lease.ends_at else Ending.EXPIRED
                if how is Ending.EXPIRED and lease.claim is None:
                    self._counts.add("expired_unclaimed")  # no consumer came in time (not: its renewals stopped)
                self._end(generation, how)
                expired.append(lease.ref.request_id)
        return expired

    def end_all(self, how: Ending) -> list[RequestId]:
        """End every live lease now (GONE to every later call); returns their
        request ids, which ``take_done`` reports."""
        with self._lock:
            ended = [lease.ref.request_id for lease in self._leases.values()]
            for generation in list(self._leases):
                self._end(generation, how)
        return ended

    def discard(self, request_id: RequestId) -> None:
        """A grant of an epoch already replaced (issued before a wake from
        sleep, shipped after): never held; ``take_done`` reports it so the
        engine frees its blocks (calls naming it answer GONE: another epoch)."""
        with self._lock:
            self._done.add(request_id)
            self._counts.add(Ending.EPOCH.value)

    def reclaim(self, generations: Iterable[int]) -> list[RequestId]:
        """End the live leases among ``generations`` now (the producer's
        scheduler frees their blocks for new prefills); returns their
        request ids. Generations not live (ended, or not granted here) or
        written from by a push are passed over; one a consumer reads under a
        read pin ends when its pin does (``expire``)."""
        ended = []
        with self._lock:
            for generation in generations:
                lease = self._leases.get(generation)
                if lease is None or self._pins.pushing(generation):  # a push's pin ends when its push does
                    continue
                if lease.pinned_until > self._clock():  # a consumer reads it under a pin: end it after
                    if self._pins.reclaim_after_pin(generation):
                        self._counts.add("reclaim_after_pin")
                        self._heap.push(lease.pinned_until, generation)
                    continue
                self._end(generation, Ending.RECLAIMED)
                ended.append(lease.ref.request_id)
        return ended

    def take_done(self) -> set[RequestId]:
        """Requests whose lease ended since the last call (done_sending)."""
        self.expire()
        with self._lock:
            done, self._done = self._done, set()
            return done

    # --- introspection (stats, leak checks) -------------------------------------------------

    @property
    def stats(self) -> LeaseCounters:
        """What happened to this table's leases so far."""
        with self._lock:
            return self._counts.snapshot()

    def take_counters(self) -> LeaseCounters:
        """What happened to this table's leases since the last call."""
        with self._lock:
            return self._counts.take()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def live(self, leases: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
        """Which of these (epoch, generation) leases are live here, under one
        taking of the lock (the side channel's trust without a secret checks
        a batch at a time)."""
        with self._lock:
            return {(epoch, generation) for epoch, generation in leases
                    if epoch == self._epoch and generation in self._leases}

    def oldest_age_s(self) -> float:
        """Seconds since the grant of the oldest live lease (0 with none)."""
        with self._lock:
            if not self._leases:
                return 0.0
            return self._clock() - min(lease.granted_at for lease in self._leases.values())

    def heap_size(self) -> int:
        """Entries in the expiry heap (live leases plus bounded stale ones)."""
        with self._lock:
            return len(self._heap)

    def held_block_ids(self) -> set[BlockId]:
        with self._lock:
            return {b for lease in self._leases.values() for group in lease.block_ids for b in group}

    def leases(self) -> list[Lease]:
        with self._lock:
            return [dataclasses.replace(lease, claim=lease.claim and lease.claim.copy())
                    for lease in self._leases.values()]
