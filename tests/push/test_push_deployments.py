"""Push mode in the deployments pull serves: heterogeneous tensor parallel
(each producer rank writes the heads each decode rank owns) and decode-side
prefix hits (only what the decode lacks is written); hybrid models (a
sliding-window group written only inside its window) are
``tests/rdma/test_hybrid.py``'s load test, run in both modes. Harness engines and
connectors in this process over the fake transport (its writes copy, then
notify); every block verified."""

from __future__ import annotations

import pytest
from fakes import FakeFabric
from netutil import free_base_port
from rdma_testutil import prefill_then_decode, wait_until

from rdma_kv.connector import KVTransferConfig
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(120)


def config(role: str, engine_id: str, port: int, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=port,
                            kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"mode": "push", "rpc_timeout_s": 1.0,
                                                       "load_timeout_s": 5.0, **extra})


def shape(heads: int) -> ModelShape:
    return ModelShape(num_layers=2, num_kv_heads=heads, head_size=8, block_size=4, num_blocks=128, dtype="float32")


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [(2, 1, 4), (1, 2, 4), (4, 2, 4), (1, 2, 1), (4, 1, 2), (2, 2, 4)])
def test_heterogeneous_tp_every_head_is_written_bit_exact(rng, p_tp, d_tp, heads):
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P", free_base_port(p_tp)), shape(heads), tp_size=p_tp, connector_kwargs=kw)
    D = Engine(config("kv_consumer", "D", free_base_port(d_tp)), shape(heads), tp_size=d_tp, connector_kwargs=kw)
    try:
        def pump():
            P.step()
            D.step()

        prompts = {f"r{i}": rng.integers(1, 999, int(rng.integers(5, 30))).tolist() for i in range(6)}
        for rid, r in prefill_then_decode(P, D, prompts).items():
            assert r.status.value == "finished" and not r.load_failed, (rid, r.error)
            assert r.external_tokens and r.bad_blocks == [], rid
        assert fabric.writes > 0 and fabric.reads == 0, "push mode read, or wrote nothing"
        wait_until(lambda: not P.held and not D.requests and all(len(r.worker.worker.leases) == 0 for r in P.ranks),
                   step=pump, what="every producer rank handed its blocks back")
        assert P.num_free_blocks() == P.shape.num_blocks
    finally:
        P.shutdown()
        D.shutdown()


def test_a_decode_prefix_hit_writes_only_what_the_decode_lacks(rng):
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P", 0), shape(2), connector_kwargs=kw)
    D = Engine(config("kv_consumer", "D", 0), shape(2), connector_kwargs=kw)
    try:
        def pump():
            P.step()
            D.step()

        base = rng.integers(1, 999, 12).tolist()  # three whole blocks, cached on the decode by the first request
        prompts = {"a": base + [5], "b": base + [6, 7, 8, 9, 10]}
        for rid, prompt in prompts.items():
            P.add_request(rid, prompt, {"do_remote_decode": True})
        wait_until(lambda: all(P.results.get(r) and P.results[r].status.value == "finished" for r in prompts),
                   step=pump, what="prefills")
        for rid in ("a", "b"):
            D.add_request(rid, prompts[rid], P.results[rid].kv_transfer_params)
            wait_until(lambda rid=rid: D.results.get(rid) and D.results[rid].status.value == "finished",
                       step=pump, what=rid)
        a, b = D.results["a"], D.results["b"]
        assert a.local_hit_tokens == 0 and b.local_hit_tokens == 12, (a, b)
        assert b.external_tokens == 5 and b.bad_blocks == [] and not b.load_failed
        (rec_b,) = [r for r in D.worker.get_kv_connector_stats()["requests"] if r["request_id"] == "b"]
        assert rec_b["nbytes"] == 2 * D.shape.block_nbytes  # blocks 3 and 4 of b, not the three it had
    finally:
        P.shutdown()
        D.shutdown()

