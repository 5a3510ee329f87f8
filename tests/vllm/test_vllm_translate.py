"""The adapter's translation against vLLM 0.32's real classes, no engine
(well under a second): config, KV-cache config and specs, requests and
their params, scheduler output, finished sets, stats, lazy import."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

import torch  # noqa: E402
from vllm.config import KVTransferConfig as VllmKVTransferConfig  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from rdma_kv.connector import specs  # noqa: E402
from rdma_kv.errors import ConfigError, SpecError  # noqa: E402
from rdma_kv.vllm import RdmaKVConnector, RdmaKVConnectorStats, translate  # noqa: E402

pytestmark = pytest.mark.vllm

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_transfer_config_maps_vllm_fields_and_host_default() -> None:
    vllm_kv = VllmKVTransferConfig(
        kv_connector="RdmaKVConnector", kv_connector_module_path="rdma_kv.vllm",
        kv_role="kv_consumer", kv_port=15000, kv_load_failure_policy="recompute",
        kv_connector_extra_config={"lease_ttl_s": 5})
    ours = translate.transfer_config(vllm_kv, tp_rank=1, tp_size=2, dp_rank=3)
    assert ours.kv_role.value == "kv_consumer" and ours.kv_port == 15000
    assert ours.engine_id == vllm_kv.engine_id and ours.kv_buffer_device.value == "cpu"
    assert ours.kv_load_failure_policy.value == "recompute" and ours.kv_ip == "127.0.0.1"
    extra = ours.kv_connector_extra_config
    assert (extra["tp_rank"], extra["tp_size"], extra["lease_ttl_s"]) == (1, 2, 5)
    assert extra["side_channel_port"] == 15000 + 3 * 2  # data-parallel rank 3
    with pytest.raises(ConfigError, match="tp_size"):
        translate.transfer_config(SimpleNamespace(**{**vars(vllm_kv),
                                  "kv_connector_extra_config": {"tp_size": 4}}))


def test_kv_cache_config_from_vllm_032() -> None:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=512,
        kv_cache_tensors=[KVCacheTensor(size=16 << 20, layers=LAYERS, layer_stride=8 << 20,
                                        block_stride=16384, offset=0)],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    ours = translate.kv_cache_config(config)
    assert ours.num_blocks == 512 and ours.layer_names == tuple(LAYERS)
    assert ours.kv_cache_tensors[0].shared_by == tuple(LAYERS)
    group = ours.single_group().kv_cache_spec
    assert isinstance(group, specs.FullAttentionSpec) and group.dtype == "float32"
    assert group.page_size_bytes == spec.page_size_bytes == 16384


def test_unsupported_spec_is_refused_with_its_kind() -> None:
    class MambaSpec(SimpleNamespace):
        pass

    with pytest.raises(SpecError, match="MambaSpec"):
        translate.kv_cache_spec(MambaSpec(block_size=32, num_kv_heads=1, head_size=32,
                                          dtype=torch.float32))


def test_request_drops_vllm_annotation_and_keeps_engine_id() -> None:
    params = {"do_remote_decode": True, "remote_prefill_cached_tokens": 0}
    vreq = SimpleNamespace(request_id="0-9ebb2ecc", prompt_token_ids=[1, 2, 3],
                           num_prompt_tokens=3, kv_transfer_params=params,
                           num_computed_tokens=2, output_token_ids=[7])
    ours = translate.request(vreq)
    assert ours.request_id == "0-9ebb2ecc" and ours.num_computed_tokens == 2
    assert dict(ours.kv_transfer_params) == {"do_remote_decode": True}
    assert params == {"do_remote_decode": True, "remote_prefill_cached_tokens": 0}  # untouched
    embeds = translate.request(SimpleNamespace(**{**vars(vreq), "prompt_token_ids": None}))
    assert embeds.num_prompt_tokens == 3


def test_a_request_finished_without_an_answer_is_marked_aborted() -> None:
    """vLLM's own statuses: a producer holds the KV of requests that
    stopped or hit their length only (as its NixlConnector does)."""
    from vllm.v1.request import RequestStatus

    base = dict(request_id="1-0", prompt_token_ids=[1, 2], num_prompt_tokens=2, kv_transfer_params={},
                num_computed_tokens=2, output_token_ids=[])
    aborted = {status.name: translate.request(SimpleNamespace(**base, status=status)).aborted
               for status in RequestStatus if RequestStatus.is_finished(status)}
    assert aborted == {"FINISHED_STOPPED": False, "FINISHED_LENGTH_CAPPED": False, "FINISHED_ABORTED": True,
                       "FINISHED_IGNORED": True, "FINISHED_ERROR": True, "FINISHED_REPETITION": False}


def _vllm_request(rid: str, prompt: list[int], params: dict | None = None) -> object:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VllmRequest

    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return VllmRequest(rid, prompt, sampling, None)


def test_the_adapter_checks_and_digests_a_prompt_once_across_the_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks ``get_num_new_matched_tokens`` at every step a request
    waits: the adapter's next ``Request`` for the same vLLM request shares
    the checked prompt and its digest, and reads everything else again."""
    from rdma_kv.connector.rdma import params as params_mod

    digests = []
    real = params_mod.prompt_digest
    monkeypatch.setattr(params_mod, "prompt_digest", lambda ids, keys=(): digests.append(len(ids)) or real(ids, keys))
    requests = translate.Requests()
    vreq = _vllm_request("0-a", list(range(1000)), {"do_remote_prefill": True, "remote_prefill_cached_tokens": 3})
    first = requests.of(vreq)
    assert params_mod.request_prompt_digest(first) == real(range(1000))
    vreq.num_computed_tokens = 16
    vreq.kv_transfer_params = {"do_remote_prefill": False}
    again = requests.of(vreq)
    assert again is not first and again.prompt_token_ids is first.prompt_token_ids
    assert (again.num_computed_tokens, dict(again.kv_transfer_params)) == (16, {"do_remote_prefill": False})
    assert params_mod.request_prompt_digest(again) == real(range(1000)) and digests == [1000]

    # A streaming session extends the waiting request's prompt in place: a new prompt, a new digest.
    vreq.prompt_token_ids.extend([7, 8])
    vreq.num_prompt_tokens = 1002
    longer = requests.of(vreq)
    assert longer.prompt_token_ids[-2:] == (7, 8) and params_mod.request_prompt_digest(longer) == real(
        list(range(1000)) + [7, 8])
    assert digests == [1000, 1002]

    # Another vLLM request under the same id (a router's retry with ids not randomized): built anew.
    other = requests.of(_vllm_request("0-a", [5, 6]))
    assert other.prompt_token_ids == (5, 6) and params_mod.request_prompt_digest(other) == real([5, 6])

    done = requests.finished(_vllm_request("0-a", [5, 6]))
    assert done.prompt_token_ids == (5, 6) and len(requests) == 0


