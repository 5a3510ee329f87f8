"""The producer's writer (``pusher.PushWriter``) on its own: what a PUSH may
write, the lease pinned under a write, one push per lease and decode rank,
an abort, and the decode's side of a notification (``consumer/pushes``).
Fake transport: writes copy between two registered numpy caches."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
from fakes import FakeFabric
from leaseutil import A, Clock, binding, ref, table_with

from rdma_kv.connector.geometry import derive_geometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.pusher import PUSH_NOTIFY_PREFIX, PushWriter
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease, SendSpec
from rdma_kv.connector.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

S = wire.PushState
SPEC = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
BLOCKS = 64
INC = b"i" * 8  # the decode worker's incarnation


def cache(fill: float | None):
    names = ("l0", "l1")
    shape = (BLOCKS, 2, 4, 16)
    kv = {n: (np.zeros(shape, np.float32) if fill is None else
              np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000 * (i + 1) * fill)
          for i, n in enumerate(names)}
    config = KVCacheConfig(BLOCKS, tuple(KVCacheTensor(BLOCKS * SPEC.page_size_bytes, (n,)) for n in names),
                           (KVCacheGroupSpec(names, SPEC),))
    return kv, derive_geometry(kv, config)


class Setup:
    def __init__(self):
        self.fabric = FakeFabric()
        self.src, g_src = cache(1.0)
        self.dst, self.g_dst = cache(None)
        self.p = self.fabric.factory("P")
        self.d = self.fabric.factory("D")
        for region in g_src.regions:
            self.p.register((region.base_address, region.nbytes))
        for region in self.g_dst.regions:
            self.d.register((region.base_address, region.nbytes))
        self.clock = Clock()
        self.leases = table_with(1, 2, clock=self.clock)  # lease g over blocks (10g, 10g + 1)
        self.writer = PushWriter(self.p, g_src, self.leases, write_timeout_s=5.0, clock=self.clock)
        hello = wire.PushHello(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 2), INC, 1, self.d.metadata(),
                               wire.GeometryWire.from_geometry(self.g_dst))
        assert self.writer.hello(hello).state is S.DONE

    def push(self, gen, local, remote=None, token=None, claim=A, lease_ref=None):
        remote = remote if remote is not None else [gen * 10, gen * 10 + 1]
        lease = RemoteLease(PeerAddress("P", "127.0.0.1", 1, 1), lease_ref or ref(gen), claim).to_wire()
        return wire.Push(wire.PROTOCOL_VERSION, lease, token or bytes([gen]) * 16, "D", 0, INC, 1, [local], [remote])


def written(s: Setup, dst_blocks, src_blocks) -> bool:
    return all(np.array_equal(s.dst[n][d], s.src[n][b]) for n in s.dst for d, b in zip(dst_blocks, src_blocks))


def test_a_push_writes_the_leases_blocks_into_the_decodes_and_notifies_after_the_data():
    s = Setup()
    reply = s.writer.push(s.push(1, [40, 41]))
    assert reply.state is S.DONE  # the fake completes at once
    assert written(s, [40, 41], [10, 11])
    (note,) = s.d.get_notifications()
    assert note.payload == PUSH_NOTIFY_PREFIX + bytes([1]) * 16
    untouched = [b for b in range(BLOCKS) if b not in (40, 41)]
    assert not any(s.dst[n][untouched].any() for n in s.dst)
    assert s.leases.take_done() == {"r1"}  # the lease ended with its push: the producer frees its blocks
    assert s.writer.take_counters().done == 1


def test_a_new_link_fails_the_writes_held_on_the_old_links_import():
    """The decode introduced itself on a new link (it fenced the old one):
    the old import goes, forced, before the new one is made, and a write
    still in flight through it fails; its push is answered FAILED, never
    DONE, and nothing is notified. (Its bytes may still land, as over TCP:
    it is the decode's fence of the old link that stops them, before its
    blocks go back.)"""
    s = Setup()
    s.fabric.hold = True
    assert s.writer.push(s.push(1, [40, 41])).state is S.RUNNING
    again = wire.PushHello(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 2), INC, 1, s.d.metadata(),
                           wire.GeometryWire.from_geometry(s.g_dst), "link-2")
    assert s.writer.hello(again).detail == "introduced"
    s.fabric.release_all()
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, bytes([1]) * 16))
    assert reply.state is S.FAILED, reply
    assert not s.d.get_notifications()


def test_two_decodes_given_one_engine_id_each_get_their_own_writes():
    """An operator gave two decode engines one engine id: the producer tells
    them apart by their incarnation, so neither's introduction replaces the
    other's and each push lands in the decode that sent it (before: the
    second was 'known', and its pushes wrote into the first one's blocks)."""
    s = Setup()
    twin_kv, g_twin = cache(None)
    twin = s.fabric.factory("D-twin")  # another process; its agent's own name does not matter
    for region in g_twin.regions:
        twin.register((region.base_address, region.nbytes))
    twin_inc = b"j" * 8
    hello = wire.PushHello(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 2), twin_inc, 1, twin.metadata(),
                           wire.GeometryWire.from_geometry(g_twin))
    assert s.writer.hello(hello).state is S.DONE
    assert s.writer.push(s.push(1, [40, 41])).state is S.DONE
    twin_push = msgspec.structs.replace(s.push(2, [40, 41], token=b"t" * 16), incarnation=twin_inc)
    assert s.writer.push(twin_push).state is S.DONE
    for n in s.dst:  # the same decode block ids, each decode's own bytes
        assert np.array_equal(s.dst[n][[40, 41]], s.src[n][[10, 11]])
        assert np.array_equal(twin_kv[n][[40, 41]], s.src[n][[20, 21]])
    assert [x.payload for x in s.d.get_notifications()] == [PUSH_NOTIFY_PREFIX + bytes([1]) * 16]
    assert [x.payload for x in twin.get_notifications()] == [PUSH_NOTIFY_PREFIX + b"t" * 16]
    stranger = msgspec.structs.replace(s.push(2, [50, 51], token=b"s" * 16), incarnation=b"k" * 8)
    reply = s.writer.push(stranger)
    assert reply.state is S.REFUSED and "PUSH_HELLO" in reply.detail and "6b6b6b6b6b6b6b6b" in reply.detail


