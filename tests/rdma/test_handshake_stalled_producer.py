"""A HANDSHAKE to a producer that answered this decode rank before, and now
stalls (a process without a CPU for seconds on a loaded host:
docs/reliability.md, "Processes without a CPU"), does not fail the loads
waiting on it: the peer is STALLED, its loads wait (new ones too), a step
dials it again, and they read once it answers (``consumer.peers``).

Before, ``PeerDirectory._handshake`` made the peer FAILED on any error, and
every load waiting on it recomputed, as did those within ``PEER_RETRY_S``
after. A handshake is made at a decode's first load from a producer rank,
after a peer was pruned idle, after the producer re-registered (sleep), and
after a read failed: the last is what these tests do.

An address that never answered this rank (here a port that accepts and
never answers) still fails its loads at once: a decode must not hold a
load ``load_timeout_s`` on an address a request named.

Event-based: the producer's side channel blocks in its HANDSHAKE handler
(as a stopped process would) until the test has seen the consumer count
two unanswered handshakes; nothing is timed."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from rdma_testutil import wait_until
from test_connector_fake import Pair
from test_pool_isolation import Tarpit

from rdma_kv.connector.rdma import sideclient
from rdma_kv.connector.rdma.consumer import peers as peers_module
from rdma_kv.connector.rdma.consumer.peers import PeerStage

pytestmark = pytest.mark.timeout(120)

# One attempt per call, a short one: a stall outlasts a HANDSHAKE in about a second (once the
# tests shorten HANDSHAKE_TIMEOUT_S, after the first handshake: a slow first answer fails its load).
FAST = {"rpc_timeout_s": 0.5, "rpc_retries": 0, "connect_timeout_s": 0.5, "load_timeout_s": 90.0}


def unanswered(pair: Pair) -> int:
    return pair.D.worker.worker._consumer._book.counters.snapshot().handshakes_unanswered


def failed(pair: Pair) -> list[str]:
    """The requests whose load failed."""
    return [rid for rid, r in pair.D.results.items() if r.load_failed]


def fail_the_peer(pair: Pair) -> None:
    """The first load's peer FAILED (as a failed read makes it), then
    forgotten ``PEER_RETRY_S`` later: the next load handshakes again, with a
    client that the producer answered."""
    consumer = pair.D.worker.worker._consumer
    (old,) = consumer.peers._peers.values()
    consumer.peers.failed(old, "injected: reads failed")
    wait_until(lambda: old.forgotten(consumer._clock(), peers_module.PEER_RETRY_S), timeout_s=30,
               what="the failed peer forgotten")


def stall_handshakes(pair: Pair, monkeypatch, gate: threading.Event, asked: list[float] | None = None) -> None:
    """A first load the producer answers; then the producer's HANDSHAKE
    handler blocks until ``gate`` is set (its side channel's thread stops
    there, as a stopped process does), each call noted in ``asked``, and
    the first load's peer is failed so that the next load handshakes again.
    HANDSHAKE_TIMEOUT_S is shortened only now: a slow first answer must not
    fail the first load."""
    first = {"a": list(range(1, 30))}
    assert not pair.decode(first, pair.prefill(first))["a"].load_failed  # the producer answered
    monkeypatch.setattr(sideclient, "HANDSHAKE_TIMEOUT_S", FAST["rpc_timeout_s"])
    handler = pair.P.worker.worker._producer.handler
    real = handler.on_handshake

    def stalled(request):
        if asked is not None:
            asked.append(time.monotonic())
        gate.wait(60)
        return real(request)

    handler.on_handshake = stalled
    fail_the_peer(pair)


def ended(pair: Pair, rids) -> bool:
    """Whether every request of ``rids`` has its result."""
    results = pair.D.results
    return all(r in results and results[r].status.value in ("finished", "failed", "aborted") for r in rids)


def test_loads_wait_out_a_stalled_handshake_and_read_bit_exact(fabric, monkeypatch, caplog):
    pair = Pair(fabric, d_extra=FAST)
    gate, asked = threading.Event(), []
    try:
        stall_handshakes(pair, monkeypatch, gate, asked)
        prompts = {f"s{i}": list(range(40 + 31 * i, 70 + 31 * i)) for i in range(4)}
        params = pair.prefill(prompts)
        with caplog.at_level(logging.WARNING, logger="rdma_kv"):
            pair.decode(dict(list(prompts.items())[:2]), params, wait=False)
            # Stalled, dialled again, stalled again: the loads still wait; a load added now waits too.
            wait_until(lambda: unanswered(pair) >= 2 or failed(pair), timeout_s=60, step=pair.pump,
                       what="two HANDSHAKE calls unanswered")
            assert not failed(pair), failed(pair)  # before: every waiting load failed with the handshake
            pair.decode(dict(list(prompts.items())[2:]), params, wait=False)
            consumer = pair.D.worker.worker._consumer
            with consumer._lock:
                loads = [consumer._book.loads[rid] for rid in prompts if rid in consumer._book.loads]
                assert loads and all(not ld.stage.terminal for ld in loads), [ld.error for ld in loads]
                waiting = [ld.waiting_on for ld in loads]
            assert any("the HANDSHAKE with 'P' rank 0 (127.0.0.1:" in w and "was not answered" in w
                       for w in waiting), waiting
            gate.set()
            results = pair.D.results
            wait_until(lambda: ended(pair, prompts), timeout_s=60, step=pair.pump, what="the loads")
        for rid in prompts:
            r = results[rid]
            assert r.status.value == "finished" and not r.load_failed, (rid, r)
            assert r.bad_blocks == [] and r.external_tokens, (rid, r)
        assert not [rec for rec in caplog.records if "KV load failed" in rec.getMessage()]
        assert any("was not answered" in rec.getMessage() for rec in caplog.records)  # said once, at WARNING
        (peer,) = pair.D.worker.worker._consumer.peers._peers.values()
        assert peer.state is PeerStage.READY and peer.error is None
        assert len(asked) >= 2
    finally:
        gate.set()
        pair.close()


def test_a_producer_that_never_answers_again_fails_the_loads_at_their_deadline_saying_why(fabric, monkeypatch,
                                                                                          caplog):
    pair = Pair(fabric, d_extra={**FAST, "load_timeout_s": 4.0})
    gate = threading.Event()
    try:
        stall_handshakes(pair, monkeypatch, gate)
        prompts = {"n": list(range(40, 70))}
        params = pair.prefill(prompts)
        with caplog.at_level(logging.WARNING, logger="rdma_kv"):
            results = pair.decode(prompts, params)
        assert results["n"].load_failed
        assert unanswered(pair) >= 1
        (failure,) = [rec.getMessage() for rec in caplog.records if "KV load failed" in rec.getMessage()]
        assert "not finished within load_timeout_s=4.0 (stage handshake): the HANDSHAKE with 'P' rank 0 " \
               "(127.0.0.1:" in failure and "was not answered" in failure, failure
    finally:
        gate.set()
        pair.close()


def test_a_load_from_an_address_that_never_answered_fails_at_once(fabric, monkeypatch, caplog):
    """The tarpit rule: a port that accepts and never answers this rank
    fails the handshake's loads after its call's attempts (not at
    ``load_timeout_s``, 90 s here), and is not STALLED."""
    monkeypatch.setattr(sideclient, "HANDSHAKE_TIMEOUT_S", FAST["rpc_timeout_s"])
    pair = Pair(fabric, d_extra=FAST)
    tarpit = Tarpit()
    try:
        prompts = {"t": list(range(1, 30))}
        params = pair.prefill(prompts)
        params["t"] = {**params["t"], "remote_port": tarpit.port}
        with caplog.at_level(logging.WARNING, logger="rdma_kv"):
            results = pair.decode(prompts, params)
        assert results["t"].load_failed
        failures = [rec.getMessage() for rec in caplog.records if "KV load failed" in rec.getMessage()]
        assert failures and all(f"handshake with 127.0.0.1:{tarpit.port} failed" in f and "timed out" in f
                                and "load_timeout_s" not in f for f in failures), failures
        assert unanswered(pair) == 0
    finally:
        tarpit.close()
        pair.close()


def test_a_producer_whose_client_was_closed_idle_is_still_known_live(fabric, monkeypatch):
    """The handshake after an idle spell: the pool closed the client that
    the producer answered (``ClientPool.prune``, as after ``idle_s``) and
    makes a new one, which remembers that the address answered; so a
    producer that stalls then is waited out, not taken for an address that
    never answered. Before, the new client knew nothing and the load
    failed at once with the handshake's timeout."""
    pair = Pair(fabric, d_extra=FAST)
    gate = threading.Event()
    try:
        stall_handshakes(pair, monkeypatch, gate)
        pool = pair.D.worker.worker._pool
        assert pool.prune(lambda: set(), now=time.monotonic() + pool.idle_s + 1) == 1  # closed idle
        prompts = {"i": list(range(40, 70))}
        params = pair.prefill(prompts)
        # The client the load will call, made now, knows the address answered (before: it did not,
        # unless a lease call happened to be answered first, so the load below could pass without it).
        assert pool.get(params["i"]["remote_host"], params["i"]["remote_port"]).has_answered
        pair.decode(prompts, params, wait=False)
        wait_until(lambda: unanswered(pair) >= 1 or failed(pair), timeout_s=60, step=pair.pump,
                   what="a HANDSHAKE unanswered")
        assert not failed(pair), [pair.D.results[r].error for r in failed(pair)]  # before: failed at once
        gate.set()
        results = pair.D.results
        wait_until(lambda: ended(pair, ["i"]), timeout_s=60, step=pair.pump, what="the load")
        assert results["i"].status.value == "finished" and not results["i"].load_failed, results["i"]
        assert results["i"].bad_blocks == []
    finally:
        gate.set()
        pair.close()