def test_extra_keys_name_what_besides_the_tokens_decides_the_kv() -> None:
    """What vLLM's prefix cache hashes with each block besides the tokens:
    two requests that differ only there have other KV (the producer shares
    a lease among the children of one request only when they are equal)."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VllmRequest

    plain = translate.request(_vllm_request("0_a", [1, 2, 3]))
    assert plain.extra_keys == ()
    lora = VllmRequest("0_b", [1, 2, 3], SamplingParams(max_tokens=1), None,
                       lora_request=LoRARequest("sql", 1, "/adapters/sql"), cache_salt="tenant-7")
    keys = translate.request(lora).extra_keys
    assert keys == (("lora", "sql"), ("cache_salt", "tenant-7"))  # the adapter by name: paths are per host
    image = _vllm_request("0_c", [1, 2, 3])
    image.mm_features = [SimpleNamespace(identifier="img-hash-1", mm_position=SimpleNamespace(offset=1))]
    assert translate.request(image).extra_keys == (("mm", "img-hash-1", 1),)
    def embeds(rid: str, values: Any) -> Any:
        return SimpleNamespace(**{**vars(_vllm_request(rid, [1, 2, 3])), "prompt_token_ids": None,
                                  "prompt_embeds": values})
    zeros = translate.request(embeds("0_d", torch.zeros(3, 4))).extra_keys
    assert zeros == translate.request(embeds("1_d", torch.zeros(3, 4))).extra_keys  # equal embeddings
    assert zeros != translate.request(embeds("0_e", torch.ones(3, 4))).extra_keys
    assert zeros != translate.request(embeds("0_f", torch.zeros(3, 4, dtype=torch.float16))).extra_keys
    kept = translate.Requests()
    assert kept.of(lora).extra_keys == keys and kept.of(lora).extra_keys == keys  # kept with the prompt


def test_the_adapter_keeps_a_bounded_number_of_prompt_tokens_and_no_vllm_request_alive() -> None:
    import gc
    import weakref

    requests = translate.Requests(kept_tokens=250)
    vreqs = [_vllm_request(f"r{i}", list(range(100))) for i in range(4)]
    kept = [requests.of(v) for v in vreqs]
    assert len(requests) == 2  # 200 tokens kept of 400, the least recently used dropped
    assert requests.of(vreqs[3]).prompt_token_ids is kept[3].prompt_token_ids
    assert requests.of(vreqs[0]).prompt_token_ids is not kept[0].prompt_token_ids  # rebuilt
    # A request finishing that nothing kept is not kept on its way out: the others stay.
    assert requests.finished(_vllm_request("r9", list(range(100)))).num_prompt_tokens == 100
    assert len(requests) == 2 and requests.of(vreqs[3]).prompt_token_ids is kept[3].prompt_token_ids
    gone = weakref.ref(vreqs[1])
    del vreqs[1]
    gc.collect()
    assert gone() is None


def test_scheduler_output_struct_of_arrays() -> None:
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", prompt_token_ids=[1, 2],
                                            block_ids=([4, 5],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["b", "c"], resumed_req_ids={"c"},
                                              new_block_ids=[None, ([9],)],
                                              num_computed_tokens=[33, 64]),
        num_scheduled_tokens={"a": 2, "b": 1, "c": 1}, finished_req_ids={"z"})
    ours = translate.scheduler_output(out)
    assert ours.scheduled_new_reqs[0].block_ids == ((4, 5),)
    b, c = ours.scheduled_cached_reqs
    assert (b.new_block_ids, b.resumed_from_preemption) == (None, False)
    assert (c.new_block_ids, c.num_computed_tokens, c.resumed_from_preemption) == (((9,),), 64, True)
    assert ours.finished_req_ids == frozenset({"z"})


def test_finished_sets_pass_through_in_vllms_form() -> None:
    """The worker reports every load in finished_recving exactly once (an
    aborted one too) and never in finished_sending, so the adapter passes
    both sets on as they are: vLLM counts each rank's reports (the filter it
    had, for a fail-path double free, broke that count with tensor
    parallelism and leaked the blocks)."""
    reports = iter([({"p1"}, {"d1"}), ({"p2"}, set()), (set(), set())])
    adapter = object.__new__(RdmaKVConnector)
    adapter._connector = SimpleNamespace(get_finished=lambda ids: next(reports),
                                         worker=SimpleNamespace(num_inflight=lambda: 0))
    assert adapter.get_finished(set()) == ({"p1"}, {"d1"})
    assert adapter.get_finished(set()) == ({"p2"}, None)
    assert adapter.get_finished(set()) == (None, None)


def test_stats_aggregate_and_reduce() -> None:
    rec = {"request_id": "r", "ok": True, "nbytes": 100, "transfer_s": 0.002, "total_s": 0.01}
    a = RdmaKVConnector.build_kv_connector_stats(
        {"requests": [rec], "totals": {"nbytes": 100, "num_descs": 4, "handshakes": 1}})
    b = RdmaKVConnectorStats(data={"requests": [{**rec, "ok": False}],
                                   "totals": {"nbytes": 0, "num_descs": 0}})
    assert RdmaKVConnectorStats().is_empty() and not a.is_empty()
    reduced = a.aggregate(b).reduce()
    assert reduced["loads"] == 2 and reduced["loads_failed"] == 1
    assert reduced["bytes"] == 100 and reduced["descriptors"] == 4 and reduced["handshakes"] == 1
    assert reduced["median_transfer_ms"] == 2.0 and "pushes" not in reduced
    # A push producer's stats: records only (no load), yet not empty; the overlap is over completed pushes.
    push = RdmaKVConnectorStats(data={"totals": {}, "pushes": [
        {"request_id": "p", "outcome": "done", "nbytes": 400, "overlapped_nbytes": 300},
        {"request_id": "q", "outcome": "failed", "nbytes": 0}]})
    assert not push.is_empty()
    assert push.reduce()["pushes"] == 2 and push.reduce()["push_overlap"] == 0.75


def test_a_ranks_gauge_only_report_is_not_empty_nor_dropped() -> None:
    """A worker reports its gauges when they move, with no event (worker.stats()):
    such a report is not empty, so vLLM's aggregation across TP ranks
    (KVOutputAggregator: aggregated.aggregate(rank_stats)) and its scheduler
    keep it. Before, is_empty() ignored the gauges: rank0.aggregate(rank1)
    dropped rank 1's 3 leases (2, not 5; 5 the other way round)."""
    from rdma_kv.connector.rdma.stats import LeaseCounters, Totals, WorkerStats

    def rank(r: int, held: int, totals: Totals = Totals(), **resources: int) -> dict:
        return WorkerStats(totals=totals, leases_held=held, resources=resources,
                           by_rank={r: {"leases_held": held, **resources}}).to_dict()

    rank0 = rank(0, 2, Totals(leases=LeaseCounters(granted=1)), leases=2)
    rank1 = rank(1, 3, leases=3, held_blocks=12)
    assert not RdmaKVConnectorStats(data=rank1).is_empty()
    assert not RdmaKVConnectorStats(data=rank(1, 0, leases=0)).is_empty()  # all let go: still news
    for first, second in ((rank0, rank1), (rank1, rank0)):
        merged = RdmaKVConnectorStats(data=dict(first)).aggregate(RdmaKVConnectorStats(data=dict(second)))
        assert merged.data["leases_held"] == 5
        assert merged.data["resources"] == {"leases": 5, "held_blocks": 12}
        assert merged.reduce()["leases_held"] == 5


