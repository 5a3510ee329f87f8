"""Aggregate metrics from the worker's per-request records, the Prometheus
exposition, and the logging rule (no per-transfer INFO lines)."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest

from rdma_kv.connector.rdma import metrics
from rdma_kv.connector.rdma.metrics import Histogram, TransferMetrics, merge_stats, record_values
from rdma_kv.connector.rdma.stats import (GAUGE_REFRESH_S, GAUGE_STALE_S, MAX_RECORDS, LoadMeasures, LoadRecord,
                                          LoadStats, WorkerStats, merge)
from rdma_kv.connector.rdma.statsparse import parse_totals, parse_worker_stats

SRC = Path(__file__).resolve().parents[2] / "src" / "rdma_kv"


def _stats(*records, counters=None, leases_held=0, resources=None):
    """A stats dict built the way the worker builds it (stats.py)."""
    s = LoadStats()
    for rid, fields, ok, error in records:
        s.record(rid, LoadMeasures(**fields), ok=ok, total_s=0.05, error=error)
    recorded, totals = s.take()
    totals = totals + parse_totals(counters or {})  # the parts' counters, by their flat names
    return WorkerStats(recorded, totals, leases_held, resources).to_dict()


OK = {"nbytes": 64 << 20, "num_descs": 4096, "ops_posted": 128, "block_runs": 4, "num_blocks": 64,
      "plan_s": 2e-5, "post_s": 1e-4, "transfer_s": 0.0134217728, "confirm_s": 3e-4}  # 5 GB/s
FAILED_BEFORE_POST = {"handshake_s": 0.5}


def test_histogram_buckets_quantiles_and_merge():
    h = Histogram((1.0, 2.0, 4.0))
    for v in (0.5, 1.0, 1.5, 3.0, 100.0):
        h.observe(v)
    h.observe(float("nan"))  # ignored
    assert h.counts == [2, 1, 1, 1] and h.count == 5 and h.sum == pytest.approx(106.0)
    assert h.cumulative() == [(1.0, 2), (2.0, 3), (4.0, 4), (math.inf, 5)]
    assert h.quantile(0.0) == 0.0 and h.quantile(0.4) == pytest.approx(1.0)
    assert h.quantile(0.5) == pytest.approx(1.5)  # linear inside (1, 2]
    assert h.quantile(1.0) == 4.0  # +Inf bucket reported as the last bound
    other = Histogram((1.0, 2.0, 4.0))
    other.observe(3.5)
    h.merge(other)
    assert h.counts == [2, 1, 2, 1]
    with pytest.raises(ValueError):
        h.merge(Histogram((1.0,)))
    with pytest.raises(ValueError):
        Histogram((2.0, 1.0))
    assert Histogram((1.0,)).quantile(0.5) is None


def test_record_values_uses_successful_transfers_only():
    v = record_values(LoadRecord(request_id="r", ok=True, total_s=0.02, **OK))
    assert v["transfer_gbps"] == pytest.approx(5.0)
    assert v["request_bytes"] == 64 << 20 and v["request_ops"] == 128 and v["request_descriptors"] == 4096
    assert v["load_seconds"] == 0.02 and v["post_seconds"] == 1e-4
    failed = record_values(LoadRecord(request_id="r", ok=False, total_s=10.0, error="peer died", **OK))
    assert failed == {"load_seconds": 10.0}  # time-to-failure is not a transfer time


def test_transfer_metrics_aggregate_records_and_counters():
    m = TransferMetrics()
    m.observe(None)
    m.observe(_stats(("a", OK, True, None), ("b", OK, True, None),
                     ("c", FAILED_BEFORE_POST, False, "handshake refused"),
                     counters={"handshakes": 1, "loads_failed": 1, "release_rpcs": 2}, leases_held=3,
                     resources={"inflight_loads": 0, "peers": 1}))
    m.observe(_stats(("d", OK, True, None), counters={"handshakes": 1}))
    snap = m.snapshot()
    assert snap["loads"] == {"ok": 3, "failed": 1} and snap["bytes_total"] == 3 * (64 << 20)
    gbps = snap["histograms"]["transfer_gbps"]
    assert gbps["count"] == 3 and 4.0 < gbps["p50"] <= 8.0  # 5 GB/s sits in the (4, 8] bucket
    assert snap["histograms"]["load_seconds"]["count"] == 4
    assert snap["events"] == {"handshakes": 2, "loads_failed": 1, "release_rpcs": 2}
    assert snap["gauges"] == {"leases_held": 0, "inflight_loads": 0, "peers": 1}
    assert re.match(r"rdma-kv loads: 4 \(3 ok, 1 failed\), 0\.201 GB read; transfer p50 [\d.]+ ms", m.summary())


def test_merge_stats_keeps_each_ranks_records():
    a = _stats(("r1", OK, True, None), counters={"handshakes": 1}, leases_held=2)
    b = _stats(("r1", OK, True, None), ("r2", OK, False, "x"), counters={"handshakes": 1}, leases_held=1)
    merged = merge_stats([a, None, b])
    assert [r["request_id"] for r in merged["requests"]] == ["r1", "r1", "r2"]
    assert merged["totals"]["handshakes"] == 2 and merged["leases_held"] == 3
    assert merged["totals"]["nbytes"] == 3 * (64 << 20)
    assert merge_stats([None, {}]) is None


def test_per_request_lines_are_debug_only(caplog):
    m = TransferMetrics()
    with caplog.at_level(logging.DEBUG, logger=metrics.__name__):
        m.observe(_stats(("req-7", OK, True, None), ("req-8", FAILED_BEFORE_POST, False, "refused")))
    lines = [r for r in caplog.records if r.name == metrics.__name__]
    assert [r.levelno for r in lines] == [logging.DEBUG, logging.DEBUG]
    assert "request_id='req-7' outcome=ok nbytes=67108864" in lines[0].getMessage()
    assert "gbps=5.000" in lines[0].getMessage() and "error='refused'" in lines[1].getMessage()


def test_no_info_logging_on_the_transfer_path():
    """Per-request and per-transfer logging is DEBUG; INFO is left for
    once-per-process events (startup). A new logger.info in these modules
    must be one of the allowed ones."""
    allowed = {"rdma-kv worker %s: %d layers in %d region(s), %d blocks, %d bytes per block; ",
               "rdma-kv worker %s: KV cache unregistered for sleep (registration %d)",
               "registering with the router at %s as %s (%s), side channel %s"}  # once, at startup
    found = []
    for name in ("worker.py", "scheduler.py", "sidechannel.py", "connector.py", "leases.py", "metrics.py"):
        text = (SRC / "connector" / "rdma" / name).read_text()
        for m in re.finditer(r"logger\.info\(\s*(f?\"[^\"]*\")", text):
            found.append((name, m.group(1).lstrip("f").strip('"')))
    assert all(msg in allowed for _, msg in found), found


def test_prometheus_exposition():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    pm = metrics.PrometheusMetrics(registry=registry, labelnames=["engine", "tp_rank"],
                                   labelvalues=["decode-0", 0])
    pm.observe(_stats(("a", OK, True, None), ("b", FAILED_BEFORE_POST, False, "refused"),
                      counters={"handshakes": 1, "loads_failed": 1}, leases_held=0,
                      resources={"inflight_loads": 2}))
    text = pm.exposition().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
               for fam in text_string_to_metric_families(text) for smp in fam.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted(dict(labels, engine="decode-0", tp_rank="0").items())))]

    assert value("rdma_kv_loads_total", outcome="ok") == 1 and value("rdma_kv_loads_total", outcome="failed") == 1
    assert value("rdma_kv_read_bytes_total") == 64 << 20
    assert value("rdma_kv_transfer_gbps_bucket", le="8.0") == 1 and value("rdma_kv_transfer_gbps_bucket", le="4.0") == 0
    assert value("rdma_kv_load_seconds_count") == 2 and value("rdma_kv_transfer_seconds_count") == 1
    assert value("rdma_kv_events_total", event="handshakes") == 1
    assert value("rdma_kv_resource", resource="inflight_loads") == 2 and value("rdma_kv_leases_held") == 0
    assert "# HELP rdma_kv_transfer_gbps rdma-kv: throughput of one request's reads (GB/s, 1e9 B/s)" in text
    with pytest.raises(ValueError, match="differ in length"):
        metrics.PrometheusMetrics(registry=registry, labelnames=["engine"])


def test_prometheus_accepts_injected_metric_classes():
    """vLLM's build_prom_metrics hands over its own metric classes."""
    created = []

    class Fake:
        def __init__(self, name, documentation, labelnames, **kw):
            created.append((type(self).__name__, name, tuple(labelnames), kw.get("buckets")))
            self.values = []

        def labels(self, *values):
            return self

        def observe(self, v=1):
            self.values.append(v)

        inc = set = observe

    class Counter(Fake): ...
    class Histogram(Fake): ...
    class Gauge(Fake): ...

    pm = metrics.PrometheusMetrics(prefix="vllm:rdma_kv", labelnames=["engine"], labelvalues=[0],
                                   counter_cls=Counter, histogram_cls=Histogram, gauge_cls=Gauge)
    pm.observe(_stats(("a", OK, True, None)))
    names = {name for _, name, _, _ in created}
    assert "vllm:rdma_kv_transfer_seconds" in names and "vllm:rdma_kv_loads" in names
    assert pm.histograms["transfer_gbps"].values == [pytest.approx(5.0)]
    assert all(labels[0] == "engine" for _, _, labels, _ in created)


