"""Held words (protocol 12): the producer names, in one 16-byte word per
block, the live lease that holds it, and changes the word before the block
can go back to its engine; a consumer reads its blocks' words after its
data and trusts the data, without a PIN or a CONFIRM, only when each word
names its lease. Anything else is CONFIRMed, so an expiry, a reuse or
edited params are still load errors, never silent.

The words themselves (``HeldWords``), the lease table keeping them, and the
consumer against the fake transport (whose reads copy when released:
``FakeFabric.hold``) with a real side channel. Over UCX, with the
producer's process stopped: ``tests/faults/test_confirm_stalled_producer.py``.
"""

from __future__ import annotations

import contextlib
import types

import msgspec
import numpy as np
import pytest
from leaseutil import EPOCH, KEY, Clock, call, ref
from rdma_testutil import wait_until
from test_connector_fake import BS, Pair
from test_preconnect import Events

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.peers import PeerStage
from rdma_kv.connector.rdma.consumer.words import CHUNK, WordChecks
from rdma_kv.connector.rdma.heldwords import WORD_BYTES, HeldWords, checked_words, word_tag
from rdma_kv.connector.rdma.leases import LeaseTable
from rdma_kv.connector.rdma.wire import RegionWire

pytestmark = pytest.mark.timeout(60)

T1, T2, T3 = (word_tag(bytes([i]) * 16, b"b" * 16) for i in (1, 2, 3))


def names(words, block):
    return bytes(words.array[block])


# --- the words --------------------------------------------------------------------------------------


def test_a_tag_binds_token_and_binding_and_is_never_zero():
    tag = word_tag(b"t" * 16, b"b" * 16)
    assert len(tag) == WORD_BYTES and any(tag)
    assert tag != word_tag(b"t" * 16, b"c" * 16)  # other blocks, another prompt: another tag
    assert tag != word_tag(b"u" * 16, b"b" * 16)


def test_words_name_their_lease_and_a_shared_block_passes_to_the_other_holder():
    words = HeldWords(8)
    words.hold(T1, [1, 2, 3])
    words.hold(T2, [3, 4])  # block 3: a prefix both hold
    assert [names(words, b) for b in (1, 2, 3, 4)] == [T1, T1, T1, T2]
    words.drop(T1, [1, 2, 3])
    assert [names(words, b) for b in (1, 2, 3, 4)] == [bytes(16), bytes(16), T2, T2]
    words.drop(T2, [3, 4])
    assert words.held() == 0 and not words._others


def test_dropping_a_lease_its_shared_word_does_not_name_keeps_the_word():
    words = HeldWords(8)
    words.hold(T1, [5])
    words.hold(T2, [5])
    words.hold(T3, [5])
    words.drop(T2, [5])
    assert names(words, 5) == T1
    words.drop(T1, [5])
    assert names(words, 5) == T3  # the last holder left
    words.drop(T3, [5])
    assert words.held() == 0 and not words._others


def test_ids_out_of_range_are_passed_over():
    words = HeldWords(4)
    words.hold(T1, [-1, 2, 4, 99])
    assert words.held() == 1 and names(words, 2) == T1


def test_a_handshake_reply_s_words_must_cover_the_geometry():
    assert checked_words(RegionWire(4096, 16 * 10), 10) == RegionWire(4096, 16 * 10)
    assert checked_words(RegionWire(4096, 16 * 10_000), 10) == RegionWire(4096, 16 * 10)  # cut to the blocks
    assert checked_words(RegionWire(4096, 16 * 9), 10) is None  # fewer words than blocks
    assert checked_words(RegionWire(4096, 16 * 10 + 3), 10) is None  # not whole words
    assert checked_words(None, 10) is None


# --- the lease table keeps them -----------------------------------------------------------------


def table_and_words(clock=None):
    table, words = LeaseTable(clock or Clock()), HeldWords(64)
    table.attach_words(words)
    table.set_epoch(EPOCH, KEY)
    return table, words


def tag_of(gen):
    r = ref(gen)
    return word_tag(r.token, r.binding)


@pytest.mark.parametrize("ending", ["release", "expiry", "reclaim", "new epoch"])
def test_a_lease_s_words_change_before_its_request_reaches_done_sending(ending):
    clock = Clock()
    table, words = table_and_words(clock)
    table.grant(ref(1), [10, 11], 10.0)
    assert names(words, 10) == names(words, 11) == tag_of(1)
    if ending == "release":
        table.release(call(1))
    elif ending == "expiry":
        clock.t += 11.0
    elif ending == "reclaim":
        table.reclaim([1])
    else:
        table.set_epoch(EPOCH + 1, KEY)
    done = table.take_done()
    assert done == {"r1"}
    assert words.held() == 0  # no word names the lease once its blocks may go back


