"""A load's ``remote_registration`` is a client's word (vLLM's server takes
``kv_transfer_params`` from clients). A decode whose peer of a producer rank
is READY under registration N, given params naming N+1, used to forget that
peer at once, fencing its transport peer: every other read in flight from
that producer failed (found by a review, 2026-12-03; one request could do it
every step). Now a handshake asks the producer first
(``PeerDirectory._check``): the peer is replaced only when the reply shows
the producer did re-register (it slept and woke), and otherwise the params
are refused, saying the producer is at N, while the peer reads on."""

from __future__ import annotations

import threading

import pytest
from rdma_testutil import wait_until
from test_connector_fake import Pair
from test_handshake_stalled_producer import FAST, ended, unanswered

from rdma_kv.connector.rdma import sideclient
from rdma_kv.connector.rdma.consumer.peers import PeerStage

pytestmark = pytest.mark.timeout(120)


def _ended(engine, rid):
    r = engine.results.get(rid)
    return r is not None and r.status.value in ("finished", "failed", "aborted")


def _events(engine):
    return engine.worker.worker._consumer._book.counters.snapshot()


def test_params_claiming_a_newer_registration_leave_other_loads_from_that_producer_alone(fabric, caplog):
    pair = Pair(fabric, d_extra={"read_pin": False})
    try:
        victim, forger = list(range(1, 41)), list(range(101, 141))
        params = pair.prefill({"v": victim, "f": forger})
        fabric.hold = True  # the victim's reads stay on the wire
        pair.decode({"v": victim}, params, wait=False)
        wait_until(lambda: fabric.pending, step=pair.pump, what="the victim's reads in flight")
        registration = int(params["f"].get("remote_registration") or 1)
        forged = {**params["f"], "remote_registration": registration + 1}
        pair.decode({"f": forger}, {"f": forged}, wait=False)
        wait_until(lambda: _ended(pair.D, "f"), step=pair.pump, what="the forged request's end")
        fabric.hold = False
        fabric.release_all()
        wait_until(lambda: _ended(pair.D, "v"), step=pair.pump, what="the victim's end")
        victim_result = pair.D.results["v"]
        assert not victim_result.load_failed, (
            "another client's params (a made-up remote_registration) fenced the producer's transport peer "
            "and failed this load")
        assert victim_result.external_tokens and not victim_result.bad_blocks, victim_result
        assert pair.D.results["f"].load_failed
        said = [r.getMessage() for r in caplog.records if "request 'f': KV load failed" in r.getMessage()]
        assert said and f"name registration {registration + 1}" in said[0], said
        assert f"at registration {registration} (its handshake says so)" in said[0], said
        assert _events(pair.D).registration_checks == 1
        pair.P.worker.worker.leases.expire(now=float("inf"))  # the forger's lease: never read
        pair.settle()
    finally:
        pair.close()


def test_a_producer_that_woke_is_read_through_a_new_peer_once_its_handshake_says_so(fabric):
    """The path the check must keep: the producer slept and woke (a new
    registration, new keys) while the decode's peer of it stayed READY;
    the new params are read, verified, through a peer handshaken again,
    and the old transport peer is gone."""
    pair = Pair(fabric)
    try:
        first = {"a": list(range(1, 41))}
        pair.decode(first, pair.prefill(first))
        assert not pair.D.results["a"].load_failed
        transport = pair.D.worker.worker._local.transport
        before = set(transport.peers)
        pair.P.sleep()
        pair.P.wake_up()
        second = {"b": list(range(201, 241))}
        params = pair.prefill(second)
        assert int(params["b"]["remote_registration"]) == 2, params["b"]
        pair.decode(second, params)
        result = pair.D.results["b"]
        assert not result.load_failed and result.external_tokens and not result.bad_blocks, result
        assert _events(pair.D).registration_checks == 1
        assert not before & set(transport.peers), "the old registration's transport peer is still imported"
        pair.settle()
    finally:
        pair.close()


# --- a check the producer does not answer, whose peer fails meanwhile (a review, stop 69) ------------