def test_an_engine_that_moves_no_kv_logs_no_transfer_line(caplog) -> None:
    """A worker reports its gauges again every GAUGE_REFRESH_S while its
    engine steps, transfers or not, so the scheduler's stats are not empty
    (the test above) and reach vLLM's API server. Its "KV Transfer metrics"
    logger printed a line of zeros for each such interval ("loads=0, ...,
    leases_held=2") on an engine serving requests without KV transfers.
    Such an interval now logs nothing; the next one with a load logs it
    with the latest gauges."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from rdma_kv.connector.rdma.stats import WorkerStats

    gauges = WorkerStats(leases_held=2, resources={"leases": 2}, by_rank={0: {"leases_held": 2, "leases": 2}})
    config = VllmKVTransferConfig(kv_connector="RdmaKVConnector", kv_connector_module_path="rdma_kv.vllm",
                                  kv_role="kv_both")
    log = KVConnectorLogging(config)
    lines: list[str] = []
    for _ in range(3):  # three refreshes, one logging interval each
        log.observe(gauges.to_dict())
        log.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == []
    assert not RdmaKVConnectorStats(data=gauges.to_dict()).is_empty()  # the scheduler still carries them
    load = {"request_id": "r", "ok": True, "nbytes": 4096, "transfer_s": 0.001, "total_s": 0.002}
    log.observe({**WorkerStats(leases_held=1, by_rank={0: {"leases_held": 1}}).to_dict(),
                 "requests": [load], "totals": {"nbytes": 4096}})
    log.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "loads=1" in lines[0] and "leases_held=1" in lines[0], lines


def test_import_rdma_kv_does_not_import_vllm_nor_start_anything() -> None:
    code = ("import sys, threading, rdma_kv, rdma_kv.connector, rdma_kv.transport\n"
            "assert 'vllm' not in sys.modules\n"
            "import rdma_kv.vllm\n"
            "assert 'rdma_kv.connector.rdma.worker' not in sys.modules\n"
            "assert threading.active_count() == 1, threading.enumerate()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_prometheus_series_through_vllms_hook():
    """build_prom_metrics registers rdma_kv_* series with the metric classes vLLM
    hands over, labelled per engine, and observe() folds stats in."""
    import functools
    import types

    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram  # the keys vLLM uses

    from rdma_kv.vllm import RdmaKVConnector

    registry = prometheus_client.CollectorRegistry()
    metric_types = {Gauge: functools.partial(prometheus_client.Gauge, registry=registry),
                    Counter: functools.partial(prometheus_client.Counter, registry=registry),
                    Histogram: functools.partial(prometheus_client.Histogram, registry=registry)}
    prom = RdmaKVConnector.build_prom_metrics(types.SimpleNamespace(kv_transfer_config=None), metric_types,
                                              ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
    record = {"request_id": "r1", "ok": True, "nbytes": 4096, "num_descs": 4, "ops_posted": 1,
              "transfer_s": 0.001, "post_s": 0.0001, "total_s": 0.002}
    prom.observe({"requests": [record], "totals": {"handshakes": 1}}, engine_idx=1)
    assert registry.get_sample_value("rdma_kv_loads_total",
                                     {"model_name": "tiny", "engine": "1", "outcome": "ok"}) == 1
    assert registry.get_sample_value("rdma_kv_read_bytes_total", {"model_name": "tiny", "engine": "1"}) == 4096
    assert registry.get_sample_value("rdma_kv_loads_total",
                                     {"model_name": "tiny", "engine": "0", "outcome": "ok"}) is None
    # A report the API server cannot read is dropped here too, never raised: this runs in
    # the task that hands every request its output (found by a review of the logger's guard).
    prom.observe({"requests": [record], "totals": {"handshakes": "7"}}, engine_idx=1)
    assert registry.get_sample_value("rdma_kv_loads_total",
                                     {"model_name": "tiny", "engine": "1", "outcome": "ok"}) == 1


def test_the_field_list_info_checks_is_vllms() -> None:
    import dataclasses

    assert set(translate.VLLM_KV_TRANSFER_FIELDS) == {f.name for f in dataclasses.fields(VllmKVTransferConfig)}


def _failing_decode(groups, blocks):
    """A decode (scheduler, worker over the fake fabric, adapter) whose load
    of request 'r' fails: its params, well-formed and from a real producer
    scheduler, name a side channel nobody listens on (what any client can
    send)."""
    import socket

    import numpy as np

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "rdma"))
    from fakes import FakeFabric

    from rdma_kv.connector import KVCacheBlocks, KVConnectorRole, KVTransferConfig, Request
    from rdma_kv.connector import specs as ours
    from rdma_kv.connector.rdma import RdmaConnector

    bs, nb, heads, head = 4, 64, 2, 8
    full = ours.FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype="float32")
    sliding = ours.SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype="float32",
                                     sliding_window=6)
    layers = [f"l{i}" for i in range(3)]
    spec_groups = ((ours.KVCacheGroupSpec(("l0", "l2"), sliding), ours.KVCacheGroupSpec(("l1",), full))
                   if groups == 2 else (ours.KVCacheGroupSpec(tuple(layers), full),))
    config = ours.KVCacheConfig(nb, tuple(ours.KVCacheTensor(nb * full.page_size_bytes, (n,)) for n in layers),
                                spec_groups)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]

    def cfg(role, eid, **extra):
        return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=eid, kv_port=0,
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"rpc_timeout_s": 0.5, "load_timeout_s": 3.0, **extra})

    prompt = list(range(1, 18))
    producer = RdmaConnector(cfg("kv_producer", "P", side_channel_port=dead), KVConnectorRole.SCHEDULER, config)
    done = Request("r", prompt, {"do_remote_decode": True})
    done.num_computed_tokens = len(prompt)
    _, params = producer.request_finished_all_groups(done, blocks)
    scheduler = RdmaConnector(cfg("kv_consumer", "D"), KVConnectorRole.SCHEDULER, config)
    worker = RdmaConnector(cfg("kv_consumer", "D"), KVConnectorRole.WORKER, config,
                           transport_factory=FakeFabric().factory)
    worker.register_kv_caches({n: np.zeros((nb, heads, bs, 2 * head), dtype=np.float32) for n in layers})
    decode = Request("r", prompt, params)
    n, _ = scheduler.get_num_new_matched_tokens(decode, 0)
    scheduler.update_state_after_alloc(decode, KVCacheBlocks.of(*blocks), n)
    adapter = object.__new__(RdmaKVConnector)
    adapter._connector = worker
    adapter._per_request_failures = groups > 1
    return scheduler, worker, adapter


@pytest.mark.parametrize("groups", [1, 2])
def test_a_failed_load_reaches_vllm_in_the_form_it_takes(groups) -> None:
    """With several KV-cache groups vLLM 0.32 raises on block-level load
    errors (``_handle_invalid_blocks``: a RuntimeError out of its engine
    loop), so a failed load goes as ``failed_recving``; one group keeps the
    block ids (recompute from the first bad block). Before, a hybrid decode
    engine died on any failed load, e.g. a client's params naming a side
    channel nobody listens on (found by an adversarial review)."""
    import time

    from vllm.v1.core.sched.scheduler import Scheduler

    from rdma_kv.connector import SchedulerOutput

    blocks = ([0, 0, 0, 13, 14], [20, 21, 22, 23, 24]) if groups == 2 else ([20, 21, 22, 23, 24],)
    scheduler, worker, adapter = _failing_decode(groups, blocks)
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            worker.bind_connector_metadata(scheduler.build_connector_meta(SchedulerOutput()))
            worker.start_load_kv(None)
            results = adapter.get_transfer_results(set())
            errors = adapter.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            if "r" in results.finished_recving:
                break
            time.sleep(0.01)
        assert "r" in results.finished_recving
        if groups == 2:
            assert results.failed_recving == {"r"} and errors == set()
        else:
            assert results.failed_recving == set() and errors == {20, 21, 22, 23, 24}
            # what vLLM does with them (update_from_output), with one group: no error
            fake = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=[0]), recompute_kv_load_failures=True,
                                   kv_holding_waiting=[], running=[],
                                   _update_requests_with_invalid_blocks=lambda *a, **k: (set(), 0, set()))
            assert Scheduler._handle_invalid_blocks(fake, errors, {}) == set()
        nothing = adapter.get_transfer_results(set())
        assert nothing.failed_recving == set() and adapter.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("name", ["RdmaKVConnector", "NixlConnector"])
def test_stats_of_rdma_kv_under_vllms_multiconnector_reach_the_api_servers_logger(name: str) -> None:
    """vLLM's MultiConnector keys each child's stats by the child's class
    name, and the API server rebuilds them from vLLM's connector registry
    (``MultiConnector.build_kv_connector_stats``): rdma-kv, loaded by module
    path, was not registered (ValueError), and under the compatibility name
    "NixlConnector" vLLM's own NIXL stats class read rdma-kv's (KeyError).
    Either raised in AsyncLLM's output handler, which then stopped: every
    request of the server failed at the first stats report (found by an
    adversarial review)."""
    import rdma_kv.vllm as adapter
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    cls = getattr(adapter, name)
    child = object.__new__(cls)  # a child as MultiConnector holds it (its stats only are asked for)
    data = {"requests": [{"request_id": "r", "ok": True, "total_s": 0.01, "nbytes": 4096, "transfer_s": 0.001}],
            "totals": {}, "leases_held": 0}
    child.get_kv_connector_stats = lambda: cls.build_kv_connector_stats(data=data)
    stats = MultiConnector.get_kv_connector_stats(SimpleNamespace(_connectors=[child]))  # the engine core's
    assert stats is not None
    config = VllmKVTransferConfig(kv_connector="MultiConnector", kv_role="kv_consumer", kv_connector_extra_config={
        "connectors": [{"kv_connector": name, "kv_connector_module_path": "rdma_kv.vllm", "kv_role": "kv_consumer"}]})
    logging = KVConnectorLogging(config)  # the API server's, fed what the engine core sends
    logging.observe(stats.to_dict())  # what the scheduler sends (SchedulerStats.kv_connector_stats)
    logging.log()


def test_the_compatibility_class_still_pickles_by_reference() -> None:
    """Its class name is RdmaKVConnector (above); its qualified name stays
    its own, which pickle looks it up by (a review of the first version
    set both, and pickling the class then found the parent)."""
    import pickle

    from rdma_kv.vllm import NixlConnector

    assert NixlConnector.__name__ == "RdmaKVConnector"
    assert pickle.loads(pickle.dumps(NixlConnector)) is NixlConnector


def test_a_stats_report_the_api_server_cannot_read_is_dropped_not_raised(caplog, monkeypatch) -> None:
    """The API server reads the workers' stats in the task that hands every
    request its output; an exception there stops the task (the
    MultiConnector test above). A report it cannot read (since the parse is
    strict: processes of two rdma-kv versions) is dropped, and said once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from rdma_kv.vllm import stats as adapter_stats

    monkeypatch.setattr(adapter_stats, "_UNREADABLE_SAID", False)  # (said once per process: maybe already)
    bad = RdmaKVConnectorStats(data={"requests": [{"request_id": "r", "ok": "false"}], "totals": {}})
    assert bad.is_empty() and bad.reduce()["loads"] == 0
    config = VllmKVTransferConfig(kv_connector="RdmaKVConnector", kv_connector_module_path="rdma_kv.vllm",
                                  kv_role="kv_consumer")
    logging = KVConnectorLogging(config)
    logging.observe({"requests": [{"request_id": "r", "ok": "false"}], "totals": {}})
    logging.log()
    assert "could not be read and is dropped" in caplog.text


