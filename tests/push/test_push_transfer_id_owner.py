"""Concurrent dispatch (push mode, PUSH_REG under a router transfer id).

The claim on the prefill's lease is derived from the transfer id alone
(pushstate.claim), and every registration waiting under that id is written
(pushreg.granted): nothing makes the first registration the owner, unlike
pull-mode claims. So a second decode (another engine, or anyone who learnt
the transfer id: it arrives in client-suppliable kv_transfer_params) that
registers under the same transfer id receives the same prefill's KV.

Worse, both writes pin the lease with the same claim and reader; the first
to resolve releases "reader 0 of 1", which ends the lease (done_sending)
while the second write is still on the wire: the blocks go back to the
engine, are reused, and the second push still ends DONE.

Found by an adversarial review. The first registration under a transfer id
now owns it (engine id and reader count), one registration per reader; and
push pins are counted (tests/push/test_push_pin_count.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeFabric
from leaseutil import Clock, ref, table_with
from test_pusher import S, cache  # its KV caches

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.meta import SendSpec
from rdma_kv.connector.rdma.pusher import PushWriter

def setup():
    fabric = FakeFabric()
    src, g_src = cache(1.0)
    p = fabric.factory("P")
    for region in g_src.regions:
        p.register((region.base_address, region.nbytes))
    clock = Clock()
    leases = table_with(1, clock=clock)  # lease 1: producer blocks (10, 11), request "r1"
    writer = PushWriter(p, g_src, leases, write_timeout_s=5.0, clock=clock, block_size=4, layerwise=False)
    dsts = {}
    for engine, rank, tp in (("VICTIM", 0, 2), ("VICTIM", 1, 2), ("ATTACKER", 0, 1)):
        dst, g_dst = cache(None)
        d = fabric.factory(f"{engine}{rank}")
        for region in g_dst.regions:
            d.register((region.base_address, region.nbytes))
        inc = (engine[:1] + str(rank)).encode() * 4
        hello = wire.PushHello(wire.PROTOCOL_VERSION, engine, wire.RankInfo(rank, tp, 2), inc, 1, d.metadata(),
                               wire.GeometryWire.from_geometry(g_dst))
        assert writer.hello(hello).state is S.DONE
        dsts[engine, rank] = (dst, inc)
    return fabric, src, dsts, leases, writer


def reg(engine, rank, token, dsts, reader=0, readers=1):
    inc = dsts[engine, rank][1]
    return wire.PushReg(wire.PROTOCOL_VERSION, "t-victim", token, engine, rank, inc, 1, 0, 8, [[40, 41]],
                        reader=reader, readers=readers)


def grant(writer):
    writer.granted(SendSpec("r1", [10, 11], ref(1), 10.0, transfer_id="t-victim", num_tokens=8))


def landed(dsts, key, src):
    return all(np.array_equal(dsts[key][0][n][[40, 41]], src[n][[10, 11]]) for n in src)


@pytest.mark.parametrize("early", [True, False], ids=["before-grant", "after-grant"])
def test_a_second_engine_under_the_same_transfer_id_is_refused(early):
    fabric, src, dsts, leases, writer = setup()
    fabric.hold = True
    if not early:
        grant(writer)
    first = writer.register(reg("VICTIM", 0, b"v" * 16, dsts))
    assert first.state is (S.WAITING if early else S.RUNNING)
    second = writer.register(reg("ATTACKER", 0, b"a" * 16, dsts))
    assert second.state is S.REFUSED and "registered by decode engine 'VICTIM'" in second.detail
    if early:
        grant(writer)
    fabric.release_all()
    assert writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"v" * 16)).state is S.DONE
    assert writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"a" * 16)).state is S.UNKNOWN  # never taken
    assert landed(dsts, ("VICTIM", 0), src) and not landed(dsts, ("ATTACKER", 0), src)
    assert "r1" in leases.take_done()  # its one reader is done with it


def test_a_reader_registered_twice_under_another_token_is_refused_while_the_first_is_under_way():
    fabric, src, dsts, leases, writer = setup()
    fabric.hold = True
    assert writer.register(reg("VICTIM", 0, b"v" * 16, dsts)).state is S.WAITING
    assert writer.register(reg("VICTIM", 0, b"v" * 16, dsts)).state is S.WAITING  # the same PUSH_REG again
    again = writer.register(reg("VICTIM", 0, b"w" * 16, dsts))
    assert again.state is S.REFUSED and "under way" in again.detail
    grant(writer)
    assert len(fabric.pending) == 1  # one write, not two
    fabric.release_all()
    assert writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"v" * 16)).state is S.DONE


def test_a_reader_may_register_again_once_its_registration_was_aborted():
    """A decode leg the client hung up on, retried on the same engine
    (``tests/vllm/test_vllm_push.py`` does this in real vLLM)."""
    fabric, src, dsts, leases, writer = setup()
    assert writer.register(reg("VICTIM", 0, b"v" * 16, dsts)).state is S.WAITING
    assert writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"v" * 16, abort=True)).state is S.ABORTED
    assert writer.register(reg("VICTIM", 0, b"w" * 16, dsts)).state is S.WAITING
    grant(writer)
    assert writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"w" * 16)).state is S.DONE
    assert landed(dsts, ("VICTIM", 0), src)


def test_two_readers_of_one_engine_are_both_written_and_the_lease_outlives_the_first():
    """Heterogeneous TP (decode TP 2 on producer TP 1): reader 0 and reader
    1 of one engine register under one transfer id; the lease ends only
    once both writes resolved."""
    fabric, src, dsts, leases, writer = setup()
    fabric.hold = True
    for rank, token in ((0, b"v" * 16), (1, b"u" * 16)):
        assert writer.register(reg("VICTIM", rank, token, dsts, reader=rank, readers=2)).state is S.WAITING
    refused = writer.register(reg("VICTIM", 0, b"x" * 16, dsts, reader=0, readers=1))
    assert refused.state is S.REFUSED and "with 2 reader(s)" in refused.detail
    grant(writer)
    assert len(fabric.pending) == 2
    fabric.pending.pop(0)._resolve()
    assert "r1" not in leases.take_done() and leases.reclaim([1]) == []  # the other write still reads
    fabric.release_all()
    assert "r1" in leases.take_done()
    assert landed(dsts, ("VICTIM", 0), src) and landed(dsts, ("VICTIM", 1), src)


def test_a_worker_that_claims_the_owners_engine_id_cannot_take_a_resolved_reader():
    """Found by a review of the first version of the owner rule, which bound
    a transfer id to a self-declared engine id only and freed a reader once
    its registration resolved: another worker claiming engine 'VICTIM' took
    reader 0 after its write was DONE and was written the prefill's KV. A
    reader is now the worker's (engine, rank, incarnation) that registered it."""
    fabric, src, dsts, leases, writer = setup()
    fabric.hold = True
    for rank, token in ((0, b"v" * 16), (1, b"u" * 16)):
        assert writer.register(reg("VICTIM", rank, token, dsts, reader=rank, readers=2)).state is S.WAITING
    grant(writer)
    assert len(fabric.pending) == 2
    fabric.pending.pop(0)._resolve()  # reader 0's write landed; reader 1's still in flight
    assert writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"v" * 16)).state is S.DONE

    # The attacker: its own KV cache, introduced under the victim's engine id.
    dst, g_dst = cache(None)
    d = fabric.factory("EVIL")
    for region in g_dst.regions:
        d.register((region.base_address, region.nbytes))
    inc = b"evil" * 2
    hello = wire.PushHello(wire.PROTOCOL_VERSION, "VICTIM", wire.RankInfo(0, 2, 2), inc, 1, d.metadata(),
                           wire.GeometryWire.from_geometry(g_dst))
    assert writer.hello(hello).state is S.DONE
    dsts["EVIL", 0] = (dst, inc)
    evil = wire.PushReg(wire.PROTOCOL_VERSION, "t-victim", b"e" * 16, "VICTIM", 0, inc, 1, 0, 8, [[40, 41]],
                        reader=0, readers=2)
    answer = writer.register(evil)
    fabric.release_all()
    got = landed(dsts, ("EVIL", 0), src)
    print("attacker's PUSH_REG answered", answer.state, "; prefill KV landed in attacker memory:", got)
    assert answer.state is S.REFUSED and not got, (
        f"a second registration of reader 0 under the transfer id (another decode worker claiming engine "
        f"'VICTIM') was answered {answer.state.name} and written the victim's prefill KV: {got}")