def test_a_lease_released_before_its_grant_never_names_its_blocks():
    table, words = table_and_words()
    assert table.confirm(call(1), release=True)[0].name == "HELD"  # issued, not shipped: held
    table.grant(ref(1), [10, 11], 10.0)
    assert table.take_done() == {"r1"} and words.held() == 0


def test_attaching_words_names_the_leases_already_live():
    table = LeaseTable(Clock())
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(2), [20, 21], 10.0)
    words = HeldWords(64)
    table.attach_words(words)
    assert names(words, 20) == tag_of(2) and words.held() == 2


# --- the consumer (fake transport, real side channel) ----------------------------------------


WORDS_ONLY = {"read_pin": False}
"""The decode pins nothing, whatever its producer publishes (a producer that
publishes held words is never pinned: the words, or a CONFIRM, decide)."""


@contextlib.contextmanager
def pair_and_events(fabric, **kw):
    """A producer and a decode on the fake transport (``Pair``), and the decode's event counters."""
    pair = Pair(fabric, **kw)
    try:
        yield pair, Events(pair.D.worker.worker)
    finally:
        pair.close()


def lease_stats(pair):
    return pair.P.worker.worker.leases.stats


@pytest.mark.parametrize("read_pin", [False, True], ids=["pins-off", "pins-on"])
def test_reads_vouched_for_by_their_words_need_no_pin_and_no_confirm(fabric, read_pin):
    # A producer that publishes held words is never pinned, whatever read_pin says.
    with pair_and_events(fabric, d_extra={"read_pin": read_pin}) as (pair, events):
        prompts = {f"q{i}": list(range(i * 50 + 1, i * 50 + 41)) for i in range(4)}
        params = pair.prefill(prompts)
        results = pair.decode(prompts, params)
        assert all(r.status.value == "finished" and not r.load_failed and r.bad_blocks == []
                   for r in results.values())
        assert events["words_trusted"] == 4 and events["words_fallbacks"] == 0
        assert events["pin_rpcs"] == 0
        assert lease_stats(pair).confirmed == 0 and lease_stats(pair).pinned == 0
        pair.settle()  # released by the RELEASE after the report
        consumer = pair.D.worker.worker._consumer
        assert consumer._words.free == consumer._words._array.shape[0]  # every check gave its slots back


def test_a_producer_that_publishes_no_words_is_pinned_as_before(fabric):
    with pair_and_events(fabric, p_extra={"held_words": False}) as (pair, events):
        prompt = list(range(1, 41))
        r = pair.decode({"x": prompt}, pair.prefill({"x": prompt}))["x"]
        assert not r.load_failed and r.bad_blocks == []
        assert events["words_trusted"] == 0 and events["pin_rpcs"] == 1
        pair.settle()


def test_params_pointed_at_another_request_s_blocks_find_its_words_and_are_refused(fabric):
    with pair_and_events(fabric) as (pair, events):
        victim, attacker = list(range(1, 41)), list(range(101, 141))
        params = pair.prefill({"v": victim, "a": attacker})
        forged = {**params["a"], "remote_block_ids": params["v"]["remote_block_ids"]}
        r = pair.decode({"a": attacker}, {"a": forged})["a"]
        assert r.load_failed, "params pointed at another request's blocks were accepted"
        # Refused as FORGED by the producer either way: by the CONFIRM its words' check fell back to,
        # or, when its answer comes before the reads land, by the first RENEW (the claim, sent while
        # the request waits for admission: the scheduler's renewal_due). Never trusted.
        assert events["words_trusted"] == 0
        assert events["words_fallbacks"] == 1 or (events["words_fallbacks"] == 0 and events["renew_rpcs"] >= 1)
        assert lease_stats(pair).refused_forged >= 1
        honest = pair.decode({"v": victim}, params)["v"]
        assert not honest.load_failed and honest.bad_blocks == []
        pair.P.worker.worker.leases.expire(now=float("inf"))  # the attacker's own lease was never released
        pair.settle()


def test_a_lease_that_ended_under_the_reads_is_a_load_error_though_the_reads_succeeded(fabric):
    # Words only: the forced expiry below would break a pin's promise (a
    # pinned lease ends only when its pin does; tests/rdma/test_read_pins.py).
    with pair_and_events(fabric, p_extra={"lease_ttl_s": 60.0}, d_extra=WORDS_ONLY) as (pair, events):
        prompt = list(range(1, 41))
        params = pair.prefill({"x": prompt})
        fabric.hold = True
        pair.decode({"x": prompt}, params, wait=False)
        wait_until(lambda: fabric.pending, step=pair.pump, what="reads in flight")
        pair.P.worker.worker.leases.expire(now=float("inf"))
        pair.P.step()  # the blocks go back to the engine ...
        assert not pair.P.held
        fabric.hold = False
        fabric.release_all()  # ... and the reads land after that
        wait_until(lambda: pair.D.results.get("x") and pair.D.results["x"].status.value == "finished",
                   step=pair.pump, what="the load's end")
        assert pair.D.results["x"].load_failed, "reads of a lease that ended under them were accepted"
        assert events["words_fallbacks"] == 1 and events["words_trusted"] == 0
        pair.settle()


