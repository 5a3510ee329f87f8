"""PIN at post (protocol 7): the lease table's read pins, the producer's
sleep waiting for them, and the consumer trusting reads that landed within
their pin -- or CONFIRMing them when they did not, so an expiry is still
never silent. The fake transport's reads copy when they are released
(``FakeFabric.hold``), so a block reused under a held read would show.

The consumers here read producers that publish no held words
(``held_words: false``, :data:`NO_WORDS`): pins are what such a producer's
consumers use, and what a consumer falls back to is the CONFIRM
(``tests/rdma/test_held_words.py`` covers the words)."""

from __future__ import annotations

import threading
import time

import pytest

from leaseutil import A, B, CLAIMED, EPOCH, FORGED, GONE, HELD, KEY, PENDING, Clock, call, ref, state, table_with
from rdma_kv.connector.rdma.leases import LeaseCall, LeaseTable
from rdma_kv.connector.rdma.params import LeaseRef
from rdma_kv.connector.rdma.producer import RdmaProducer
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_testutil import wait_until
from test_connector_fake import Pair

pytestmark = pytest.mark.timeout(60)

NO_WORDS = {"held_words": False}


# --- the lease table ----------------------------------------------------------------------------


def pinned_table(ttl_s=10.0, pin_s=4.0, max_s=300.0):
    clock = Clock()
    table = LeaseTable(clock, max_s=max_s, pin_s=pin_s)
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(1), [10, 11], ttl_s)
    return table, clock


def test_a_pin_holds_the_lease_for_the_time_it_grants():
    table, clock = pinned_table(ttl_s=10.0, pin_s=4.0)
    assert table.pin(call(1)) == ([HELD], 4.0)
    assert table.stats.pinned == 1 and table.stats.renewed == 1
    assert table.pinned_for() == 4.0
    clock.t += 3.9
    assert table.reclaim([1]) == [], "a pinned lease was reclaimed while its consumer reads"
    assert table.stats.reclaim_after_pin == 1 and len(table) == 1
    assert table.renew(call(1)) == [HELD]  # still held, truthfully ...
    assert table.pin(call(1)) == ([HELD], 0.0)  # ... but never pinned again
    assert table.take_done() == set()
    clock.t += 0.2  # the pin ended: the reclaim takes effect, renewals or not
    assert table.pinned_for() <= 0
    assert table.take_done() == {"r1"} and table.stats.reclaimed == 1
    assert table.confirm(call(1), release=True) == [GONE]


def test_a_pin_never_outlasts_the_lease_expiry_or_lifetime():
    table, clock = pinned_table(ttl_s=10.0, pin_s=30.0)
    assert table.pin(call(1)) == ([HELD], 10.0)  # the TTL bounds it
    table, clock = pinned_table(ttl_s=10.0, pin_s=4.0, max_s=12.0)
    clock.t += 9.0
    assert table.renew(call(1)) == [HELD]
    clock.t += 1.5
    assert table.pin(call(1)) == ([HELD], pytest.approx(1.5))  # 1.5 s of lifetime left
    clock.t += 1.5
    assert table.take_done() == {"r1"}, "the lifetime bound no longer ends a pinned lease"


def test_expiry_cannot_end_a_lease_before_its_pin_does():
    table, clock = pinned_table(ttl_s=10.0, pin_s=4.0)
    table.pin(call(1))
    clock.t += 3.9
    assert table.expire() == [] and len(table) == 1


def test_a_refused_pin_grants_nothing_and_records_nothing():
    table, _ = pinned_table()
    assert table.renew(call(1, A)) == [HELD]
    before = state(table)
    assert table.pin(call(1, B)) == ([CLAIMED], 0.0)
    forged = [LeaseCall(LeaseRef(EPOCH, 1, "r1", ref(1).token, ref(2).binding), A)]  # other blocks
    assert table.pin(forged) == ([FORGED], 0.0)
    assert state(table) == before and table.pinned_for() == 0
    assert table.pin(call(2)) == ([PENDING], 0.0)  # not shipped here yet: no pin, the consumer CONFIRMs


def test_the_shortest_pin_of_a_batch_is_granted():
    clock = Clock()
    table = LeaseTable(clock, pin_s=4.0)
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(1), [10, 11], 10.0)
    table.grant(ref(2), [20, 21], 2.0)
    assert table.pin(call(1) + call(2)) == ([HELD, HELD], 2.0)


