"""A decode that goes to sleep (vLLM sleep mode) while a push into it runs
finishes that load after it wakes: its request recomputes, its blocks come
back. Before, the consumer made at the wake never asked about the pushes
the one before the sleep had left: the request stayed 'loading' for ever
with its blocks held (found by an adversarial review)."""

from __future__ import annotations

import time

import pytest
from fakes import FakeFabric

from rdma_kv.connector import KVTransferConfig
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(120)
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64, dtype="float32")


def config(role, engine_id):
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"mode": "push", "rpc_timeout_s": 1.0, "load_timeout_s": 5.0,
                                                       "read_timeout_s": 1.0, "lease_max_s": 20.0})


def test_a_decode_that_sleeps_mid_push_finishes_the_load_after_it_wakes():
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    D = Engine(config("kv_consumer", "D"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    try:
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