@pytest.mark.parametrize("case", ["forged", "outside", "unknown_lease", "other_claim_after_push"])
def test_a_push_the_lease_does_not_cover_writes_nothing(case):
    s = Setup()
    if case == "forged":  # lease 1's genuine token, presented with lease 2's blocks
        forged = dataclasses.replace(ref(1), binding=binding([20, 21]))
        request = s.push(1, [40, 41], remote=[20, 21], lease_ref=forged)
        reply = s.writer.push(request)
        assert reply.state is S.REFUSED and "FORGED" in reply.detail
    elif case == "outside":  # the token covers the blocks, but the ids asked for are not all the lease's
        reply = s.writer.push(s.push(1, [40, 41], remote=[10, 20]))
        assert reply.state is S.REFUSED and "not the lease's" in reply.detail
    elif case == "unknown_lease":
        reply = s.writer.push(s.push(9, [40, 41]))
        assert reply.state is S.PENDING  # issued later than anything granted here: not shipped yet
    else:  # another consumer pushes a lease someone else claimed
        assert s.writer.push(s.push(1, [40, 41])).state is S.DONE
        s.dst["l0"][:] = 0
        s.dst["l1"][:] = 0
        reply = s.writer.push(s.push(1, [50, 51], token=b"x" * 16, claim=b"Z" * 16))
        assert reply.state is S.REFUSED
    assert not any(s.dst[n].any() for n in s.dst), "a refused push wrote"
    assert s.fabric.writes == (1 if case == "other_claim_after_push" else 0)


def test_a_replayed_push_under_the_same_lease_is_refused_and_a_retried_one_answers_its_state():
    s = Setup()
    first = s.push(1, [40, 41])
    assert s.writer.push(first).state is S.DONE
    assert s.writer.push(first).state is S.DONE  # the same token: the decode asking again
    replay = s.push(1, [50, 51], token=b"r" * 16)
    reply = s.writer.push(replay)
    assert reply.state is S.REFUSED and "already pushed" in reply.detail
    assert not s.dst["l0"][[50, 51]].any()