def test_a_lease_held_but_not_pinned_makes_its_batch_grant_nothing():
    """A lease read by two consumer ranks (heterogeneous TP) is pinned by
    the first, then reclaimed under pressure (deferred to the end of that
    pin); the second pins it in one batch with another lease. It is HELD
    but not pinned again, and the reply's one ``pinned_s`` must not cover
    it: before, the other lease's pin set it (4 s), the second reader
    trusted its reads for 4 s, and the blocks were handed back after 1 s
    (silent: reads of reused blocks accepted). Found by an adversarial
    review."""
    clock = Clock()
    table = LeaseTable(clock, pin_s=4.0)
    table.set_epoch(EPOCH, KEY)
    table.grant(ref(1), [10, 11], 60.0)
    table.grant(ref(2), [20, 21], 60.0)
    assert table.pin([LeaseCall(ref(1), A, 0, 2)]) == ([HELD], 4.0)  # reader 0 pins lease 1 at t0
    clock.t += 1.0
    assert table.reclaim([1]) == []  # deferred to the end of reader 0's pin (t0 + 4)
    clock.t += 2.0
    statuses, pinned_s = table.pin([LeaseCall(ref(1), A, 1, 2), LeaseCall(ref(2), A, 1, 2)])
    assert statuses == [HELD, HELD] and pinned_s == 0.0  # so reader 1 CONFIRMs both
    trusted_until = clock.t + pinned_s
    clock.t += 1.5
    assert table.take_done() == {"r1"} and clock.t >= trusted_until  # handed back, trusted by no one
    assert table.pin([LeaseCall(ref(2), A, 1, 2)]) == ([HELD], 4.0)  # a batch without it pins as before


def test_closed_pins_grant_nothing_until_opened():
    table, _ = pinned_table()
    table.close_pins()
    assert table.pin(call(1)) == ([HELD], 0.0)  # renewed, not pinned: its reads are CONFIRMed
    assert table.pinned_for() == 0 and table.stats.pinned == 0
    table.open_pins()
    assert table.pin(call(1)) == ([HELD], 4.0)


def test_a_release_ends_the_pin_with_the_lease():
    table, _ = pinned_table()
    table.pin(call(1))
    assert table.release(call(1)) == [HELD]
    assert table.pinned_for() == 0 and table.take_done() == {"r1"}


def test_pins_of_zero_seconds_grant_nothing():
    table = table_with(1)
    table.pin_s = 0.0
    assert table.pin(call(1)) == ([HELD], 0.0)
    with pytest.raises(ValueError, match="pin"):
        LeaseTable(Clock(), pin_s=-1.0)


# --- the producer going to sleep ---------------------------------------------------------------


def producer(read_timeout_s):
    settings = RdmaSettings(side_channel_host="127.0.0.1", advertise_host="127.0.0.1", side_channel_port=0,
                            read_timeout_s=read_timeout_s)
    p = RdmaProducer("P", settings, None)
    p.leases.set_epoch(EPOCH, KEY)
    p.leases.grant(ref(1), [10, 11], 60.0)
    return p


def suspend_in_thread(p):
    done = threading.Event()
    threading.Thread(target=lambda: (p.suspend(), done.set()), daemon=True).start()
    return done


def test_sleep_waits_for_a_pinned_read_to_be_released():
    p = producer(read_timeout_s=30.0)
    assert p.leases.pin(call(1))[0] == [HELD]
    done = suspend_in_thread(p)
    assert not done.wait(0.3), "the producer unregistered its KV cache under a pinned read"
    assert len(p.leases) == 1
    assert p.leases.pin(call(1))[1] == 0.0, "a pin was granted while the producer goes to sleep"
    p.leases.release(call(1))  # the consumer's reads landed
    assert done.wait(10), "sleep did not go on once the pin was released"
    assert p.leases.stats.sleep == 0 and p.leases.stats.released == 1


def test_sleep_waits_at_most_for_the_pin_of_a_consumer_that_died():
    p = producer(read_timeout_s=0.5)
    p.leases.pin(call(1))  # and the consumer never releases it
    done = suspend_in_thread(p)
    assert done.wait(10), "sleep waited past the pin"
    assert len(p.leases) == 0 and p.leases.stats.sleep == 1