def test_missing_prometheus_client_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "prometheus_client":
            raise ImportError("no")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"rdma-kv\[metrics\]"):
        metrics.PrometheusMetrics()


def test_worker_stats_round_trip_through_the_dict_form():
    d = _stats(("a", OK, True, None), ("b", FAILED_BEFORE_POST, False, "refused"),
               counters={"handshakes": 1, "leases_granted": 2}, leases_held=1, resources={"peers": 1})
    assert d["requests"][1] == {"handshake_s": 0.5, "request_id": "b", "ok": False, "total_s": 0.05,
                                "error": "refused"}  # only what the load measured
    assert d["totals"] == {"nbytes": 64 << 20, "num_descs": 4096, "ops_posted": 128, "block_runs": 4,
                           "num_blocks": 64, "nbytes_skipped": 0, "loads_ok": 1,
                           "transfer_s": OK["transfer_s"], "handshakes": 1, "leases_granted": 2}
    assert parse_worker_stats(d).to_dict() == d
    with pytest.raises(ValueError, match=r"unknown load record key\(s\) \['nbytez'\]"):
        parse_worker_stats({"requests": [{"request_id": "x", "ok": True, "nbytez": 1}]})


def test_records_are_capped_but_the_totals_count_every_load():
    s = LoadStats()
    for i in range(MAX_RECORDS + 5):
        s.record(f"r{i}", LoadMeasures(nbytes=1), ok=True, total_s=0.0, error=None)
    records, totals = s.take()
    assert len(records) == MAX_RECORDS and records[0].request_id == "r5"
    assert totals.nbytes == totals.loads_ok == MAX_RECORDS + 5
    one = WorkerStats(records, totals)
    merged = merge([one, None, one])
    assert len(merged.requests) == MAX_RECORDS and merged.totals.nbytes == 2 * (MAX_RECORDS + 5)
    assert merge([None]) is None