def test_the_lease_is_pinned_while_its_write_runs_and_an_abort_waits_for_the_write():
    s = Setup()
    s.fabric.hold = True
    token = b"h" * 16
    assert s.writer.push(s.push(1, [40, 41], token=token)).state is S.RUNNING
    s.clock.t += 3600  # far past the TTL and lease_max_s
    assert s.leases.expire() == ["r2"]  # lease 1 is pinned (its blocks are being read); lease 2 is not
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token, abort=True))
    assert reply.state is S.RUNNING and reply.writes_end_within_s == 5.0
    assert s.leases.take_done() == {"r2"}
    s.fabric.release_all()
    assert s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token)).state is S.ABORTED
    assert s.leases.take_done() == {"r1"}  # released once its write resolved
    assert len(s.leases) == 0
    assert s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"n" * 16)).state is S.UNKNOWN


def test_a_write_that_fails_is_failed_even_when_aborted_and_the_lease_is_released():
    s = Setup()
    s.fabric.hold = True
    token = b"f" * 16
    assert s.writer.push(s.push(1, [40, 41], token=token)).state is S.RUNNING
    s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token, abort=True))
    s.fabric.release_all(error=RuntimeError("injected"))
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token))
    assert reply.state is S.FAILED and "injected" in reply.detail
    assert s.d.get_notifications() == []  # no notification for a failed batch
    assert s.leases.take_done() == {"r1"}


def test_a_push_that_arrives_after_the_decode_aborted_it_unknown_writes_nothing():
    """The decode's PUSH got no answer in time (a producer without CPU), so
    it gave up: it asked to abort, and this rank, which had not taken the
    PUSH, answered UNKNOWN. The PUSH then arrives (an attempt the client
    had given up on): it is answered ABORTED and writes nothing, although
    the lease covers the blocks -- the decode may have handed them back."""
    s = Setup()
    token = b"u" * 16
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token, abort=True))
    assert reply.state is S.UNKNOWN and "refused" in reply.detail
    late = s.writer.push(s.push(1, [40, 41], token=token))
    assert late.state is S.ABORTED, late
    assert not any(s.dst[n].any() for n in s.dst), "a PUSH the decode had given up on wrote"
    assert s.fabric.writes == 0
    assert s.writer.take_counters().aborted_unknown == 1
    # A plain query (no abort) of an unknown token leaves no such record: the decode PUSHes again.
    other = b"v" * 16
    assert s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, other)).state is S.UNKNOWN
    assert s.writer.push(s.push(2, [50, 51], token=other)).state is S.DONE
    assert written(s, [50, 51], [20, 21])


def concurrent_setup():
    """A writer for concurrent dispatch (PUSH_REG; 4 tokens a block), the decode introduced."""
    s = Setup()
    s.writer = PushWriter(s.p, s.writer._geometry, s.leases, write_timeout_s=5.0, clock=s.clock, block_size=4,
                          layerwise=False)
    hello = wire.PushHello(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 2), INC, 1, s.d.metadata(),
                           wire.GeometryWire.from_geometry(s.g_dst))
    assert s.writer.hello(hello).state is S.DONE
    return s, hello


def test_a_registration_made_before_the_decode_re_registered_its_kv_cache_writes_nothing():
    """Concurrent dispatch: a decode registered blocks (PUSH_REG, its KV
    cache's registration 1), then slept and woke (PUSH_HELLO, registration
    2: new memory, its old block ids mean nothing). The prefill's grant must
    not write the old registration's block ids into the new cache (before:
    the producer looked the decode up by engine and rank alone, and wrote)."""
    s, hello = concurrent_setup()
    token = b"g" * 16
    reg = wire.PushReg(wire.PROTOCOL_VERSION, "t1", token, "D", 0, INC, 1, 0, 8, [[40, 41]])
    assert s.writer.register(reg).state is S.WAITING
    assert s.writer.hello(msgspec.structs.replace(hello, registration=2)).detail == "introduced"
    s.writer.granted(SendSpec("r1", [10, 11], ref(1), 10.0, transfer_id="t1", num_tokens=8))
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token))
    assert reply.state is S.REFUSED and "forgot its KV cache" in reply.detail, reply
    assert s.fabric.writes == 0 and not any(s.dst[n].any() for n in s.dst)
    fresh = msgspec.structs.replace(reg, transfer_id="t2", token=b"h" * 16, registration=2)  # the control
    assert s.writer.register(fresh).state is S.WAITING
    s.writer.granted(SendSpec("r2", [20, 21], ref(2), 10.0, transfer_id="t2", num_tokens=8))
    assert s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, b"h" * 16)).state is S.DONE
    assert written(s, [40, 41], [20, 21])