# --- the consumer (fake transport, real side channel) ----------------------------------------


def totals(engine):
    return engine.worker.worker.stats().totals


def test_reads_within_their_pin_are_trusted_without_a_confirm(fabric):
    pair = Pair(fabric, p_extra=NO_WORDS)
    try:
        prompts = {f"q{i}": list(range(i * 50 + 1, i * 50 + 41)) for i in range(4)}
        params = pair.prefill(prompts)
        results = pair.decode(prompts, params)
        assert all(r.status.value == "finished" and not r.load_failed for r in results.values())
        assert pair.D.verify_blocks
        pair.settle()  # every lease released by the RELEASE after the pin
        d, p = totals(pair.D), totals(pair.P)
        assert d.consumer.pin_trusted == 4 and d.consumer.pin_fallbacks == 0
        assert p.leases.pinned == 4 and p.leases.confirmed == 0 and p.leases.released == 4
    finally:
        pair.close()


def test_read_pin_off_confirms_every_read(fabric):
    pair = Pair(fabric, p_extra=NO_WORDS, d_extra={"read_pin": False})
    try:
        prompt = list(range(1, 41))
        params = pair.prefill({"x": prompt})
        assert not pair.decode({"x": prompt}, params)["x"].load_failed
        pair.settle()
        p = totals(pair.P)
        assert p.leases.pinned == 0 and p.leases.confirmed == 1
    finally:
        pair.close()


def read_held_and_pinned(pair, fabric):
    """Request "x" loading, its reads held, its lease pinned: the producer's lease table."""
    prompt = list(range(1, 41))
    params = pair.prefill({"x": prompt})
    fabric.hold = True
    pair.decode({"x": prompt}, params, wait=False)
    leases = pair.P.worker.worker.leases
    wait_until(lambda: fabric.pending and leases.stats.pinned == 1, step=pair.pump, what="a pinned read")
    return leases


def land(pair, fabric):
    """Let the held reads land; "x"'s result once the decode finished it."""
    fabric.hold = False
    fabric.release_all()
    wait_until(lambda: pair.D.results["x"].status.value == "finished", step=pair.pump)
    return pair.D.results["x"]


def test_reclaim_passes_over_a_lease_read_under_its_pin(fabric):
    pair = Pair(fabric, p_extra=NO_WORDS)
    try:
        leases = read_held_and_pinned(pair, fabric)
        generation = leases.leases()[0].ref.generation
        assert leases.reclaim([generation]) == [], "reclaim took the blocks of a read under its pin"
        pair.P.step()
        assert pair.P.held, "the producer freed blocks a consumer reads under a pin"
        assert leases.stats.reclaim_after_pin == 1
        assert not land(pair, fabric).load_failed and pair.D.verify_blocks
        pair.settle()
    finally:
        pair.close()


@pytest.mark.parametrize("expire", [False, True], ids=["held", "expired"])
def test_reads_landing_after_their_pin_are_confirmed(fabric, expire):
    # The producer pins for its read_timeout_s (0.3 s here); the reads land
    # after that, so the consumer CONFIRMs. If the lease expired meanwhile
    # (and its blocks were freed), that CONFIRM says GONE: a load error.
    pair = Pair(fabric, p_extra={"lease_ttl_s": 60.0, "read_timeout_s": 0.3, **NO_WORDS})
    try:
        leases = read_held_and_pinned(pair, fabric)
        time.sleep(0.35)  # past the pin: its end is a fact of the clock, not of timing
        if expire:
            assert leases.expire(now=float("inf"))
            pair.P.step()
            assert not pair.P.held
        assert land(pair, fabric).load_failed is expire, "an expiry after the pin ended went unseen" if expire else ""
        assert pair.D.verify_blocks
        assert totals(pair.D).consumer.pin_fallbacks == 1
        pair.settle()
    finally:
        pair.close()


