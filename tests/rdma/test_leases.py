"""The producer's lease table: grant, claim, renew, confirm, release, expiry,
tombstones, several readers of one lease (no UCX, no sockets). The
property-based model of the whole life of leases is test_lease_model.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from leaseutil import A, B, C, CLAIMED, EPOCH, FORGED, GONE, HELD, KEY, PENDING, UNKNOWN, Clock, call, rcall, ref, state, table_with
from rdma_kv.connector.rdma import leases as leases_mod
from rdma_kv.connector.rdma import leasetokens as leasetokens_mod
from rdma_kv.connector.rdma import tombstones as tombstones_mod
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.leaseheap import HEAP_SLACK
from rdma_kv.connector.rdma.leases import LeaseCall, LeaseTable
from rdma_kv.connector.rdma.params import LeaseRef, lease_token
from rdma_kv.errors import MetadataError


def test_the_reported_attack_a_second_reader_after_release_is_gone():
    # The reproduction: confirmed and released, blocks handed back and
    # reused; a second CONFIRM of the same lease by another reader is GONE.
    table = table_with(1)
    assert table.confirm(call(1, A), release=True) == [HELD]
    assert table.take_done() == {"r1"}
    assert table.confirm(call(1, B), release=True) == [GONE]
    assert table.renew(call(1, B)) == [GONE]
    assert table.confirm(call(1, A), release=True) == [HELD]  # the releasing CONFIRM's own retry
    assert table.renew(call(1, A)) == [GONE]  # ended for good: even its owner cannot renew it
    assert table.confirm(call(1, A), release=False) == [HELD]  # (a retry is a retry either way)


def test_the_first_claim_owns_the_lease():
    table = table_with(1)
    before = None
    assert table.renew(call(1, A)) == [HELD]
    before = state(table)
    assert table.renew(call(1, B)) == [CLAIMED]
    assert table.confirm(call(1, B), release=True) == [CLAIMED]
    assert table.release(call(1, B)) == [CLAIMED]
    assert state(table) == before, "a refused claimant changed the lease"
    assert table.confirm(call(1, A), release=True) == [HELD]
    assert table.take_done() == {"r1"}


def test_a_confirm_claims_an_unclaimed_lease():
    table = table_with(1)
    assert table.confirm(call(1, B), release=False) == [HELD]
    assert table.renew(call(1, A)) == [CLAIMED]  # the router's retry elsewhere is refused


def test_a_lease_never_granted_is_refused_and_nothing_recorded():
    table = table_with(1)
    before = state(table)
    forged = [LeaseCall(LeaseRef(EPOCH, 2, "r2", b"\x01" * 16, ref(2).binding), C)]  # the next generation
    assert table.confirm(forged, release=True) == [UNKNOWN]
    assert table.release(forged) == [UNKNOWN]
    assert table.renew(forged) == [UNKNOWN]
    wrong_rid = [LeaseCall(LeaseRef(EPOCH, 1, "other", ref(1).token, ref(1).binding), C)]
    assert table.confirm(wrong_rid, release=True) == [FORGED]  # lease 1's genuine token, altered params
    assert state(table) == before
    # the real lease 2, when its grant arrives, is unaffected
    table.grant(ref(2), [5], 10.0)
    assert table.confirm(call(2, A), release=True) == [HELD]
    assert table.take_done() == {"r2"}


def test_the_advance_release_attack_is_refused():
    # A peer that knows the epoch, the next generation and the request id
    # releases the lease before its grant: without the token it cannot.
    table = table_with(1)
    bound = ref(2).binding
    guess = [LeaseCall(LeaseRef(EPOCH, 2, "victim", lease_token(b"x" * 32, EPOCH, 2, "victim", bound), bound), C)]
    assert table.confirm(guess, release=True) == [UNKNOWN]
    table.grant(ref(2, rid="victim"), [20, 21], 10.0)
    assert table.take_done() == set(), "the victim's blocks were freed at their grant"
    assert table.confirm(call(2, A, rid="victim"), release=True) == [HELD]


def test_an_issued_lease_not_yet_shipped_can_be_claimed_confirmed_and_released_by_its_owner():
    # vLLM stops stepping when no request is left, so the last prefill's grant
    # reaches the worker only with the next request: its consumer must be able
    # to confirm and release the lease before that (docs/vllm-notes.md, 4).
    table = table_with(1)
    assert table.renew(call(2, A)) == [PENDING]  # claimed: the TTL starts at the grant
    assert table.confirm(call(2, B), release=True) == [CLAIMED]
    assert table.confirm(call(2, A), release=True) == [HELD]  # its blocks never left the engine
    assert table.confirm(call(2, A), release=True) == [HELD]  # a retry
    assert table.confirm(call(2, C), release=True) == [CLAIMED]
    assert table.release(call(3, B)) == [PENDING]  # released unread before its grant
    assert table.renew(call(3, B)) == [GONE]
    assert table.take_done() == set()
    for gen in (2, 3):
        table.grant(ref(gen), [gen], 10.0)
    assert table.take_done() == {"r2", "r3"} and len(table) == 1
    assert table.confirm(call(2, A), release=True) == [HELD]  # retry after the grant
    assert table.confirm(call(2, B), release=True) == [GONE]
    assert table.confirm(call(3, B), release=True) == [GONE]  # released without a confirm


def test_a_claim_made_before_the_grant_survives_it():
    table = table_with()
    assert table.renew(call(1, A)) == [PENDING]
    table.grant(ref(1), [1], 10.0)
    assert table.confirm(call(1, B), release=True) == [CLAIMED]
    assert table.confirm(call(1, A), release=True) == [HELD]


def test_before_its_epoch_is_known_nothing_is_answered_or_recorded():
    table = LeaseTable(Clock())
    assert table.confirm(call(1), release=True) == [PENDING]
    assert table.release(call(1)) == [PENDING]
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(1), [1], 10.0)
    assert table.take_done() == set() and len(table) == 1


def test_another_epoch_is_gone_and_a_new_epoch_ends_every_lease():
    table = table_with(1, 2)
    assert table.confirm(call(1, epoch=8), release=False) == [GONE]  # a restarted producer's
    table.set_epoch(9, b"n" * 32)
    assert table.take_done() == {"r1", "r2"} and len(table) == 0
    assert table.confirm(call(1), release=True) == [GONE]


def test_expiry_is_applied_before_a_confirm_and_is_final():
    clock = Clock()
    table = table_with(1, ttl_s=1.0, clock=clock)
    assert table.renew(call(1, A)) == [HELD]
    clock.t += 1.5  # the consumer's reads were slow; nobody reaped yet
    assert table.confirm(call(1, A), release=True) == [GONE]
    assert table.renew(call(1, A)) == [GONE]
    assert table.take_done() == {"r1"} and table.held_block_ids() == set()


def test_reaper_does_not_assume_sorted_expiries():
    clock = Clock()
    table = LeaseTable(clock)
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(1), [1], 10.0)  # expires 1010
    table.grant(ref(2), [2], 2.0)  # expires 1002: after 1 in grant order
    table.grant(ref(3), [3], 5.0)
    clock.t = 1004
    assert table.renew(call(3)) == [HELD]  # now expires 1009; expiry ran first
    assert table.take_done() == {"r2"}
    clock.t = 1008.5
    assert table.expire() == []  # 3 was renewed; its old heap entry (1005) is re-checked
    clock.t = 1009
    assert table.expire() == ["r3"]
    clock.t = 1010
    assert table.expire() == ["r1"]
    assert table.take_done() == {"r1", "r3"}


def test_a_forgotten_tombstone_is_gone_to_everyone(monkeypatch):
    monkeypatch.setattr(tombstones_mod, "MAX_TOMBSTONES", 2)
    table = table_with(1, 2, 3)
    for gen in (1, 2, 3):
        assert table.confirm(call(gen, A), release=True) == [HELD]
    assert table.confirm(call(1, A), release=True) == [GONE]  # forgotten: a load error, never a lie
    assert table.confirm(call(3, A), release=True) == [HELD]


def test_a_full_early_table_answers_pending_and_records_nothing(monkeypatch):
    monkeypatch.setattr(leases_mod, "MAX_EARLY", 1)
    table = table_with()
    assert table.renew(call(1, A)) == [PENDING]
    before = state(table)
    assert table.confirm(call(2, A), release=True) == [PENDING]
    assert state(table) == before


def test_a_second_grant_of_one_generation_is_refused():
    table = table_with(1)
    with pytest.raises(ValueError, match="granted already"):
        table.grant(ref(1), [1], 10.0)


# --- several readers: one consumer engine reading a producer rank from several ranks ----------


def test_two_readers_the_lease_ends_only_when_both_released():
    table = table_with(1)
    assert table.renew(rcall(1, 0)) == [HELD]
    assert table.confirm(rcall(1, 0), release=True) == [HELD]
    assert table.take_done() == set() and table.held_block_ids() == {10, 11}, (
        "the first rank's release handed back blocks the second still reads")
    assert table.confirm(rcall(1, 1), release=False) == [HELD]  # still held for rank 1
    assert table.renew(rcall(1, 1)) == [HELD]
    assert table.confirm(rcall(1, 1), release=True) == [HELD]
    assert table.take_done() == {"r1"} and len(table) == 0
    assert table.stats.released == 1 and table.stats.reader_released == 2


def test_a_release_without_confirm_counts_as_a_reader_released():
    table = table_with(1)
    assert table.release(rcall(1, 1)) == [HELD]  # rank 1 read nothing
    assert table.take_done() == set()
    assert table.confirm(rcall(1, 0), release=True) == [HELD]
    assert table.take_done() == {"r1"}
    assert table.confirm(rcall(1, 0), release=True) == [HELD]  # rank 0's retry
    assert table.confirm(rcall(1, 1), release=False) == [GONE]  # rank 1 released unconfirmed


def test_after_all_readers_released_another_reader_is_gone():
    table = table_with(1)
    for reader in (0, 1):
        assert table.confirm(rcall(1, reader), release=True) == [HELD]
    assert table.take_done() == {"r1"}
    assert table.confirm(rcall(1, 2), release=False) == [GONE]  # a third rank id
    assert table.confirm(rcall(1, 2), release=True) == [GONE]
    assert table.renew(rcall(1, 2)) == [GONE]
    assert table.renew(rcall(1, 0)) == [GONE]  # ended for good
    assert table.confirm(rcall(1, 0, claim=B), release=True) == [GONE]  # another claim
    assert table.confirm(rcall(1, 0, readers=1), release=True) == [GONE]  # another reader count


def test_another_reader_count_under_the_owners_claim_is_claimed_and_changes_nothing():
    table = table_with(1)
    assert table.renew(rcall(1, 0)) == [HELD]  # owner: claim A, 2 readers
    assert table.confirm(rcall(1, 0), release=True) == [HELD]
    before = state(table)
    for readers in (1, 3):
        assert table.confirm(rcall(1, 1, readers), release=True) == [CLAIMED]
        assert table.release(rcall(1, 1, readers)) == [CLAIMED]
        assert table.renew(rcall(1, 1, readers)) == [CLAIMED]
    assert table.release(call(1)) == [CLAIMED]  # the single-reader default is a count too
    assert state(table) == before, "a call with another reader count changed the lease"
    assert table.take_done() == set()
    assert table.stats.refused_readers == 7
    assert table.confirm(rcall(1, 1), release=True) == [HELD]
    assert table.take_done() == {"r1"}


def test_a_repeated_release_by_one_reader_changes_nothing():
    table = table_with(1)
    assert table.release(rcall(1, 0)) == [HELD]
    before = state(table)
    assert table.release(rcall(1, 0)) == [HELD]
    assert state(table) == before
    assert table.confirm(rcall(1, 0), release=True) == [HELD]  # counts rank 0 once: still alive
    assert table.take_done() == set() and len(table) == 1
    assert table.release(rcall(1, 1)) == [HELD]
    assert table.take_done() == {"r1"}
    # Rank 0's CONFIRM answered HELD while the lease lived: its retry is recognised.
    assert table.confirm(rcall(1, 0), release=True) == [HELD]


def test_retries_are_recognised_per_reader():
    table = table_with(1, 2)
    assert table.confirm(rcall(1, 0, readers=3), release=True) == [HELD]
    assert table.confirm(rcall(1, 0, readers=3), release=True) == [HELD]  # retry, lease alive
    assert table.confirm(rcall(1, 1, readers=3), release=True) == [HELD]
    assert table.release(rcall(1, 2, readers=3)) == [HELD]  # the last: ends it
    assert table.take_done() == {"r1"}
    for reader, answer in ((0, HELD), (1, HELD), (2, GONE), (3, GONE)):
        for release in (True, False):
            assert table.confirm(rcall(1, reader, readers=3), release) == [answer], (reader, release)
    assert table.confirm(rcall(1, 0, readers=3, claim=B), release=True) == [GONE]
    # lease 2 is untouched by lease 1's readers
    assert table.confirm(rcall(2, 0), release=False) == [HELD] and len(table) == 1


def test_a_renewal_by_any_reader_extends_the_lease_for_all():
    clock = Clock()
    table = table_with(1, ttl_s=2.0, clock=clock)
    assert table.confirm(rcall(1, 0), release=True) == [HELD]
    for _ in range(3):
        clock.t += 1.5
        assert table.renew(rcall(1, 1)) == [HELD]  # rank 1, still reading, keeps it alive
    assert table.take_done() == set()
    assert table.confirm(rcall(1, 1), release=True) == [HELD]
    assert table.take_done() == {"r1"} and table.stats.expired == 0


def test_expiry_with_one_reader_released():
    clock = Clock()
    table = table_with(1, ttl_s=2.0, clock=clock)
    assert table.confirm(rcall(1, 0), release=True) == [HELD]
    clock.t += 2.5  # rank 1's reads were slow and nobody renewed
    assert table.confirm(rcall(1, 1), release=True) == [GONE]
    assert table.take_done() == {"r1"} and table.stats.expired == 1
    # Rank 0 released (through a CONFIRM answered HELD) while the lease lived.
    assert table.confirm(rcall(1, 0), release=True) == [HELD]
    assert table.renew(rcall(1, 0)) == [GONE] and table.renew(rcall(1, 1)) == [GONE]
    # Past its expiry, nobody's release is confirmed, whoever came first.
    table = table_with(1, ttl_s=2.0, clock=clock)
    clock.t += 2.5
    assert table.confirm(rcall(1, 0), release=True) == [GONE]
    assert table.confirm(rcall(1, 0), release=True) == [GONE]


def test_an_expiry_says_whether_a_consumer_had_claimed_the_lease():
    """Lease 1 is claimed, then its renewals stop; lease 2 is never claimed
    (its decode came too late): both expire, one counted unclaimed."""
    clock = Clock()
    table = table_with(1, 2, ttl_s=2.0, clock=clock)
    assert table.renew(call(1)) == [HELD]
    clock.t += 2.5
    assert sorted(table.expire()) == ["r1", "r2"]
    assert (table.stats.expired, table.stats.expired_unclaimed) == (2, 1)


def test_early_claims_with_two_readers():
    table = table_with(1)
    # Lease 2: one rank confirms before the grant; the grant keeps the lease for the other.
    assert table.renew(rcall(2, 0)) == [PENDING]
    assert table.confirm(rcall(2, 0), release=True) == [HELD]
    assert table.renew(rcall(2, 1)) == [PENDING]  # not yet released by all: not over
    assert table.confirm(rcall(2, 1, readers=1), release=True) == [CLAIMED]
    assert table.confirm(rcall(2, 1, claim=B), release=True) == [CLAIMED]
    table.grant(ref(2), [20, 21], 10.0)
    assert table.take_done() == set() and table.held_block_ids() == {10, 11, 20, 21}
    assert table.confirm(rcall(2, 1), release=True) == [HELD]
    assert table.take_done() == {"r2"}
    assert table.confirm(rcall(2, 0), release=False) == [HELD]  # the early CONFIRM's retry
    # Lease 3: both ranks are done before the grant, which then ends it on arrival.
    assert table.confirm(rcall(3, 0), release=True) == [HELD]
    assert table.release(rcall(3, 1)) == [PENDING]
    assert table.release(rcall(3, 1)) == [PENDING]  # a repeat
    assert table.renew(rcall(3, 0)) == [GONE]
    assert table.confirm(rcall(3, 0), release=True) == [HELD]  # retry before the grant
    assert table.confirm(rcall(3, 1), release=True) == [GONE]  # released without a confirm
    assert table.confirm(rcall(3, 2), release=False) == [GONE]
    table.grant(ref(3), [30], 10.0)
    assert table.take_done() == {"r3"} and table.stats.released_early == 1
    assert table.confirm(rcall(3, 0), release=True) == [HELD]  # retry after the grant
    assert table.confirm(rcall(3, 1), release=True) == [GONE]


def test_tombstones_remember_a_bounded_number_of_readers(monkeypatch):
    monkeypatch.setattr(tombstones_mod, "MAX_TOMBSTONE_READERS", 3)
    table = table_with(1, 2)
    for gen in (1, 2):
        for reader in (0, 1):
            assert table.confirm(rcall(gen, reader), release=True) == [HELD]
    assert table.confirm(rcall(1, 0), release=True) == [GONE]  # forgotten: a load error, never a lie
    assert table.confirm(rcall(2, 1), release=True) == [HELD]


@pytest.mark.parametrize("reader, readers", [(-1, 1), (0, 0), (0, 1025), (65536, 2)])
def test_reader_bounds_are_checked_in_process_and_on_the_wire(reader, readers):
    with pytest.raises(ValueError, match=r"reader \(the consumer's tensor-parallel rank\) must be in"):
        LeaseCall(ref(1), A, reader, readers)
    with pytest.raises(ValueError, match="must be in"):
        wire.LeaseWire.of(ref(1), A, reader, readers)
    r = ref(1)
    body = wire.encode(wire.Renew(wire.PROTOCOL_VERSION, [
        wire.LeaseWire(r.epoch, r.generation, r.request_id, r.token, r.binding, A, reader, readers)]))
    field = "reader" if not 0 <= reader < 2**16 else "readers"
    with pytest.raises(MetadataError, match=rf"malformed side-channel request .*Expected `int` [<>]= \d+ .*"
                                            rf"\(lease 0, field '{field}'\)"):
        wire.decode_request(body)


def test_the_wire_carries_reader_and_readers():
    message = wire.Confirm(wire.PROTOCOL_VERSION, [wire.LeaseWire.of(ref(1), A, 7, 8)], release=True)
    decoded = wire.decode_request(wire.encode(message))
    assert decoded == message and decoded.leases[0].reader == 7 and decoded.leases[0].readers == 8


# --- the binding: a lease covers exactly its blocks (issue 25) ------------------------------------------


def test_a_genuine_token_pointed_at_another_leases_blocks_is_forged_and_changes_nothing():
    # Lease 1 is the attacker's own, lease 2 the victim's, live. The attacker
    # presents its genuine token with the victim's block ids.
    table = table_with(1, 2)
    assert table.renew(call(1, A)) == [HELD]  # the attacker's lease, claimed by it
    before = state(table)
    pointed = [LeaseCall(dataclasses.replace(ref(1), binding=ref(2).binding), A)]
    for act in (lambda c: table.confirm(c, release=True), table.renew, table.release):
        assert act(pointed) == [FORGED]
    assert state(table) == before and table.stats.refused_forged == 3
    # The victim's own load is unaffected, and so is the attacker's honest one.
    assert table.confirm(call(2, B), release=True) == [HELD]
    assert table.confirm(call(1, A), release=True) == [HELD]
    assert table.take_done() == {"r1", "r2"}
    # After both ended (blocks reused), the same forgery is refused too.
    assert table.confirm(pointed, release=True) == [UNKNOWN]


def test_forged_ids_on_a_lease_not_yet_shipped_are_refused_without_a_record():
    table = table_with(1)
    before = state(table)
    forged = [LeaseCall(dataclasses.replace(ref(2), binding=ref(1).binding), A)]
    assert table.confirm(forged, release=True) == [UNKNOWN]  # the grant is not here: cannot tell
    assert state(table) == before
    table.grant(ref(2), [20, 21], 10.0)
    assert table.confirm(call(2, B), release=True) == [HELD]  # its real owner is unaffected


# --- the lifetime bound, reclaims, the expiry heap -------------------------------------------------------


def test_a_lease_renewed_forever_ends_at_its_lifetime_bound():
    clock = Clock()
    table = LeaseTable(clock, max_s=10.0)
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(1), [10, 11], 2.0)
    renewals = 0
    while table.renew(call(1, A)) == [HELD]:
        renewals += 1
        clock.t += 1.0  # well within the TTL, every time
        assert renewals < 100
    assert renewals == 10  # granted at t, renewed at t..t+9; at t+10 its life is over
    assert table.take_done() == {"r1"} and table.stats.lifetime == 1
    assert table.stats.expired == 0
    assert table.confirm(call(1, A), release=True) == [GONE]  # the owner's load is a load error


def test_a_renewal_never_pushes_the_expiry_past_the_lifetime_bound():
    clock = Clock()
    table = LeaseTable(clock, max_s=5.0)
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(1), [10], 4.0)
    clock.t += 3.0
    assert table.renew(call(1, A)) == [HELD]
    assert table.leases()[0].expires_at == clock.t + 2.0  # capped at grant + 5, not now + 4
    clock.t += 2.0
    assert table.expire() == ["r1"] and table.stats.lifetime == 1


def test_reclaimed_leases_end_for_everyone():
    table = table_with(1, 2, 3)
    assert table.renew(call(1, A)) == [HELD]
    assert table.reclaim([1, 3, 99]) == ["r1", "r3"]  # 99 was never granted: passed over
    assert table.take_done() == {"r1", "r3"} and table.stats.reclaimed == 2
    assert table.confirm(call(1, A), release=True) == [GONE]
    assert table.renew(call(3, B)) == [GONE]
    assert table.confirm(call(2, B), release=True) == [HELD]
    assert table.reclaim([2]) == []  # ended already


def test_the_expiry_heap_stays_proportional_to_the_live_leases():
    table = LeaseTable(Clock())
    table.set_epoch(EPOCH, KEY)
    for gen in range(1, 5001):  # granted and released at once, long before their expiry
        table.grant(ref(gen), [gen], 30.0)
        assert table.confirm(call(gen, A), release=True) == [HELD]
    assert len(table) == 0 and table.heap_size() <= HEAP_SLACK
    for gen in range(5001, 5101):  # live ones keep their entries
        table.grant(ref(gen), [gen], 30.0)
    assert 100 <= table.heap_size() <= 2 * 100 + HEAP_SLACK
    table.expire(now=Clock().t + 31.0)
    assert len(table) == 0 and table.take_done() >= {f"r{g}" for g in range(5001, 5101)}


def test_the_lifetime_bound_must_be_positive():
    with pytest.raises(ValueError, match="max lifetime must be > 0"):
        LeaseTable(max_s=0)


def test_tokens_are_checked_without_the_table_lock(monkeypatch):
    """A lease call's tokens (an HMAC each) are computed before the table's
    lock is taken: 4,096 made-up leases from a peer without credentials took
    15 ms under the lock the engine thread's ``take_done`` and step wait for
    (found by an adversarial review). A call's answers are unchanged, and a
    new epoch between the two (sleep, wake) answers as the new epoch does."""
    table = table_with(1, 2)
    held: list[bool] = []
    real = leases_mod.lease_token

    def token(*args):
        held.append(table._lock.locked())
        return real(*args)

    monkeypatch.setattr(leases_mod, "lease_token", token)
    monkeypatch.setattr(leasetokens_mod, "lease_token", token)  # (where the calls' tokens are computed)
    forged = LeaseRef(EPOCH, 7, "r7", b"x" * 16, b"b" * 16)
    assert table.renew(call(1) + call(2) + [LeaseCall(forged, A)]) == [HELD, HELD, UNKNOWN]
    assert held == [False, False, False]
    # A new epoch between the tokens and the lock: the tokens are dropped, the table answers as it is now.
    held.clear()
    real_tokens = leasetokens_mod.expected_tokens

    def tokens_then_new_epoch(calls, epoch, key):
        out = real_tokens(calls, epoch, key)
        table.set_epoch(EPOCH + 1, b"k" * 32)
        return out

    monkeypatch.setattr(leases_mod, "expected_tokens", tokens_then_new_epoch)
    assert table.renew(call(1)) == [GONE]  # the old epoch's lease: the new incarnation does not know it