def test_a_word_read_that_fails_falls_back_to_the_confirm(fabric):
    with pair_and_events(fabric, d_extra=WORDS_ONLY) as (pair, events):
        checks = pair.D.worker.worker._consumer._words
        fabric.fail_chained = 1  # the data lands, the words' read chained behind it fails on the wire
        prompt = list(range(1, 41))
        r = pair.decode({"x": prompt}, pair.prefill({"x": prompt}))["x"]
        assert not r.load_failed and r.bad_blocks == []  # CONFIRMed HELD
        assert events["words_fallbacks"] == 1 and lease_stats(pair).confirmed == 1
        assert fabric.fail_chained == 0
        pair.settle()
        assert checks.free == checks._array.shape[0]


def test_an_abandoned_read_s_word_slots_are_never_given_to_another_check(fabric):
    """A read abandoned at its deadline (UCX did not cancel it) may still
    land, its chained words' read too: its word slots stay out of use, so
    those words can never be compared as a later check's. A read that failed
    in the transport (above: nothing lands later) gives its slots back."""
    with pair_and_events(fabric, d_extra=WORDS_ONLY) as (pair, events):
        checks = pair.D.worker.worker._consumer._words
        full, next_chunk = checks._array.shape[0], checks._free[-1]  # (prepare takes the last free chunk)
        fabric.abandon_next = 1
        prompt = list(range(1, 41))
        params = pair.prefill({"x": prompt})
        r = pair.decode({"x": prompt}, params)["x"]
        assert r.load_failed  # (its peer is failed too: a read that passed its deadline)
        assert checks.quarantined == CHUNK and checks.free == full - CHUNK
        assert pair.D.worker.worker.resources()["word_slots_quarantined"] == CHUNK
        assert next_chunk not in checks._free
        assert len(fabric.late) == 1 and fabric.late[0][1] is not None  # its data and chained read, on the wire
        fabric.land_late()  # they land now, into slots no check will be given
        pair.settle()
        assert events["words_trusted"] == 0


def test_the_words_scratch_full_falls_back_to_the_confirm(fabric):
    with pair_and_events(fabric, d_extra=WORDS_ONLY) as (pair, events):
        checks = pair.D.worker.worker._consumer._words
        taken = checks._free[:]
        checks._free.clear()
        prompt = list(range(1, 41))
        r = pair.decode({"x": prompt}, pair.prefill({"x": prompt}))["x"]
        assert not r.load_failed and r.bad_blocks == []
        assert events["words_fallbacks"] == 1 and lease_stats(pair).confirmed == 1
        checks._free.extend(taken)
        pair.settle()


def test_a_block_two_leases_hold_names_one_and_the_other_lease_s_load_is_confirmed(fabric):
    # b's prompt starts with a's full blocks: the producer's prefix cache gives
    # both leases those blocks, whose words name a's lease (the first holder).
    with pair_and_events(fabric) as (pair, events):
        a = list(range(1, 3 * BS + 1))
        b = a + [7, 7, 7]
        params = pair.prefill({"a": a})
        params.update(pair.prefill({"b": b}))
        shared = set(params["a"]["remote_block_ids"]) & set(params["b"]["remote_block_ids"])
        assert shared, "the producer did not share the prefix: the case tests nothing"
        r = pair.decode({"b": b}, params)["b"]
        assert not r.load_failed and r.bad_blocks == []
        assert events["words_fallbacks"] == 1 and events["words_trusted"] == 0
        assert lease_stats(pair).confirmed == 1 and lease_stats(pair).pinned == 0
        # (a's lease: never loaded here; once it ends, the shared words pass to b's, the other holder.)
        pair.P.worker.worker.leases.expire(now=float("inf"))
        pair.settle()


class CountingTag(bytes):
    compares = 0

    def __eq__(self, other):
        CountingTag.compares += 1
        return bytes.__eq__(self, other)

    __hash__ = bytes.__hash__


