"""A load's stages end to end (``LoadRecord``: ``start_s``, ``transfer_s``,
``finish_s``): every finished load records each of them, none is negative,
and together they fit in ``total_s``; ``start_s`` runs from the binding of
the step's metadata, so an engine's forward pass between ``bind`` and
``start_load_kv`` is in it. Harness engines on the fake transport and, once,
on real UCX (two agents in this process)."""

from __future__ import annotations

import time

import pytest
from fakes import FakeFabric
from netutil import free_base_port
from rdma_testutil import prefill_then_decode, wait_until

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma.stats import LoadRecord
from rdma_kv.connector.rdma.statsparse import parse_load_record, parse_worker_stats
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(120)

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_size=8, block_size=4, num_blocks=128, dtype="float32")
SLACK_S = 1e-6  # the stages and total_s are differences of the same clock's reads


def config(role: str, engine_id: str, port: int = 0) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=port,
                            kv_connector_extra_config={"rpc_timeout_s": 2.0, "load_timeout_s": 10.0})


def run_loads(P: Engine, D: Engine, prompts: dict[str, list[int]]) -> list[LoadRecord]:
    """Prefill on P, load on D; the decode worker's records of these loads."""
    for rid, r in prefill_then_decode(P, D, prompts).items():
        assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], (rid, r.error)
    records = []
    for part in D.ranks:
        stats = part.worker.get_kv_connector_stats()
        assert stats is not None
        records += list(parse_worker_stats(stats).requests)
    return records


def check_stages(records: list[LoadRecord], expected: int) -> None:
    assert len(records) == expected
    for rec in records:
        assert rec.ok, rec
        stages = {name: getattr(rec, name) for name in ("start_s", "transfer_s", "finish_s", "confirm_s")}
        missing = [name for name, value in stages.items() if value is None]
        assert not missing, f"{rec.request_id}: stages not recorded: {missing}"
        negative = {name: value for name, value in stages.items() if value < 0}
        assert not negative, f"{rec.request_id}: negative stages {negative}"
        assert rec.start_s + rec.transfer_s + rec.finish_s <= rec.total_s + SLACK_S, rec
        assert rec.confirm_s <= rec.finish_s + SLACK_S, rec  # the CONFIRM round trip is part of finish_s


def prompts(rng, n: int) -> dict[str, list[int]]:
    return {f"r{i}": rng.integers(1, 999, int(rng.integers(5, 40))).tolist() for i in range(n)}


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1)])  # (2, 1): two sources per load
def test_every_load_records_its_stages_and_they_fit_in_its_total(rng, p_tp, d_tp):
    kw = {"transport_factory": FakeFabric().factory}
    port = free_base_port(max(p_tp, d_tp))
    P = Engine(config("kv_producer", "P", port if p_tp > 1 else 0), SHAPE, tp_size=p_tp, connector_kwargs=kw)
    D = Engine(config("kv_consumer", "D", port + 10 if d_tp > 1 else 0), SHAPE, tp_size=d_tp,
               connector_kwargs=kw)
    try:
        check_stages(run_loads(P, D, prompts(rng, 6)), 6 * d_tp)
    finally:
        P.shutdown()
        D.shutdown()


class SlowForward(Engine):
    """A decode engine whose forward pass takes at least ``FORWARD_S``."""

    FORWARD_S = 0.05

    def _forward(self, compute, part):  # type: ignore[no-untyped-def]
        time.sleep(self.FORWARD_S)
        super()._forward(compute, part)


def test_start_runs_from_the_bound_metadata_through_the_forward_pass(rng):
    """vLLM 0.32 binds the step's metadata, runs the forward pass, then calls
    ``start_load_kv``: the load waited for the forward pass, and ``start_s`` says so."""
    kw = {"transport_factory": FakeFabric().factory}
    P = Engine(config("kv_producer", "P"), SHAPE, connector_kwargs=kw)
    D = SlowForward(config("kv_consumer", "D"), SHAPE, connector_kwargs=kw)
    try:
        records = run_loads(P, D, prompts(rng, 2))
        check_stages(records, 2)
        for rec in records:
            assert rec.start_s >= SlowForward.FORWARD_S, rec
    finally:
        P.shutdown()
        D.shutdown()


def test_get_finished_settles_completed_reads_on_the_engine_thread(rng):
    """While a load is in flight, every ``get_finished`` asks the transport to
    settle what completed (on the engine's thread, not only the transport's
    service thread); with nothing in flight it does not."""
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P"), SHAPE, connector_kwargs=kw)
    D = Engine(config("kv_consumer", "D"), SHAPE, connector_kwargs=kw)
    try:
        reader = fabric.agents[D.worker.worker.agent_name]
        prefill_then_decode(P, D, prompts(rng, 1))
        idle = reader.settles
        D.step()
        assert reader.settles == idle, "settled with no load in flight"
        fabric.hold = True  # reads stay in flight until released
        more = {f"h{rid}": p for rid, p in prompts(rng, 1).items()}
        for rid, prompt in more.items():
            P.add_request(rid, prompt, {"do_remote_decode": True})
        P.run(until=lambda: all(P.results.get(r) and P.results[r].status.value == "finished" for r in more))
        for rid, prompt in more.items():
            D.add_request(rid, prompt, P.results[rid].kv_transfer_params)
        wait_until(lambda: bool(fabric.pending), step=lambda: (P.step(), D.step()), what="the read posted")
        before = reader.settles
        for _ in range(3):
            D.step()
        assert reader.settles >= before + 3
        fabric.hold = False
        fabric.release_all()
        wait_until(lambda: all(D.results[r].status.value == "finished" for r in more),
                   step=lambda: (P.step(), D.step()), what="the held load")
    finally:
        P.shutdown()
        D.shutdown()


def test_the_stages_survive_the_boundary_form():
    rec = LoadRecord(request_id="r", ok=True, total_s=0.01, start_s=0.001, transfer_s=0.005, finish_s=0.003,
                     confirm_s=0.002, nbytes=1 << 20)
    data = rec.to_dict()
    assert {"start_s", "finish_s"} <= set(data)
    assert parse_load_record(data) == rec
    # A load that failed before posting measured neither: the keys are absent, not 0.
    failed = LoadRecord(request_id="f", ok=False, total_s=1.0, error="handshake failed")
    assert "start_s" not in failed.to_dict() and "finish_s" not in failed.to_dict()
    assert parse_load_record(failed.to_dict()) == failed


@pytest.mark.ucx
def test_stages_over_ucx(rng):
    P = Engine(config("kv_producer", "P"), SHAPE)
    D = Engine(config("kv_consumer", "D"), SHAPE)
    try:
        check_stages(run_loads(P, D, prompts(rng, 4)), 4)
    finally:
        P.shutdown()
        D.shutdown()