def _fp8_worker(role: str, engine: str, cache_dtype: str, monkeypatch) -> RdmaKVConnector:
    """A worker-role adapter built as vLLM builds it (a stand-in config:
    TP 1, 2 KV heads, ``--kv-cache-dtype cache_dtype``), its uint8 KV cache
    registered (vLLM's tensor dtype for every fp8 format)."""
    from vllm.config import KVTransferConfig as Kv
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import rdma_kv.vllm.connector as adapter

    monkeypatch.setattr(adapter, "_attention_backend", lambda config, role: "CPU_ATTN")  # no model runner here
    nb, bs, heads, head = 8, 32, 2, 16
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=torch.uint8)
    page = spec.page_size_bytes
    config = KVCacheConfig(num_blocks=nb, kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
                           kv_cache_tensors=[KVCacheTensor(size=nb * page, layers=[n], layer_stride=nb * page,
                                                           block_stride=page, offset=0) for n in LAYERS])
    vllm_config = SimpleNamespace(
        kv_transfer_config=Kv(kv_connector="RdmaKVConnector", kv_connector_module_path="rdma_kv.vllm",
                              kv_role=role, engine_id=engine, kv_port=0),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(static_forward_context={  # the attention layers' fp8 scales
            n: SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0) for n in LAYERS}))
    conn = RdmaKVConnector(vllm_config, KVConnectorRole.WORKER, config)
    conn.register_kv_caches({n: torch.zeros(nb, heads, bs, 2 * head, dtype=torch.uint8) for n in LAYERS})
    return conn


