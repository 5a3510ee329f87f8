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

import pytest
from rdma_testutil import wait_until
from test_connector_fake import Pair

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
