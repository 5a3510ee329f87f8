"""A producer rank no load uses any more is forgotten: its transport peer
(endpoint, remote keys), slot tables and side-channel client go.

``PeerDirectory.prune`` forgot FAILED peers only. A producer that left
after its last load was confirmed and released (scaled down, restarted at
another address) is never dialled again, so its peer stayed READY, and
with it its endpoint, keys and prepared remote slot table (~20 B a slot),
for the consumer's life; and since every known peer counted as in use, its
side-channel client was never closed either. Found by an adversarial
review: an hour after the producer left, {'peers': 1, 'clients': 1}."""

from __future__ import annotations

import time

import pytest

from test_connector_fake import Pair

pytestmark = pytest.mark.timeout(60)


def step_at(pair, later):
    """One decode step whose clock reads ``later`` (the consumer's clock)."""
    consumer = pair.D.worker.worker._consumer
    consumer._clock = lambda: later
    consumer._pool._clock = lambda: later
    pair.D.step()


def test_a_producer_no_load_uses_is_forgotten_and_a_later_load_handshakes_again(fabric):
    pair = Pair(fabric)
    try:
        prompts = {f"r{i}": list(range(1 + i, 30 + i)) for i in range(3)}
        results = pair.decode(prompts, pair.prefill(prompts))
        assert all(r.status.value == "finished" and not r.load_failed for r in results.values())
        pair.settle()
        worker = pair.D.worker.worker
        consumer = worker._consumer
        idle_s = consumer._pool.idle_s
        transport = consumer._local.transport
        before = worker.resources()
        assert before["peers"] == 1 and before["clients"] == 1 and len(transport.peers) == 1
        assert not any(transport.paired.values()), "pull mode's reads keep every lane (nothing to pair)"
        now = time.perf_counter()
        step_at(pair, now + idle_s / 2)  # used recently: kept
        assert worker.resources()["peers"] == 1 and len(transport.peers) == 1
        step_at(pair, now + idle_s + 1)
        after = worker.resources()
        assert after["peers"] == 0 and after["clients"] == 0 and len(transport.peers) == 0
        assert transport.fenced == [], "an idle producer is closed gracefully, not fenced"
        assert consumer._book.counters.snapshot().peers_forgotten == 1
        # The producer is still there: the next load handshakes again, and reads right.
        consumer._clock = consumer._pool._clock = time.perf_counter
        more = {"r9": list(range(50, 80))}
        results = pair.decode(more, pair.prefill(more))
        assert results["r9"].status.value == "finished" and not results["r9"].load_failed
        assert results["r9"].bad_blocks == []
        assert worker.resources()["peers"] == 1
    finally:
        pair.close()


def test_a_peer_a_load_reads_from_is_kept_however_idle(fabric):
    """Idle by the clock but named by a load in the book (its reads on the
    wire, its CONFIRM queued): kept, since removing the transport peer
    would cancel those reads. ``LoadBook.peer_keys`` names it while the
    load is in the book."""
    pair = Pair(fabric)
    try:
        prompts = {"a": list(range(1, 30))}
        results = pair.decode(prompts, pair.prefill(prompts))
        assert results["a"].status.value == "finished"
        consumer = pair.D.worker.worker._consumer
        later = time.perf_counter() + 10 * consumer._pool.idle_s
        with consumer._lock:
            (key,) = [peer.key for peer in consumer.peers._peers.values()]
            assert consumer.peers.prune(later, lambda: {key}) == []  # a load reads from it
            assert len(consumer.peers) == 1
            (name,) = consumer.peers.prune(later, set)  # none does
            assert len(consumer.peers) == 0
        assert name in consumer._local.transport.peers  # removed by the caller, without the lock
        consumer.peers.remove([name])
        assert name not in consumer._local.transport.peers
    finally:
        pair.close()


def test_a_late_removal_of_a_failed_peer_leaves_its_successor_alone(fabric):
    """``PeerDirectory.failed`` (and ``prune``) remove the transport peer
    after releasing the lock. A thread stalled there for longer than
    ``PEER_RETRY_S`` while a new load dialled the producer again removed
    the *new* handshake's transport peer, since both had one name: the new
    peer stayed READY in the directory with no transport peer behind it,
    and every load from it failed. Each handshake now has its own
    transport name, so a late removal removes only its own."""
    from rdma_kv.connector.rdma.consumer.peers import PEER_RETRY_S

    pair = Pair(fabric)
    try:
        first = {"a": list(range(1, 30))}
        assert not pair.decode(first, pair.prefill(first))["a"].load_failed
        consumer = pair.D.worker.worker._consumer
        directory, transport = consumer.peers, consumer._local.transport
        (old,) = directory._peers.values()
        stalled: list[str] = []
        real_remove = directory._remove
        # the failing thread stalls before its removal (fenced: the peer failed)
        directory._remove = lambda name, fence=False: stalled.append((name, fence))
        directory.failed(old, "injected: reads failed")
        directory._remove = real_remove
        assert stalled == [(old.connection.name, True)]
        consumer._clock = lambda: time.perf_counter() + PEER_RETRY_S + 1
        second = {"b": list(range(40, 70))}
        assert not pair.decode(second, pair.prefill(second))["b"].load_failed  # dialled again
        (new,) = directory._peers.values()
        assert new is not old and new.connection.name in transport.peers
        real_remove(*stalled[0])  # the stalled thread goes on
        assert new.connection.name in transport.peers
        third = {"c": list(range(80, 110))}
        result = pair.decode(third, pair.prefill(third))["c"]
        assert result.status.value == "finished" and not result.load_failed and result.bad_blocks == []
    finally:
        pair.close()