def test_a_failing_answer_does_not_stop_the_peers_later_pins(caplog):
    """A bug in handling one answer (here: the callback raises) is logged,
    and the peer's next pins still go out: its task must not die holding
    the peer's "scheduled" mark."""
    from types import SimpleNamespace

    from rdma_kv.connector.rdma import wire
    from rdma_kv.connector.rdma.consumer.pins import Pins
    from rdma_kv.connector.rdma.consumer.records import LoadBook, PinStage

    lease_wire = wire.LeaseWire.of(ref(1), A)
    client = SimpleNamespace(lease_call=lambda request, urgent=False: wire.LeaseReply(
        [HELD] * len(request.leases), 30.0, 5.0))
    pool = SimpleNamespace(submit_renewal=lambda fn, *a, to=None: threading.Thread(target=fn, args=a).start() or True,
                           get=lambda host, port: client)
    leases = SimpleNamespace(of=lambda load, src: (0, SimpleNamespace(to_wire=lambda: lease_wire)))
    answered = []

    def on_answer(load, src, peer, status, pinned_s):
        src.pin = PinStage.HELD
        if load == "first":
            raise RuntimeError("a bug in the answer's handling")
        answered.append((load, status, pinned_s))

    book = LoadBook()
    pins = Pins(book, pool, leases, on_answer, failed=lambda peer, reason: None)
    peer = SimpleNamespace(key="P0", rank=0, address=SimpleNamespace(engine_id="P", rank_address=lambda r: ("h", 1)))
    for load in ("first", "second"):
        src = SimpleNamespace(pin=PinStage.NONE, pin_sent=0.0)
        with book.lock:
            pins.pin(peer, load, src)
        pins.flush(peer)
        if load == "first":
            wait_until(lambda: "a bug" in caplog.text, what="the first answer's failure logged")
    wait_until(lambda: answered, what="the second pin answered")
    assert answered == [("second", HELD, 5.0)]


def test_a_trusted_reads_release_waits_for_send_releases():
    """The RELEASE after a pin is sent by ``send_releases`` (the consumer's
    ``get_finished``, once it has reported the load), not from the callback
    that trusts the reads: sent there, it took the renewal thread and the
    interpreter lock just as the engine's thread was to report the load
    (docs/benchmarks.md, "Read pins"). One task per
    peer, whatever the number of releases queued; a peer's next pins take
    its releases along."""
    from types import SimpleNamespace

    from rdma_kv.connector.rdma import wire
    from rdma_kv.connector.rdma.consumer.pins import Pins
    from rdma_kv.connector.rdma.consumer.records import LoadBook, PinStage
    from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease

    sent, tasks = [], []

    def lease_call(request, urgent=False):
        sent.append(request)
        return wire.LeaseReply([HELD] * len(request.leases), 30.0, 5.0 if isinstance(request, wire.Renew) else 0.0)

    client = SimpleNamespace(lease_call=lease_call)
    pool = SimpleNamespace(submit_renewal=lambda fn, *a, to=None: tasks.append((fn, a)) or True,
                           get=lambda host, port: client)
    address = PeerAddress("P", "h", 1, 1)
    leases = SimpleNamespace(of=lambda load, src: (0, RemoteLease(address, ref(src.generation), A)))
    book = LoadBook()
    pins = Pins(book, pool, leases, on_answer=lambda *a: None, failed=lambda peer, reason: None)
    peer = SimpleNamespace(key="P0", rank=0, address=SimpleNamespace(engine_id="P", rank_address=lambda r: ("h", 1)))

    def run_tasks():
        while tasks:
            fn, args = tasks.pop(0)
            fn(*args)

    with book.lock:
        for generation in (1, 2):
            pins.release(peer, "load", SimpleNamespace(generation=generation, released=False))
    assert tasks == [] and len(pins) == 2, "a trusted read's RELEASE was sent before the load's report"
    with book.lock:
        pins.send_releases()
        pins.send_releases()  # nothing more due: no second task
    assert len(tasks) == 1
    run_tasks()
    assert [type(r) for r in sent] == [wire.Release] and [ls.generation for ls in sent[0].leases] == [1, 2]
    assert len(pins) == 0

    # A release queued while the peer has pins to send goes with them, and is not due again.
    sent.clear()
    with book.lock:
        pins.pin(peer, "load", SimpleNamespace(generation=3, pin=PinStage.NONE, pin_sent=0.0))
        pins.release(peer, "load", SimpleNamespace(generation=4, released=False))
    pins.flush(peer)
    run_tasks()
    assert [type(r) for r in sent] == [wire.Renew, wire.Release]
    with book.lock:
        pins.send_releases()
    assert tasks == []