def test_an_introduction_from_before_the_decode_slept_replaces_nothing():
    """A PUSH_HELLO of registration 1 delayed past the decode's registration
    2 (it slept and woke: new worker, new memory) is refused and replaces
    nothing: ordinals are compared within one registration only (a woken
    decode's new worker counts its links from 1 again), so registrations are
    compared first."""
    s, hello = concurrent_setup()
    assert s.writer.hello(msgspec.structs.replace(hello, registration=2, link="l2")).detail == "introduced"
    (decode,) = s.writer._decodes.values()
    stale = s.writer.hello(msgspec.structs.replace(hello, registration=1, link="l1", ordinal=5))
    assert stale.state is S.REFUSED and "registration 1" in stale.detail and "registration 2" in stale.detail, stale
    assert list(s.writer._decodes.values()) == [decode] and list(s.p.peers) == [decode.name]


def test_a_re_registration_while_a_write_is_being_prepared_writes_nothing():
    """The engine thread took the decode's registration 1 for a grant; before
    it prepared the decode's slot table, the side channel thread took the
    decode's PUSH_HELLO of registration 2, which replaced the transport peer
    under the same name. The table prepared is the new cache's: the check
    after preparing refuses it (before: written into the new cache)."""
    s, hello = concurrent_setup()
    token = b"g" * 16
    assert s.writer.register(wire.PushReg(wire.PROTOCOL_VERSION, "t1", token, "D", 0, INC, 1, 0, 8,
                                          [[40, 41]])).state is S.WAITING
    real = s.p.prep_remote

    def racing(name, descs):
        assert s.writer.hello(msgspec.structs.replace(hello, registration=2)).detail == "introduced"
        return real(name, descs)

    s.p.prep_remote = racing
    s.writer.granted(SendSpec("r1", [10, 11], ref(1), 10.0, transfer_id="t1", num_tokens=8))
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token))
    assert reply.state is S.REFUSED and "re-registered its KV cache" in reply.detail, reply
    assert s.fabric.writes == 0 and not any(s.dst[n].any() for n in s.dst)


def test_an_abandoned_write_batch_is_answered_failed_saying_its_bytes_may_still_arrive():
    """The transport failed the batch at its deadline but still holds it
    (``Transfer.abandoned``): FAILED, never DONE, and the answer says the
    bytes may still arrive -- they do (``land_late``), which is why the
    decode fences the producer before its blocks go back (pushes.py,
    tests/transport/test_fence.py)."""
    s = Setup()
    s.fabric.abandon_next = 1
    reply = s.writer.push(s.push(1, [40, 41]))
    assert reply.state is S.FAILED and "abandoned by the producer's transport" in reply.detail, reply
    assert not any(s.dst[n].any() for n in s.dst)
    s.fabric.land_late()
    assert written(s, [40, 41], [10, 11]), "the fake lands an abandoned write late, as UCX may"


def test_a_decode_forgotten_after_a_failed_write_has_its_peer_removed():
    """A failed write makes the producer forget the decode (its endpoint may
    be dead); a restarted decode comes back as a new incarnation under a new
    peer name, so the old peer must be removed, not left for the producer's
    lifetime (one leaked peer per decode crash)."""
    s = Setup()
    old = next(iter(s.p.peers))
    s.fabric.fail_next = 1
    reply = s.writer.push(s.push(1, [40, 41]))
    assert reply.state is S.FAILED, reply
    restarted = wire.PushHello(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 2), b"n" * 8, 1, s.d.metadata(),
                               wire.GeometryWire.from_geometry(s.g_dst))
    assert s.writer.hello(restarted).detail == "introduced"
    assert list(s.p.peers) == ["D/tp0#6e6e6e6e6e6e6e6e/2"], s.p.peers  # (each import named apart: /N)
    assert old == "D/tp0#6969696969696969/1"
    assert s.writer.push(msgspec.structs.replace(s.push(2, [50, 51]), incarnation=b"n" * 8)).state is S.DONE
    assert written(s, [50, 51], [20, 21])
