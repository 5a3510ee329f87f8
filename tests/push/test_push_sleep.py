"""A decode that goes to sleep (vLLM sleep mode) while a push into it runs
finishes that load after it wakes: its request recomputes, its blocks come
back. Before, the consumer made at the wake never asked about the pushes
the one before the sleep had left: the request stayed 'loading' for ever
with its blocks held (found by an adversarial review)."""

from __future__ import annotations

import time

import pytest
from fakes import FakeFabric
from rdma_testutil import prefill_then_decode

from rdma_kv.connector import KVTransferConfig
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(120)
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64, dtype="float32")


def config(role, engine_id, policy="recompute"):
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_load_failure_policy=policy,
                            kv_connector_extra_config={"mode": "push", "rpc_timeout_s": 1.0, "load_timeout_s": 5.0,
                                                       "read_timeout_s": 1.0, "lease_max_s": 20.0})


def held_push(P, D, fabric):
    """Request 'r' prefilled on P, its push to D started and its writes held
    on the fabric (``fabric.hold``)."""
    prompt = list(range(1, 30))
    P.add_request("r", prompt, {"do_remote_decode": True})
    P.run(until=lambda: "r" in P.results and P.results["r"].status.value == "finished")
    fabric.hold = True
    D.add_request("r", prompt, P.results["r"].kv_transfer_params)
    deadline = time.monotonic() + 10
    while not fabric.pending:
        assert time.monotonic() < deadline, "the push never started"
        P.step()
        D.step()
        time.sleep(0.01)


def test_a_decode_that_sleeps_mid_push_finishes_the_load_after_it_wakes():
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    D = Engine(config("kv_consumer", "D"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    try:
        held_push(P, D, fabric)
        D.sleep()  # its writes still held on the wire
        D.wake_up()
        fabric.hold = False
        fabric.release_all()
        deadline = time.monotonic() + 30  # the push's own bound is lease_max_s + read_timeout_s = 21 s
        while D.requests and time.monotonic() < deadline:
            P.step()
            D.step()
            time.sleep(0.01)
        assert not D.requests, "the request never finished after a sleep mid-push"
        result = D.results["r"]
        assert result.status.value == "finished" and result.load_failed  # recomputed: the sleep failed the load
        assert D.worker.worker.resources()["pushes_running"] == 0
        deadline = time.monotonic() + 10
        while (D.held or P.held) and time.monotonic() < deadline:
            P.step()
            D.step()
            time.sleep(0.01)
        assert not D.held and not P.held and D.pool.num_free == SHAPE.num_blocks
    finally:
        fabric.hold = False
        fabric.release_all()
        P.shutdown()
        D.shutdown()


def test_a_push_adopted_while_a_call_of_the_old_consumer_is_in_flight_is_dropped_once_resolved():
    """The wake adopts a push whose PUSH or query is still on an RPC thread
    of the consumer before the sleep; that call's answer resolves it there.
    The new consumer drops it at its next poll: before, it stayed running
    and every poll queried the producer about it again, for ever (found by
    a review of the adoption)."""
    from types import SimpleNamespace

    from rdma_kv.connector.rdma import wire
    from rdma_kv.connector.rdma.consumer.pushes import PushHandle, Pushes

    submitted = []
    pool = SimpleNamespace(submit=lambda fn, handle, to=None: submitted.append(handle) or True)

    def pushes():
        local = SimpleNamespace(transport=SimpleNamespace(get_notifications=lambda: []))
        settings = SimpleNamespace(rpc_timeout_s=1.0, lease_max_s=20.0, read_timeout_s=1.0, tp_rank=0)
        return Pushes(local, "D", 1, b"x" * 8, settings, pool, lambda peer, why: None, lambda heads: None,
                      clock=lambda: 100.0)

    old, new = pushes(), pushes()
    handle = PushHandle(b"t" * 16, SimpleNamespace(rank=0), None, 0, 0, 0.0, hard_deadline=121.0)
    fired = []
    handle.add_done_callback(fired.append)
    old._running[handle.token] = handle
    old.abort(handle)  # the sleep failed the load: the push is asked to stop
    handle.busy = True  # ... while a call of it is on an RPC thread
    new.adopt(old)
    assert new.running() == 1
    old._after(handle, wire.PushReply(wire.PushState.ABORTED, "stopped"), None)  # that call's answer
    assert handle.done() and fired == [handle]
    for _ in range(3):
        new.poll()
    assert submitted == [] and new.running() == 0


def test_a_decode_that_woke_from_sleep_is_introduced_on_its_first_new_link():
    """The decode keeps its incarnation across a sleep, but its transport (its
    UCX worker) is new: its first link after the wake is endpoint 1 of the new
    worker. The producer still holds the record of the decode's old worker
    (ordinal 1, registration 1) and compares the two workers' ordinals:
    PUSH_HELLO 'out of date', the handshake failed and the load recomputed
    (with N links before the sleep, the first N handshakes after the wake;
    found by a review). Ordinals are compared within one registration."""
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    D = Engine(config("kv_consumer", "D"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    try:
        r = prefill_then_decode(P, D, {"before": list(range(1, 30))}, 30)["before"]
        assert r.status.value == "finished" and not r.load_failed, r.error
        D.sleep()
        D.wake_up()
        r = prefill_then_decode(P, D, {"after": list(range(2, 31))}, 30)["after"]
        assert not r.load_failed, f"the first load after the decode's wake failed: {r.error}"
    finally:
        P.shutdown()
        D.shutdown()