def test_push_records_round_trip_and_reach_prometheus():
    """A producer's per-push records (mode push) cross vLLM's stats boundary
    and say, per push, how much of it overlapped the prefill: the
    ``rdma_kv_push_overlap_ratio`` histogram and the overlapped bytes."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from rdma_kv.connector.rdma.stats import PushCounters, PushRecord, Totals, WorkerStats, merge

    pushes = (PushRecord(request_id="p-1", outcome="done", nbytes=1000, overlapped_nbytes=800, total_s=0.5),
              PushRecord(request_id="p-2", outcome="done", nbytes=1000, overlapped_nbytes=0, total_s=0.2),
              PushRecord(request_id="p-3", outcome="refused"))
    stats = WorkerStats(totals=Totals(push=PushCounters(done=2, refused=1, written_bytes=2000,
                                                        overlapped_bytes=800)), pushes=pushes)
    parsed = parse_worker_stats(stats.to_dict())
    assert parsed == stats and pushes[0].overlap == 0.8 and pushes[2].overlap is None
    assert merge([parsed, WorkerStats(pushes=pushes[:1])]).pushes == (*pushes, pushes[0])
    with pytest.raises(ValueError, match="unknown push record key"):
        parse_worker_stats({"pushes": [{"request_id": "x", "outcome": "done", "overlap": 1.0}]})

    registry = prometheus_client.CollectorRegistry()
    pm = metrics.PrometheusMetrics(registry=registry)
    pm.observe(stats.to_dict())
    samples = registry.get_sample_value
    assert samples("rdma_kv_push_overlapped_bytes_total") == 800
    assert samples("rdma_kv_push_written_bytes_total") == 2000
    assert samples("rdma_kv_push_overlap_ratio_count") == 2  # done pushes only
    assert samples("rdma_kv_push_overlap_ratio_bucket", {"le": "0.0"}) == 1
    assert samples("rdma_kv_push_overlap_ratio_bucket", {"le": "0.75"}) == 1
    assert samples("rdma_kv_push_overlap_ratio_bucket", {"le": "0.9"}) == 2


@pytest.mark.parametrize("data, field", [
    ({"requests": [{"request_id": "r", "ok": "false", "total_s": 1.0}]}, "load record ok"),
    ({"requests": [{"request_id": "r", "ok": True, "total_s": 1.0, "nbytes": 2.9}]}, "load record nbytes"),
    ({"requests": [{"request_id": 3, "ok": True, "total_s": 1.0}]}, "load record request_id"),
    ({"requests": [{"request_id": "r", "ok": True, "total_s": "1.0"}]}, "load record total_s"),
    ({"totals": {"nbytes": "7"}}, "totals nbytes"),
    ({"totals": {"leases_granted": 2.9}}, "totals leases_granted"),
    ({"totals": {"handshakes": True}}, "totals handshakes"),
    ({"totals": {"transfer_s": "0.5"}}, "totals transfer_s"),
    ({"leases_held": "3"}, "leases_held"),
    ({"resources": {"peers": 1.5}}, "resources peers"),
    ({"pushes": [{"request_id": "p", "outcome": "done", "nbytes": "10"}]}, "push record nbytes"),
])
def test_the_dict_form_is_parsed_strictly_never_coerced(data, field):
    """A value of the wrong type is refused, naming its field: before, "ok": "false"
    parsed as a successful load and counters "7" or 2.9 as 7 and 2."""
    with pytest.raises(TypeError, match=re.escape(field)):
        parse_worker_stats(data)
    # ints where a float is expected are numbers, not a type error
    assert parse_worker_stats({"totals": {"transfer_s": 1}}).totals.transfer_s == 1.0


def _rank(rank, leases, counters=None, **resources):
    """One TP rank's report as its worker sends it: gauges by rank."""
    return WorkerStats(totals=parse_totals(counters or {}), leases_held=leases, resources=resources,
                       by_rank={rank: {"leases_held": leases, **resources}}).to_dict()


