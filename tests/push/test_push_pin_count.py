"""Push mode, heterogeneous TP (decode TP=2 reads producer rank 0: readers=2).

Both decode ranks push from the same producer lease at once. LeaseTable keeps
push pins in a *set* of generations, so the first push to resolve calls
``unpin(generation)`` and removes the pin although the second push is still
writing from the lease's blocks. The lease can then be reclaimed (memory
pressure) or end at its lifetime bound / expiry, its blocks go back to the
engine (done_sending) and are reused while the second write is in flight; the
second push still ends DONE and the decode trusts what it got. Found by an
adversarial review; pins are now counted per generation, and a release of
the last reader while a push still writes ends the lease at the last unpin.
"""

from __future__ import annotations

import numpy as np
from fakes import FakeFabric
from leaseutil import A, Clock, ref, table_with
from test_pusher import INC, S, cache  # its KV caches

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.leases import LeaseCall
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.pusher import PushWriter

def setup():
    fabric = FakeFabric()
    src, g_src = cache(1.0)
    p = fabric.factory("P")
    for region in g_src.regions:
        p.register((region.base_address, region.nbytes))
    dsts = []
    clock = Clock()
    leases = table_with(1, clock=clock)  # lease 1 over producer blocks (10, 11), request "r1"
    writer = PushWriter(p, g_src, leases, write_timeout_s=5.0, clock=clock)
    for rank in (0, 1):  # two decode ranks, each its own KV cache
        dst, g_dst = cache(None)
        d = fabric.factory(f"D{rank}")
        for region in g_dst.regions:
            d.register((region.base_address, region.nbytes))
        hello = wire.PushHello(wire.PROTOCOL_VERSION, "D", wire.RankInfo(rank, 2, 2), INC, 1, d.metadata(),
                               wire.GeometryWire.from_geometry(g_dst))
        assert writer.hello(hello).state is S.DONE
        dsts.append(dst)
    return fabric, src, dsts, clock, leases, writer


def push(reader):
    lease = RemoteLease(PeerAddress("P", "127.0.0.1", 1, 1), ref(1), A, reader=reader, readers=2).to_wire()
    return wire.Push(wire.PROTOCOL_VERSION, lease, bytes([reader + 1]) * 16, "D", reader, INC, 1,
                     [[40, 41]], [[10, 11]])


def _two_pushes_first_resolved():
    fabric, src, dsts, clock, leases, writer = setup()
    fabric.hold = True
    assert writer.push(push(0)).state is S.RUNNING
    assert writer.push(push(1)).state is S.RUNNING
    first = fabric.pending.pop(0)
    first._resolve()  # decode rank 0's push resolves; rank 1's writes are still in flight
    assert writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, bytes([1]) * 16)).state is S.DONE
    return fabric, src, dsts, clock, leases, writer


def test_reclaim_while_second_readers_push_still_writes():
    fabric, src, dsts, clock, leases, writer = _two_pushes_first_resolved()
    ended = leases.reclaim([1])  # memory pressure at the producer
    freed = leases.take_done()
    # correct behaviour: the lease is still pinned by rank 1's running push
    assert ended == [] and "r1" not in freed, (
        f"lease 1 was reclaimed (ended={ended}, done_sending={freed}) while decode rank 1's push still "
        "writes from its blocks")


def test_lifetime_bound_while_second_readers_push_still_writes_and_reused_bytes_are_delivered_as_done():
    fabric, src, dsts, clock, leases, writer = _two_pushes_first_resolved()
    clock.t += 3600  # past TTL and lease_max_s; rank 1's write is still on the wire
    expired = leases.expire()
    freed = leases.take_done()
    # the engine reuses the freed blocks for another prompt
    if "r1" in freed:
        for n in src:
            src[n][[10, 11]] = -7.0
    original = {n: np.arange(np.prod(src[n].shape), dtype=np.float32).reshape(src[n].shape) + 1000 * (i + 1)
                for i, n in enumerate(("l0", "l1"))}
    fabric.release_all()
    state = writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, bytes([2]) * 16)).state
    got_original = all(np.array_equal(dsts[1][n][[40, 41]], original[n][[10, 11]]) for n in src)
    assert expired == [] and "r1" not in freed, (
        f"lease 1 ended (expired={expired}) while decode rank 1's push was still writing from it; the push then "
        f"ended {state.name} with {'the original' if got_original else 'REUSED'} bytes in decode blocks 40, 41")


def test_table_level():
    """The same, on LeaseTable alone: two pins of one generation, one unpin."""
    clock = Clock()
    leases = table_with(1, clock=clock)
    c0, c1 = (LeaseCall(ref(1), A, r, 2) for r in (0, 1))
    assert leases.pin_for_push(c0)[0] is wire.LeaseStatus.HELD
    assert leases.pin_for_push(c1)[0] is wire.LeaseStatus.HELD
    leases.unpin(1)  # reader 0's push resolved
    leases.release([c0])
    assert leases.reclaim([1]) == [], "reader 1's push pin no longer protects the lease"


def test_a_release_while_another_push_writes_ends_the_lease_at_the_last_unpin():
    """Both readers released (rank 1's RELEASE overtook its own push's
    resolution): the lease is kept until the last push from it resolved."""
    clock = Clock()
    leases = table_with(1, clock=clock)
    c0, c1 = (LeaseCall(ref(1), A, r, 2) for r in (0, 1))
    assert leases.pin_for_push(c0)[0] is wire.LeaseStatus.HELD
    assert leases.pin_for_push(c1)[0] is wire.LeaseStatus.HELD
    leases.unpin(1)
    leases.release([c0, c1])
    assert "r1" not in leases.take_done() and len(leases) == 1  # rank 1's push still writes
    leases.unpin(1)
    assert "r1" in leases.take_done() and len(leases) == 0