@pytest.mark.parametrize(("producer", "consumer", "accepted"), [
    ("fp8_e4m3", "fp8_e5m2", False),
    ("fp8", "fp8_e5m2", False),
    ("fp8_e5m2", "fp8_e5m2", True),
    ("fp8", "fp8_e4m3", True),  # vLLM's "fp8" is e4m3: one format
])
def test_fp8_kv_cache_formats_are_compared_at_the_handshake(producer, consumer, accepted, monkeypatch) -> None:
    """vLLM stores every fp8 ``--kv-cache-dtype`` as a ``uint8`` tensor of
    one page size, so the adapter's specs and geometry of an ``fp8_e4m3``
    and an ``fp8_e5m2`` engine were identical: the producer answered the
    consumer's handshake, and the decode would have read e4m3 bytes as e5m2
    (silently wrong KV; found by a review of the geometry mapping). Now the
    cache dtype is part of the compatibility record."""
    from rdma_kv.connector.rdma import wire

    p = _fp8_worker("kv_producer", "P", producer, monkeypatch)
    try:
        d = _fp8_worker("kv_consumer", "D", consumer, monkeypatch)
        try:
            pw, dw = p.connector.worker, d.connector.worker
            reply = pw._producer.handler.on_handshake(
                wire.Handshake(wire.PROTOCOL_VERSION, "D", dw._local.rank, dw._compat))
            if accepted:
                assert isinstance(reply, wire.HandshakeReply), reply
            else:
                assert isinstance(reply, wire.Refused), reply
                canonical = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
                assert (f"dtype: producer 'uint8 ({canonical[producer]})' vs consumer "
                        f"'uint8 ({canonical[consumer]})'") in reply.reason
        finally:
            d.shutdown()
    finally:
        p.shutdown()