def test_gauges_sum_each_ranks_last_value_across_steps():
    """A gauge is a value now: exported as the sum over the TP ranks of each
    rank's last report. Before, it was set from the sum over the ranks that
    reported in the step: a rank steadily holding 3 leases returns no stats
    (its gauges did not move) and vanished from rdma_kv_leases_held."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    pm = metrics.PrometheusMetrics(registry=registry, labelnames=["engine"], labelvalues=["0"])
    tm = TransferMetrics()
    steps = [merge_stats([_rank(0, 2, peers=1), _rank(1, 3, peers=2)]),
             merge_stats([_rank(0, 3, {"leases_granted": 1}, peers=1), None]),  # rank 1 unchanged: None
             merge_stats([None, _rank(1, 0, peers=0)])]  # rank 1 let go of everything
    expected = [(5, 3), (6, 3), (3, 1)]
    for step, (leases, peers) in zip(steps, expected):
        pm.observe(step)
        tm.observe(step)
        assert registry.get_sample_value("rdma_kv_leases_held", {"engine": "0"}) == leases
        assert registry.get_sample_value("rdma_kv_resource", {"engine": "0", "resource": "peers"}) == peers
        assert tm.snapshot()["gauges"] == {"leases_held": leases, "peers": peers}
    # another engine's ranks are its own
    pm.observe(_rank(0, 7), labelvalues=["1"])
    assert registry.get_sample_value("rdma_kv_leases_held", {"engine": "1"}) == 7
    assert registry.get_sample_value("rdma_kv_leases_held", {"engine": "0"}) == 3


def test_merging_a_ranks_later_report_keeps_its_latest_gauges():
    """Two intervals of one rank (vLLM's logger aggregates across steps): the
    later gauges, not their sum; two ranks: summed, in either order."""
    later = merge_stats([_rank(0, 2, peers=1), _rank(0, 4, peers=1)])
    assert later["leases_held"] == 4 and later["resources"] == {"peers": 1}
    a, b = _rank(0, 2, {"leases_granted": 1}), _rank(1, 3, peers=2)
    for parts in ((a, b), (b, a)):
        merged = merge_stats(parts)
        assert merged["leases_held"] == 5 and merged["resources"] == {"peers": 2}
        assert parse_worker_stats(merged).to_dict() == merged


def _inc(rank, leases, incarnation, **resources):
    """A rank's report with its worker's incarnation, as a worker sends it."""
    return {**_rank(rank, leases, **resources), "incarnations": {str(rank): incarnation}}


def _exporters(now):
    """Feed both exporters (clock ``now[0]``); returns the gauges they export, (leases, peers)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    pm = metrics.PrometheusMetrics(registry=registry, labelnames=["engine"], labelvalues=["0"],
                                   clock=lambda: now[0])
    tm = TransferMetrics(clock=lambda: now[0])

    def observe(step):
        pm.observe(step)
        tm.observe(step)
        leases = registry.get_sample_value("rdma_kv_leases_held", {"engine": "0"})
        peers = registry.get_sample_value("rdma_kv_resource", {"engine": "0", "resource": "peers"})
        assert tm.snapshot()["gauges"] == {"leases_held": leases, "peers": peers}
        return leases, peers
    return observe


def test_an_engine_restarted_with_fewer_ranks_drops_the_old_ranks_gauges():
    """A TP-2 engine restarted as TP-1: its rank 0's first report carries a
    new incarnation, and rank 1 (the engine before) no longer counts.
    Before, rank 1's last value (3 leases, 2 peers) stayed in the gauges
    until the metrics object was made again. (The ranks of an engine all
    report in its first step: a new worker's first stats carry its gauges.)"""
    now = [0.0]
    observe = _exporters(now)
    assert observe(merge_stats([_inc(0, 2, "a0", peers=1), _inc(1, 3, "a1", peers=2)])) == (5, 3)
    assert observe(_inc(0, 2, "a0", peers=1)) == (5, 3)  # the same incarnation: rank 1 keeps its last value
    now[0] += 1.0
    assert observe(_inc(0, 0, "b0", peers=0)) == (0, 0), "a rank of the engine before still counted"
    assert observe(_inc(1, 1, "b1", peers=1)) == (1, 1)  # a rank of the new engine counts when it reports


def test_a_rank_silent_for_long_while_its_engine_reports_is_dropped():
    """A worker reports its gauges at least every ``GAUGE_REFRESH_S`` while
    its engine steps: a rank silent for ``GAUGE_STALE_S`` while another
    rank of its engine reports is gone (a rank that died), and its value no
    longer counts; before, it counted for good. An engine that pauses (no
    rank reports: it does not step) keeps every rank's value."""
    now = [0.0]
    observe = _exporters(now)
    both = merge_stats([_inc(0, 2, "a0", peers=1), _inc(1, 3, "a1", peers=2)])
    assert observe(both) == (5, 3)
    now[0] += 10 * GAUGE_STALE_S  # idle: nothing stepped
    assert observe(both) == (5, 3)
    last_seen, gone_at = now[0], None
    while now[0] < last_seen + 3 * GAUGE_STALE_S:  # rank 0 reports every GAUGE_REFRESH_S; rank 1 is gone
        now[0] += GAUGE_REFRESH_S
        if observe(_inc(0, 2, "a0", peers=1)) == (2, 1) and gone_at is None:
            gone_at = now[0]
    assert gone_at is not None, "a rank silent while its engine reported still counted"
    assert last_seen + GAUGE_STALE_S < gone_at <= last_seen + GAUGE_STALE_S + 2 * GAUGE_REFRESH_S