def test_dropping_a_lease_costs_its_blocks_not_its_blocks_times_the_leases_sharing_them():
    """``HeldWords._others[b]`` is a list: dropping a lease that does not own
    a shared block's word does ``tag in others`` then ``others.remove(tag)``
    (heldwords.py:141-142), two scans of every live lease sharing the
    block, for each of its shared blocks, under the lease table's lock
    (which the side channel's loop and the engine's ``take_done`` share).
    Leases sharing a prefix (a common system prompt; or a client's
    prefills with do_remote_decode that nobody reads, alive for the TTL)
    make each later lease's end cost blocks x leases."""
    S, L = 64, 2000
    words = HeldWords(S + L + 1)
    shared = list(range(S))
    tags = [word_tag(i.to_bytes(16, "big"), b"b" * 16) for i in range(L)]
    for i, tag in enumerate(tags):
        words.hold(tag, shared + [S + i])
    CountingTag.compares = 0
    words.drop(CountingTag(tags[-1]), shared + [S + L - 1])  # the newest: released first, as a read one is
    assert CountingTag.compares <= 8 * S, (
        f"dropping one lease of {S} shared blocks compared {CountingTag.compares} tags ({L} leases share them)")


class Lists:
    def __init__(self):
        self.remote_lens = []

    def register(self, obj, *, memory_type=None):
        return obj

    def prep_local(self, descs):
        return descs

    def prep_remote(self, peer, descs):
        self.remote_lens.append(len(descs))
        return descs


def test_the_words_region_a_producer_announces_is_capped_by_its_geometry():
    """docs/security.md: a producer's sizes are capped "so it cannot ...
    exhaust the consumer's memory" (the geometry: 2^26 descriptors). The
    handshake's ``words`` is not: ``checked_words`` only asks for at least
    one word per block, and ``WordChecks.prepare`` builds (and the
    connection keeps) a descriptor list of ``nbytes // 16`` entries, on the
    thread posting the load (the engine's). A claim of 2^30 words is 8 GiB
    per numpy temporary (three of them, then the transport's copy); 2^40
    raises MemoryError, caught, every load from that producer."""
    num_blocks = 64
    claimed = wire.RegionWire(0x10000, WORD_BYTES * (num_blocks + (1 << 22)))
    words = checked_words(claimed, num_blocks)
    if words is None:
        return  # refused: fine
    lists = Lists()
    checks = WordChecks(lists, capacity=4 * CHUNK)
    conn = types.SimpleNamespace(name="P/tp0", words=words, words_table=None)
    checks.prepare(conn, np.arange(4, dtype=np.int64), word_tag(b"t" * 16, b"b" * 16))
    assert max(lists.remote_lens) <= num_blocks, (
        f"a producer with {num_blocks} blocks made this consumer prepare {max(lists.remote_lens)} word descriptors")


def test_a_handshake_reply_whose_geometry_has_no_layers_fails_the_peer_not_leaves_it_connecting(fabric):
    """``PeerDirectory._handshake``'s success branch calls
    ``checked_words(reply.words, geometry.num_blocks)`` (protocol 12), and
    ``num_blocks`` is ``min()`` over the layers: a reply with no layers (a
    hostile producer copies the consumer's compat from its HANDSHAKE)
    raises there, outside the try, after ``add_peer`` and after the peer was
    marked READY (``peer.connection`` stays None). The RPC thread logs "a
    bug"; the peer stays READY without a connection for good (never
    redialled, never pruned: ``prune`` needs a connection), its transport
    peer imported, and every load from that address waits its whole
    load_timeout_s."""
    pair = Pair(fabric, d_extra={"load_timeout_s": 1.5})
    try:
        handler = pair.P.worker.worker.side_channel_handler
        genuine = handler.on_handshake

        def hostile(request):
            reply = genuine(request)
            if isinstance(reply, wire.HandshakeReply):
                reply = msgspec.structs.replace(reply, geometry=wire.GeometryWire(reply.geometry.regions, []))
            return reply

        handler.on_handshake = hostile
        prompt = list(range(1, 41))
        params = pair.prefill({"x": prompt})
        pair.decode({"x": prompt}, params)
        assert pair.D.results["x"].load_failed
        consumer = pair.D.worker.worker._consumer
        # (the success branch sets READY before building the Connection: the peer is READY with no
        # connection, so loads wait on it, prune never forgets it, and ``confirmed`` says it is READY)
        stuck = [(p.state, p.connection) for p in consumer.peers._peers.values() if p.state is not PeerStage.FAILED]
        leaked = dict(pair.D.worker.worker._local.transport.peers)
        pair.P.worker.worker.leases.expire(now=float("inf"))
        assert not stuck, f"peer left usable-looking after its handshake failed: {stuck}"
        assert not leaked, f"transport peer of a failed handshake left imported: {list(leaked)}"
    finally:
        pair.close()
