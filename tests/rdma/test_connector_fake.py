"""Scheduler and worker of the RDMA connector against the fake transport,
driven by two in-process harness engines (the side channel is real, on
127.0.0.1 with OS-chosen ports)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from rdma_testutil import wait_until

from rdma_kv.connector import KVCacheBlocks, KVConnectorRole, KVTransferConfig, Request, SchedulerOutput
from rdma_kv.connector.rdma import RdmaConnector, RdmaConnectorMetadata, Transport
from rdma_kv.connector.rdma.params import parse_kv_transfer_params
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(60)

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=512)
BS = SHAPE.block_size


def config(role, engine_id, policy="recompute", **extra):
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_load_failure_policy=policy,
                            kv_connector_extra_config={"rpc_timeout_s": 1.0, "load_timeout_s": 5.0, **extra})


class Pair:
    def __init__(self, fabric, policy="recompute", p_extra=None, d_extra=None, d_shape=SHAPE):
        self.fabric = fabric
        kw = {"transport_factory": fabric.factory}
        self.P = Engine(config("kv_producer", "P", **(p_extra or {})), SHAPE, connector_kwargs=kw)
        self.D = Engine(config("kv_consumer", "D", policy, **(d_extra or {})), d_shape, connector_kwargs=kw)

    def pump(self):
        self.P.step()
        self.D.step()

    def prefill(self, prompts):
        for rid, prompt in prompts.items():
            self.P.add_request(rid, prompt, {"do_remote_decode": True})
        wait_until(lambda: all(r in self.P.results and self.P.results[r].status.value == "finished"
                               for r in prompts), step=self.pump, what="prefills")
        return {rid: self.P.results[rid].kv_transfer_params for rid in prompts}

    def decode(self, prompts, params, wait=True):
        for rid, prompt in prompts.items():
            self.D.add_request(rid, prompt, params[rid])
        if wait:
            wait_until(lambda: all(r in self.D.results and self.D.results[r].status.value
                                   in ("finished", "failed", "aborted") for r in prompts),
                       step=self.pump, what="decodes")
        return self.D.results

    def settle(self):
        """Everything released and freed on both sides (leak check)."""
        wait_until(lambda: not self.P.held and not self.P.requests and not self.D.requests
                   and not self.D.held and len(self.P.worker.worker.leases) == 0,
                   step=self.pump, what="both engines idle with nothing held")
        assert self.P.num_free_blocks() == SHAPE.num_blocks
        assert self.D.num_free_blocks() == self.D.shape.num_blocks
        assert self.D.worker.worker.num_inflight() == 0
        assert self.D.scheduler.scheduler.num_tracked() == 0

    def close(self):
        self.P.shutdown()
        self.D.shutdown()


@pytest.fixture
def pair(fabric):
    p = Pair(fabric)
    yield p
    p.close()


def random_prompts(rng, n, prefix="r"):
    prompts = {}
    for i in range(n):
        if prompts and rng.random() < 0.3:  # shares full blocks with an earlier prompt
            base = list(prompts.values())[int(rng.integers(len(prompts)))]
            keep = len(base) // BS * BS
            prompts[f"{prefix}{i}"] = base[:keep] + rng.integers(1, 999, int(rng.integers(1, 7))).tolist()
        else:
            prompts[f"{prefix}{i}"] = rng.integers(1, 999, int(rng.integers(1, 40))).tolist()
    return prompts


def test_agent_satisfies_the_transport_protocol():
    from rdma_kv.transport import Agent

    assert issubclass(Agent, Transport)


def test_many_requests_bit_exact_with_prefix_hits(pair, rng):
    prompts = {"s0": list(range(1, 3 * BS + 3)), **random_prompts(rng, 30)}
    prompts["s1"] = prompts["s0"][: 3 * BS] + [7, 7, 7]  # decoded after s0: a certain prefix hit
    params = pair.prefill(prompts)
    # decode in two waves: the second hits the decode side's prefix cache
    first = dict(list(prompts.items())[:16])
    pair.decode(first, params)
    results = pair.decode({k: v for k, v in prompts.items() if k not in first}, params)
    for rid in prompts:
        r = results[rid]
        assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], rid
        assert r.local_hit_tokens + r.external_tokens == len(prompts[rid])
    assert any(r.local_hit_tokens and r.external_tokens for r in results.values()), "no prefix hit"
    stats = pair.D.worker.get_kv_connector_stats()
    totals = stats["totals"]
    assert totals["ops_posted"] == totals["block_runs"], "descriptors posted per request != contiguous runs"
    for rec in stats["requests"]:
        assert {"nbytes", "num_descs", "ops_posted", "post_s", "transfer_s", "confirm_s"} <= set(rec)
    pair.settle()


def test_full_hit_releases_the_producer(pair):
    prompt = list(range(1, 4 * BS + 1))  # block aligned
    params = pair.prefill({"a": prompt, "b": prompt})
    pair.decode({"a": prompt}, params)
    results = pair.decode({"b": prompt}, params)
    assert results["b"].external_tokens == 0 and results["b"].local_hit_tokens == len(prompt)
    pair.settle()  # b's lease was released (not left to expire)
    assert pair.P.worker.worker.leases.stats.released == 2
    assert pair.P.worker.worker.leases.stats.expired == 0


def test_abort_before_load_releases_and_abort_during_load_delays_the_free(pair, fabric):
    prompts = {"a": list(range(1, 30)), "b": list(range(100, 130))}
    params = pair.prefill(prompts)
    # a: aborted while waiting for admission: nothing to read, lease released
    pair.D.add_request("a", prompts["a"], params["a"])
    pair.D.abort_request("a")
    # b: aborted while its reads are in flight
    fabric.hold = True
    pair.decode({"b": prompts["b"]}, params, wait=False)
    wait_until(lambda: fabric.pending, step=pair.pump, what="reads in flight")
    pair.D.abort_request("b")
    for _ in range(20):
        pair.pump()
    assert "b" in pair.D.held, "blocks of an aborted load were handed back while reads can land"
    fabric.hold = False
    fabric.release_all()
    pair.settle()
    assert pair.D.results["b"].status.value == "aborted"


def test_lease_expiry_during_reads_is_a_load_error(fabric):
    # The CONFIRM path (read pins off): an expiry while reads are in flight
    # fails the load. (A pin holds the lease against expiry: the pinned
    # cases are tests/rdma/test_read_pins.py.)
    pair = Pair(fabric, p_extra={"lease_ttl_s": 60.0}, d_extra={"read_pin": False})
    try:
        prompt = list(range(1, 41))
        params = pair.prefill({"x": prompt})
        fabric.hold = True
        pair.decode({"x": prompt}, params, wait=False)
        wait_until(lambda: fabric.pending, step=pair.pump, what="reads in flight")
        pair.P.worker.worker.leases.expire(now=float("inf"))  # the producer gave up on the lease
        pair.P.step()  # ... and freed the blocks
        assert not pair.P.held
        fabric.hold = False
        fabric.release_all()
        results = pair.decode({}, {}, wait=False)
        wait_until(lambda: pair.D.results["x"].status.value == "finished", step=pair.pump)
        r = results["x"]
        assert r.load_failed and r.recomputed_from_block == 0, "an expired lease was not detected"
        assert pair.D.verify_blocks  # recomputed locally; the engine's KV is right
        pair.settle()
    finally:
        pair.close()


def test_dead_producer_becomes_load_errors(fabric):
    pair = Pair(fabric, policy="fail")
    try:
        prompts = {f"k{i}": list(range(i * 50 + 1, i * 50 + 30)) for i in range(4)}
        params = pair.prefill(prompts)
        fabric.hold = True
        pair.decode(prompts, params, wait=False)
        wait_until(lambda: len(fabric.pending) == 4, step=pair.pump, what="reads in flight")
        fabric.kill("P/tp0")
        wait_until(lambda: all(r in pair.D.results and pair.D.results[r].status.value == "failed"
                               for r in prompts), step=pair.D.step, what="load errors")
        assert all("KV load failed" in pair.D.results[r].error for r in prompts)
    finally:
        pair.close()


def test_a_dead_producer_logs_a_burst_of_failures_then_a_count(fabric, caplog):
    """20 loads lost with one producer: every one is a load error and counted
    in the stats, but the log gets the first five reasons, not twenty lines."""
    pair = Pair(fabric, policy="fail")
    try:
        prompts = {f"k{i}": list(range(i * 50 + 1, i * 50 + 30)) for i in range(20)}
        params = pair.prefill(prompts)
        fabric.hold = True
        with caplog.at_level(logging.WARNING, logger="rdma_kv"):
            pair.decode(prompts, params, wait=False)
            wait_until(lambda: len(fabric.pending) == 20, step=pair.pump, what="reads in flight")
            fabric.kill("P/tp0")
            wait_until(lambda: all(r in pair.D.results and pair.D.results[r].status.value == "failed"
                                   for r in prompts), step=pair.D.step, what="load errors")
        lines = [r.getMessage() for r in caplog.records if "KV load failed" in r.getMessage()]
        assert len(lines) == 5, lines
        assert pair.D.worker.worker.stats().totals.consumer.loads_failed == 20
    finally:
        pair.close()


def test_handshake_mismatch_is_refused_naming_both_sides(fabric, caplog):
    other = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=8, num_blocks=512)
    pair = Pair(fabric, d_shape=other)
    try:
        prompt = list(range(1, 20))
        params = pair.prefill({"m": prompt})
        with caplog.at_level(logging.WARNING):
            pair.decode({"m": prompt}, params)
        r = pair.D.results["m"]
        assert r.load_failed and r.status.value == "finished"  # recomputed locally
        assert "block_size: producer 4 vs consumer 8" in caplog.text
        assert fabric.reads == 0
    finally:
        pair.close()


def test_bad_params_are_computed_locally_never_raise(pair, caplog):
    with caplog.at_level(logging.WARNING):
        pair.D.add_request("bad", [1, 2, 3], {"do_remote_prefill": True, "remote_port": "x"})
        wait_until(lambda: "bad" in pair.D.results and pair.D.results["bad"].status.value == "finished",
                   step=pair.pump)
    assert pair.D.results["bad"].external_tokens == 0
    assert "remote_block_ids" in caplog.text
    pair.settle()


# --- the scheduler side alone -------------------------------------------------------------


def scheduler(role="kv_both", **extra):
    from rdma_kv.connector import FullAttentionSpec, KVCacheConfig

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="float16")
    return RdmaConnector(config(role, "S", side_channel_port=5000, **extra), KVConnectorRole.SCHEDULER,
                         KVCacheConfig.uniform(64, ("l0", "l1"), spec))


def test_scheduler_producer_and_consumer_paths():
    s = scheduler()
    prefill = Request("p1", range(1, 11), {"do_remote_decode": True})
    assert s.get_num_new_matched_tokens(prefill, 0) == (0, False)
    prefill.num_computed_tokens = 10
    delay, params = s.request_finished(prefill, [5, 6, 7])
    assert delay and params["remote_block_ids"] == [5, 6, 7] and params["do_remote_prefill"]
    # an aborted prefill (prompt not computed) is not held
    aborted = Request("p2", range(1, 11), {"do_remote_decode": True})
    assert s.request_finished(aborted, [1, 2, 3]) == (False, None)
    meta = s.build_connector_meta(SchedulerOutput())
    assert isinstance(meta, RdmaConnectorMetadata) and [x.request_id for x in meta.sends] == ["p1"]
    # consumer: prefix hit of 1 block -> load the rest, from remote block index 1
    decode = Request("d1", range(1, 11), params)
    assert s.get_num_new_matched_tokens(decode, BS) == (10 - BS, True)
    s.update_state_after_alloc(decode, KVCacheBlocks.of([40, 41, 42]), 10 - BS)
    meta = s.build_connector_meta(SchedulerOutput())
    (load,) = meta.loads
    assert load.local_block_ids == ((41, 42),) and load.remote_block_ids == ((6, 7),)
    assert load.num_skipped_blocks == (0,)
    assert load.lease == parse_kv_transfer_params(params).lease
    # finished while shipped: the worker is told; the engine holds the blocks
    # of a request waiting for a load until done_recving (not a delay of ours)
    assert s.request_finished(decode, [40, 41, 42]) == (False, None)
    assert s.build_connector_meta(SchedulerOutput()).aborts == ("d1",)


def test_scheduler_releases_on_full_hit_and_on_abort_before_admission():
    s = scheduler()
    prefill = Request("p", range(1, 9), {"do_remote_decode": True})
    prefill.num_computed_tokens = 8
    _, params = s.request_finished(prefill, [1, 2])
    s.build_connector_meta(SchedulerOutput())
    full = Request("d", range(1, 9), params)
    assert s.get_num_new_matched_tokens(full, 8) == (0, False)
    s.update_state_after_alloc(full, KVCacheBlocks.of([3, 4]), 0)
    assert [r.lease.request_id for r in s.build_connector_meta(SchedulerOutput()).releases] == ["p"]
    assert s.request_finished(full, [3, 4]) == (False, None)
    waiting = Request("d2", range(1, 9), params)
    assert s.get_num_new_matched_tokens(waiting, 0) == (8, True)
    assert s.request_finished(waiting, []) == (False, None)
    assert len(s.build_connector_meta(SchedulerOutput()).releases) == 1
    assert s.scheduler.num_tracked() == 0


def test_gauges_are_reported_when_they_move_without_an_event(pair, monkeypatch):
    """``stats()`` is None only when nothing happened *and* what the worker
    holds is what it last reported: a push or load held across quiet steps
    (nothing counted until it resolves) must still reach the gauges."""
    worker = pair.D.worker.worker
    for _ in range(3):  # the first call reports the gauges as they are
        worker.stats()
    assert worker.stats() is None, "nothing moved, yet stats came out"
    held = worker.resources()
    monkeypatch.setattr(worker, "resources", lambda: {**held, "pushes_running": 1})
    stats = worker.stats()
    assert stats is not None and stats.resources["pushes_running"] == 1 and not stats.totals.events()
    # the gauges by TP rank too: where they are exported, a rank that later reports nothing keeps its value
    assert stats.by_rank == {worker._settings.tp_rank: {"leases_held": stats.leases_held, **stats.resources}}
    assert worker.stats() is None, "the same gauges were reported twice"
    monkeypatch.setattr(worker, "resources", lambda: {**held, "pushes_running": 0})
    stats = worker.stats()
    assert stats is not None and stats.resources["pushes_running"] == 0


def test_a_worker_reports_its_gauges_again_every_refresh_and_its_incarnation(pair, monkeypatch):
    """Where the gauges are exported, a rank silent for ``GAUGE_STALE_S``
    while its engine's other ranks report is taken for gone: a worker whose
    gauges did not move reports them again every ``GAUGE_REFRESH_S`` (while
    its engine steps), with its incarnation (a new one replaces the rank's
    gauges of the engine before)."""
    from rdma_kv.connector.rdma.stats import GAUGE_REFRESH_S

    worker = pair.D.worker.worker
    now = [1000.0]
    monkeypatch.setattr(worker, "_clock", lambda: now[0])
    first = worker.stats()
    assert first is not None and first.incarnations == {worker._settings.tp_rank: worker._incarnation.hex()}
    now[0] += GAUGE_REFRESH_S / 2
    assert worker.stats() is None, "nothing moved, yet stats came out"
    now[0] += GAUGE_REFRESH_S / 2
    again = worker.stats()
    assert again is not None and again.by_rank == first.by_rank and not again.totals.events()
    assert worker.stats() is None
    other = pair.P.worker.worker
    assert other.stats().incarnations != again.incarnations  # another worker: another incarnation


def _corrupt_cached(engine, prompt, index):
    """Flip one value of ``prompt``'s block ``index`` where ``engine``'s prefix cache keeps it (a stray write)."""
    from rdma_kv.harness.kvfill import block_seeds

    block = engine.pool.cached[block_seeds(prompt, BS)[index + 1]]
    engine.kv[0, block, 0, 0, 0] += 1
    return block


@pytest.mark.parametrize("case", ["partial hit, rest loaded", "full hit", "partial hit, load failed"])
def test_a_wrong_prefix_hit_block_fails_verification(pair, fabric, case):
    # Before: only the blocks a load wrote were verified, so a request that
    # read a corrupted prefix-cache block (or kept it over a failed load)
    # finished with bad_blocks == [] and the demo printed VERIFIED.
    a = list(range(1, 3 * BS + 1))  # block aligned: b below can be a full hit
    b = a if case == "full hit" else a + [7, 7]
    params = pair.prefill({"a": a, "b": b})
    assert pair.decode({"a": a}, params)["a"].bad_blocks == []
    _corrupt_cached(pair.D, a, 1)
    if case == "partial hit, load failed":
        fabric.fail_next = 1
    r = pair.decode({"b": b}, params)["b"]
    assert r.local_hit_tokens == 3 * BS and r.status.value == "finished", r
    assert r.load_failed == (case == "partial hit, load failed"), r
    assert r.bad_blocks == [1], r
    pair.settle()


def test_a_block_the_load_never_wrote_fails_verification_even_where_it_held_the_same_kv(fabric, monkeypatch):
    """A fresh block is not what it held before: the harness overwrites
    blocks as it allocates them, so a block the transfer never wrote fails
    verification even where its earlier request left the very same KV. (Before,
    "b" below reused "a"'s partial block; reads that copied nothing verified.)"""
    import numpy as np
    from fakes import FakeTransfer

    pair = Pair(fabric, d_shape=dataclasses.replace(SHAPE, num_blocks=3))  # "b" gets "a"'s freed partial block
    try:
        prompt = list(range(1, 2 * BS + 3))  # two whole blocks and a partial one
        params = pair.prefill({"a": prompt, "b": prompt})
        assert pair.decode({"a": prompt}, params)["a"].bad_blocks == []
        resolve = FakeTransfer._resolve

        def copy_nothing(self, error=None):  # the fault: reads complete, nothing lands
            empty = np.zeros(0, np.uint64)
            self._ops = (empty, empty, empty)
            resolve(self, error)

        monkeypatch.setattr(FakeTransfer, "_resolve", copy_nothing)
        r = pair.decode({"b": prompt}, params)["b"]
        assert r.local_hit_tokens == 2 * BS and r.external_tokens == 2 and not r.load_failed, r
        assert r.bad_blocks == [2], r
        pair.settle()
    finally:
        pair.close()