def test_kv_cache_dtype_comes_from_vllm_only() -> None:
    vllm_kv = VllmKVTransferConfig(kv_connector="RdmaKVConnector", kv_connector_module_path="rdma_kv.vllm",
                                   kv_role="kv_consumer")
    extra = translate.transfer_config(vllm_kv, kv_cache_dtype="fp8_e5m2").kv_connector_extra_config
    assert extra["kv_cache_dtype"] == "fp8_e5m2"
    assert "kv_cache_dtype" not in translate.transfer_config(vllm_kv, kv_cache_dtype="auto").kv_connector_extra_config
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        translate.transfer_config(SimpleNamespace(**{**vars(vllm_kv),
                                  "kv_connector_extra_config": {"kv_cache_dtype": "fp8"}}))


def test_a_sliding_window_that_retains_tokens_below_it_is_refused() -> None:
    """vLLM's ``extra_retained_tokens`` (multi-module MTP) keeps blocks below
    the window that the engine counts loaded; the adapter dropped the field,
    so rdma-kv skipped up to one block more than vLLM frees (a 19-token
    prompt, window 8, block 4, 2 retained: vLLM keeps block 2, rdma-kv
    neither offered nor read it: stale KV accepted; found by a review of the
    geometry mapping). Refused now, naming the setting; without it, as before."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    common = dict(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=8)
    with pytest.raises(SpecError, match="extra_retained_tokens=2"):
        translate.kv_cache_spec(SlidingWindowSpec(**common, extra_retained_tokens=2))
    ours = translate.kv_cache_spec(SlidingWindowSpec(**common))
    assert isinstance(ours, specs.SlidingWindowSpec) and ours.num_skipped_blocks(19) == (19 - 8 + 1) // 4