def test_an_owner_is_not_forgotten_while_its_registration_waits(monkeypatch):
    """Found by the same review: `_reg_owners` was trimmed to MAX_REMEMBERED
    by insertion order, live or not: registrations under other transfer ids evict the owner of one still
    WAITING, and another engine is then written under it. (MAX_REMEMBERED is
    65,536 in production; patched to 4 here so the test is quick, the logic
    is the same: nothing ties the eviction to the registration's lifetime.)"""
    import rdma_kv.connector.rdma.pushreg as pushreg

    monkeypatch.setattr(pushreg, "MAX_REMEMBERED", 4)
    fabric, src, dsts, leases, writer = setup()
    fabric.hold = True
    assert writer.register(reg("VICTIM", 0, b"v" * 16, dsts)).state is S.WAITING
    for i in range(4):  # other transfer ids (the attacker's own, never granted)
        other = wire.PushReg(wire.PROTOCOL_VERSION, f"junk-{i}", bytes([i]) * 16, "ATTACKER", 0,
                             dsts["ATTACKER", 0][1], 1, 0, 8, [[50, 51]], reader=0, readers=1)
        assert writer.register(other).state is S.WAITING
    second = writer.register(reg("ATTACKER", 0, b"a" * 16, dsts))
    grant(writer)
    fabric.release_all()
    got = landed(dsts, ("ATTACKER", 0), src)
    print("second engine's PUSH_REG answered", second.state, "; written:", got)
    assert second.state is S.REFUSED and not got, (
        f"after the owner record of 't-victim' was evicted (its registration still WAITING), engine ATTACKER "
        f"registered under it: {second.state.name}, victim's KV written to it: {got}")