def _woken_and_stalled(pair, monkeypatch, gate):
    """A first load READY at registration 1; the producer sleeps and wakes
    (registration 2) with the decode's peer still READY; then its HANDSHAKE
    handler blocks until ``gate``. Returns params of registration 2."""
    first = {"a": list(range(1, 30))}
    assert not pair.decode(first, pair.prefill(first))["a"].load_failed
    pair.P.sleep()
    pair.P.wake_up()
    second = {"b": list(range(201, 231)), "c": list(range(301, 331))}
    params = pair.prefill(second)
    assert int(params["b"]["remote_registration"]) == 2
    monkeypatch.setattr(sideclient, "HANDSHAKE_TIMEOUT_S", FAST["rpc_timeout_s"])
    handler = pair.P.worker.worker._producer.handler
    real = handler.on_handshake

    def stalled(request):
        gate.wait(60)
        return real(request)

    handler.on_handshake = stalled
    return params


def test_a_stalled_check_whose_peer_failed_meanwhile_is_dialled_again_once_the_producer_answers(fabric, monkeypatch):
    pair = Pair(fabric, d_extra={**FAST, "load_timeout_s": 10.0})
    gate = threading.Event()
    try:
        params = _woken_and_stalled(pair, monkeypatch, gate)
        consumer = pair.D.worker.worker._consumer
        pair.decode({"b": list(range(201, 231))}, params, wait=False)
        wait_until(lambda: unanswered(pair) >= 1, timeout_s=30, step=pair.pump, what="the check unanswered")
        (old,) = consumer.peers._peers.values()
        assert old.state is PeerStage.READY and old.checking is not None
        # A read through the old peer fails (stale params of registration 1, a pin, a push refused ...)
        consumer.peers.failed(old, "injected: a read through the old registration failed")
        # The old peer is forgotten (prune) while its check is STALLED or dialled again: its loads
        # go to a new dialling (before, the check was never dialled again and b failed at its deadline).
        wait_until(lambda: consumer.peers._peers.get(old.key) is not old
                   and (old.checking is None or old.checking.state is PeerStage.STALLED), timeout_s=30,
                   step=pair.pump, what="the failed peer forgotten, its check handed on or stalled")
        gate.set()  # the producer answers from now on
        wait_until(lambda: ended(pair, ["b"]), timeout_s=60, step=pair.pump, what="b")
        r = pair.D.results["b"]
        assert not r.load_failed, r
    finally:
        gate.set()
        pair.close()


def test_a_stalled_checks_loads_join_the_new_dialling_after_the_old_peer_is_forgotten(fabric, monkeypatch):
    pair = Pair(fabric, d_extra={**FAST, "load_timeout_s": 10.0})
    gate = threading.Event()
    try:
        params = _woken_and_stalled(pair, monkeypatch, gate)
        consumer = pair.D.worker.worker._consumer
        pair.decode({"b": list(range(201, 231))}, params, wait=False)
        wait_until(lambda: unanswered(pair) >= 1, timeout_s=30, step=pair.pump, what="the check unanswered")
        (old,) = consumer.peers._peers.values()
        consumer.peers.failed(old, "injected: a read through the old registration failed")
        wait_until(lambda: consumer.peers._peers.get(old.key) is not old
                   and (old.checking is None or old.checking.state is PeerStage.STALLED), timeout_s=30,
                   step=pair.pump, what="the failed peer forgotten, its check handed on or stalled")
        gate.set()
        pair.decode({"c": list(range(301, 331))}, params, wait=False)  # same registration: a new peer
        wait_until(lambda: ended(pair, ["c"]), timeout_s=60, step=pair.pump, what="c")
        assert not pair.D.results["c"].load_failed, pair.D.results["c"]
        wait_until(lambda: ended(pair, ["b"]), timeout_s=60, step=pair.pump, what="b")
        assert not pair.D.results["b"].load_failed, pair.D.results["b"]
    finally:
        gate.set()
        pair.close()
