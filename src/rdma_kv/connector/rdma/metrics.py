"""Aggregate metrics of the RDMA connector's loads, fed from the worker's
per-request records, and an optional Prometheus exposition.

The worker already records one entry per finished load (``stats.py``;
``RdmaWorker.stats()`` / ``get_kv_connector_stats()`` hand them over and
reset). This module turns those records into:

- :class:`TransferMetrics`: in-process histograms (transfer seconds, GB/s,
  bytes per request, descriptors and ops posted per request, whole-load
  seconds), outcome counters and event counters, with quantile estimates
  and a JSON-able ``snapshot()``. No dependency.
- :class:`PrometheusMetrics`: the same series as ``prometheus_client``
  histograms, counters and gauges. ``prometheus_client`` is optional
  (``pip install 'rdma-kv[metrics]'``) and imported only when this class is
  instantiated. The metric classes can be injected, which is how vLLM's
  ``build_prom_metrics(vllm_config, metric_types, labelnames,
  per_engine_labelvalues)`` hook hands over its multiprocess-safe wrappers.

Both take the worker's summary through ``observe(stats)``, typed
(``stats.WorkerStats``) or in its dict form as ``get_kv_connector_stats()``
returns it and vLLM carries it (``{"requests": [...], "totals": {...},
"leases_held": n, ...}``, parsed once at the edge, :func:`as_worker_stats`):
whoever receives ``get_kv_connector_stats()`` feeds it, since that call
resets the worker's records. :func:`merge_stats` combines the dicts of
several workers (TP ranks) without losing the per-request records. A transfer here is one request's reads on one rank: with TP > 1 a
request appears once per rank (label by rank, never sum ranks into a
request).

Per-request lines go to this module's logger at DEBUG only, one per
record, as ``key=value`` pairs; nothing here logs at INFO.

Imports the standard library and the connector's ``rdma.stats`` and
``rdma.statsparse`` (``prometheus_client`` lazily).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rdma_kv.connector.rdma.stats import GAUGE_STALE_S, LoadRecord, WorkerStats, held_by_rank, merge
from rdma_kv.connector.rdma.statsparse import parse_worker_stats

__all__ = [
    "BYTES_BUCKETS",
    "COUNT_BUCKETS",
    "GBPS_BUCKETS",
    "SECONDS_BUCKETS",
    "Histogram",
    "PrometheusMetrics",
    "TransferMetrics",
    "as_worker_stats",
    "merge_stats",
]

logger = logging.getLogger(__name__)

GB = 1e9
# Upper bucket edges. Seconds: a one-block read on a fast HCA (~50 us) up to
# the default read deadline (10 s). GB/s: a TCP fallback (<1) up to a 400G
# NIC (50 GB/s) and multi-rail. Bytes and counts: powers of 4, from one
# 16 KiB block to a 16 GiB prompt / ~1M descriptors.
SECONDS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)
GBPS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 20.0, 25.0, 37.5, 50.0, 100.0, 200.0)
BYTES_BUCKETS = tuple(float(4**i) for i in range(7, 18))  # 16 KiB .. 16 GiB
COUNT_BUCKETS = tuple(float(4**i) for i in range(11))  # 1 .. ~1M

# Record fields -> histogram name, unit, buckets. Timing and throughput are
# observed for successful loads only: a failed load's "transfer time" is
# the time to its failure, which would skew the distribution.
HISTOGRAMS: dict[str, tuple[str, Sequence[float]]] = {
    "transfer_seconds": ("reads of one request, post to completion (s)", SECONDS_BUCKETS),
    "post_seconds": ("posting one request's reads (one C call) (s)", SECONDS_BUCKETS),
    "load_seconds": ("whole load, the step's metadata bound to get_finished reporting it: handshake, "
                     "reads, confirmation (s)", SECONDS_BUCKETS),
    "transfer_gbps": ("throughput of one request's reads (GB/s, 1e9 B/s)", GBPS_BUCKETS),
    "request_bytes": ("bytes read per request (B)", BYTES_BUCKETS),
    "request_descriptors": ("descriptors per request, before merging", COUNT_BUCKETS),
    "request_ops": ("operations posted per request, after merging contiguous runs", COUNT_BUCKETS),
}
OUTCOMES = ("ok", "failed")
OVERLAP_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
"""Share of a push's bytes written while its prefill's forward pass ran."""


@dataclass
class Histogram:
    """Fixed-bucket histogram (Prometheus semantics: bucket i counts values
    <= ``bounds[i]``; the last, implicit bucket is +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.bounds = tuple(float(b) for b in self.bounds)
        if list(self.bounds) != sorted(set(self.bounds)) or not self.bounds:
            raise ValueError(f"histogram bounds must be strictly increasing, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        elif len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.counts)} counts for {len(self.bounds)} bounds (+Inf)")

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def merge(self, other: Histogram) -> None:
        if other.bounds != self.bounds:
            raise ValueError("cannot merge histograms with different bounds")
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.count += other.count
        self.sum += other.sum

    def quantile(self, q: float) -> float | None:
        """Estimate (linear within the bucket, as Prometheus'
        ``histogram_quantile``); None when empty. Values in the +Inf bucket
        are reported as the last finite bound."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.count == 0:
            return None
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                lo = self.bounds[i - 1] if i > 0 else 0.0
                return lo + (self.bounds[i] - lo) * max(0.0, rank - seen) / n
            seen += n
        return self.bounds[-1]

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs, ending with (+Inf, count)."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append((bound, running))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "sum": self.sum, "mean": self.mean,
                "p50": self.quantile(0.5), "p90": self.quantile(0.9), "p99": self.quantile(0.99),
                "buckets": [["+Inf" if math.isinf(b) else b, c] for b, c in self.cumulative()]}


def record_values(record: LoadRecord) -> dict[str, float]:
    """The histogram observations one load record yields (only those it
    has: a load that failed before posting has no transfer)."""
    values: dict[str, float] = {"load_seconds": record.total_s}
    if not record.ok:
        return values
    nbytes = record.nbytes or 0
    transfer_s = record.transfer_s or 0.0
    if record.transfer_s is not None:
        values["transfer_seconds"] = transfer_s
    if record.post_s is not None:
        values["post_seconds"] = record.post_s
    if nbytes:
        values["request_bytes"] = float(nbytes)
        if transfer_s > 0:
            values["transfer_gbps"] = nbytes / transfer_s / GB
    if record.num_descs:
        values["request_descriptors"] = float(record.num_descs)
    if record.ops_posted:
        values["request_ops"] = float(record.ops_posted)
    return values


def _debug_line(record: LoadRecord, values: Mapping[str, float]) -> str:
    parts = [f"request_id={record.request_id!r}", f"outcome={'ok' if record.ok else 'failed'}"]
    for key in ("nbytes", "nbytes_skipped", "num_descs", "ops_posted", "block_runs", "num_blocks"):
        if getattr(record, key) is not None:
            parts.append(f"{key}={getattr(record, key)}")
    for key in ("plan_s", "post_s", "transfer_s", "confirm_s", "handshake_s", "total_s"):
        if getattr(record, key) is not None:
            parts.append(f"{key}={float(getattr(record, key)):.6f}")
    if "transfer_gbps" in values:
        parts.append(f"gbps={values['transfer_gbps']:.3f}")
    if record.error:
        parts.append(f"error={record.error!r}")
    return "rdma-kv load " + " ".join(parts)


def as_worker_stats(stats: WorkerStats | Mapping[str, Any] | None) -> WorkerStats | None:
    """The typed summary of ``stats``: a :class:`WorkerStats` as is, the
    dict form (``get_kv_connector_stats()``, vLLM's ``data``) parsed."""
    if not stats:
        return None
    return stats if isinstance(stats, WorkerStats) else parse_worker_stats(stats)


class TransferMetrics:
    """Histograms and counters over every record observed (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.histograms = {name: Histogram(tuple(buckets)) for name, (_, buckets) in HISTOGRAMS.items()}
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.bytes_total = 0
        self.bytes_skipped_total = 0
        self.events: dict[str, int] = {}
        self.gauges: dict[str, int] = {}
        self._by_rank: dict[int, _Reported] = {}

    def observe(self, stats: WorkerStats | Mapping[str, Any] | None) -> None:
        """Fold one worker summary in: a :class:`WorkerStats` or its dict
        form, ``get_kv_connector_stats()`` (None: nothing happened)."""
        typed = as_worker_stats(stats)
        if typed is None:
            return
        debug = logger.isEnabledFor(logging.DEBUG)
        with self._lock:
            for record in typed.requests:
                values = record_values(record)
                for name, value in values.items():
                    self.histograms[name].observe(value)
                self.outcomes["ok" if record.ok else "failed"] += 1
                if record.ok:
                    self.bytes_total += record.nbytes or 0
                    self.bytes_skipped_total += record.nbytes_skipped or 0
                if debug:
                    logger.debug("%s", _debug_line(record, values))
            for name, n in typed.totals.events().items():
                self.events[name] = self.events.get(name, 0) + n
            self.gauges.update(_latest(self._by_rank, typed, self._clock()))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"loads": dict(self.outcomes), "bytes_total": self.bytes_total,
                    "bytes_skipped_total": self.bytes_skipped_total,
                    "histograms": {n: h.to_dict() for n, h in self.histograms.items()},
                    "events": dict(self.events), "gauges": dict(self.gauges)}

    def summary(self) -> str:
        """One line for a periodic log (the caller picks its level and rate)."""
        with self._lock:
            t, g = self.histograms["transfer_seconds"], self.histograms["transfer_gbps"]
            loads = sum(self.outcomes.values())
            text = (f"rdma-kv loads: {loads} ({self.outcomes['ok']} ok, {self.outcomes['failed']} failed), "
                    f"{self.bytes_total / GB:.3f} GB read")
            if self.bytes_skipped_total:
                text += f" ({self.bytes_skipped_total / GB:.3f} GB outside sliding windows not read)"
            p50, p99, gbps = t.quantile(0.5), t.quantile(0.99), g.quantile(0.5)
            if p50 is not None and p99 is not None:
                text += f"; transfer p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
                if gbps is not None:
                    text += f"; GB/s p50 {gbps:.2f}"
            return text


def gauges(stats: WorkerStats) -> dict[str, int]:
    """Point-in-time values: leases held (producer) and, when the worker
    reports them, the resources it holds (loads in flight, peers, ...)."""
    return {"leases_held": stats.leases_held, **(stats.resources or {})}


@dataclass(frozen=True)
class _Reported:
    """A rank's last reported gauges: by which incarnation of its worker, and when (the exporter's clock)."""

    gauges: Mapping[str, int]
    incarnation: str | None
    at: float


def _latest(last: dict[int, _Reported], stats: WorkerStats, now: float) -> dict[str, int]:
    """The gauges to export after ``stats``: with gauges by rank, ``last``
    (each rank's last reported gauges, updated here) summed over the ranks,
    so that a rank that did not report this time (its gauges did not move:
    its stats were None) still counts; without, :func:`gauges` as they are.

    A rank reporting a new incarnation was made again (its engine
    restarted): the ranks ``stats`` does not carry are the engine's before,
    and forgotten (an engine restarted with fewer ranks left its last ranks'
    values for good). A rank silent for ``GAUGE_STALE_S`` while its engine
    reports is forgotten too (a worker reports every ``GAUGE_REFRESH_S``)."""
    if not stats.by_rank:
        return gauges(stats)
    incarnations = stats.incarnations or {}
    newest = max((reported.at for reported in last.values()), default=now)  # before this report: an engine
    if any(rank in last and last[rank].incarnation is not None
           and incarnations.get(rank) not in (None, last[rank].incarnation) for rank in stats.by_rank):
        for rank in [r for r in last if r not in stats.by_rank]:
            del last[rank]
    for rank, held in stats.by_rank.items():
        last[rank] = _Reported(held, incarnations.get(rank), now)
    for rank in [r for r, reported in last.items() if newest - reported.at > GAUGE_STALE_S]:
        del last[rank]  # (that resumes stepping after a pause reports its ranks again: none is forgotten then)
    leases_held, resources = held_by_rank({rank: reported.gauges for rank, reported in last.items()})
    return {"leases_held": leases_held, **resources}


def merge_stats(parts: Iterable[WorkerStats | Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Several workers' ``get_kv_connector_stats()`` dicts as one, in the
    same form: :func:`~rdma_kv.connector.rdma.stats.merge` (records
    concatenated, each keeping its own request id and timings; totals and
    gauges summed)."""
    merged = merge(as_worker_stats(p) for p in parts)
    return merged.to_dict() if merged is not None else None


class PrometheusMetrics:
    """The metrics as Prometheus series. Names (``prefix`` default ``rdma_kv``)::

        {prefix}_transfer_seconds, _post_seconds, _load_seconds,
        _transfer_gbps, _request_bytes, _request_descriptors, _request_ops   histograms
        {prefix}_loads_total{outcome="ok"|"failed"}, _read_bytes_total,
        {prefix}_skipped_bytes_total                                           counters
        {prefix}_events_total{event="handshakes"|"loads_failed"|...}            counter
        {prefix}_leases_held, {prefix}_resource{resource=...}                   gauges

    The gauges are set to the sum over an engine's TP ranks of each rank's
    last reported value (``WorkerStats.by_rank``, kept here per label
    values): vLLM sums the reports of the ranks that returned stats in a
    step, and a rank whose gauges did not move returns none. A rank
    reporting a new incarnation (its engine restarted) drops the ranks that
    report does not carry, and a rank silent for ``GAUGE_STALE_S`` while its
    engine reports is dropped (``_latest``).

    ``labelnames``/``labelvalues`` are added to every series (e.g. engine,
    tp_rank). ``counter_cls``/``histogram_cls``/``gauge_cls`` default to
    ``prometheus_client``'s; pass vLLM's ``metric_types[...]`` to register
    through vLLM. ``registry`` is passed only when given.
    """

    def __init__(self, *, prefix: str = "rdma_kv", labelnames: Sequence[str] = (),
                 labelvalues: Sequence[object] = (), registry: Any = None,
                 counter_cls: Any = None, histogram_cls: Any = None, gauge_cls: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if len(labelnames) != len(labelvalues):
            raise ValueError(f"labelnames {list(labelnames)} and labelvalues {list(labelvalues)} differ in length")
        if counter_cls is None or histogram_cls is None or gauge_cls is None:
            try:
                import prometheus_client
            except ImportError:
                raise ImportError("PrometheusMetrics needs prometheus_client: "
                                  "pip install 'rdma-kv[metrics]'") from None
            counter_cls = counter_cls or prometheus_client.Counter
            histogram_cls = histogram_cls or prometheus_client.Histogram
            gauge_cls = gauge_cls or prometheus_client.Gauge
        self.registry = registry
        self._labels = [str(v) for v in labelvalues]
        self._observing = self._labels
        self._lock = threading.Lock()
        self._clock = clock
        self._by_rank: dict[tuple[str, ...], dict[int, _Reported]] = {}
        """Per label values (an engine), each rank's last reported gauges."""
        kw = {"registry": registry} if registry is not None else {}
        names = list(labelnames)

        def make(cls: Any, name: str, doc: str, extra: Sequence[str] = (), **more: Any) -> Any:
            return cls(name=f"{prefix}_{name}", documentation=doc, labelnames=names + list(extra), **more, **kw)

        self.histograms = {name: make(histogram_cls, name, f"rdma-kv: {doc}", buckets=list(buckets))
                           for name, (doc, buckets) in HISTOGRAMS.items()}
        self.loads = make(counter_cls, "loads", "rdma-kv: KV loads finished, by outcome", ["outcome"])
        self.read_bytes = make(counter_cls, "read_bytes", "rdma-kv: bytes read by successful loads")
        self.skipped_bytes = make(counter_cls, "skipped_bytes", "rdma-kv: bytes of successful loads "
                                  "not read because they lie outside a sliding window")
        self.events = make(counter_cls, "events", "rdma-kv: worker events (handshakes, lease RPCs, "
                                                  "failed and aborted loads)", ["event"])
        self.pushes = make(counter_cls, "pushes", "rdma-kv: pushes a producer resolved (mode push), by outcome "
                           "(done, failed, aborted, refused)", ["outcome"])
        self.push_written_bytes = make(counter_cls, "push_written_bytes", "rdma-kv: bytes a producer wrote into "
                                       "decodes' KV caches by write batches that completed, also of pushes the decode "
                                       "then aborted (mode push)")
        self.push_overlapped_bytes = make(counter_cls, "push_overlapped_bytes", "rdma-kv: of "
                                          "rdma_kv_push_written_bytes_total, bytes written while the prefill's "
                                          "forward pass ran (layer-wise writes, concurrent dispatch)")
        self.push_overlap = make(histogram_cls, "push_overlap_ratio", "rdma-kv: per completed push, the share of "
                                 "its bytes written while the prefill's forward pass ran (0: all after it)",
                                 buckets=list(OVERLAP_BUCKETS))
        self.pushed_loads = make(counter_cls, "pushed_loads", "rdma-kv: load sources a decode received by push "
                                 "(mode push), by outcome (ok, failed, aborted: the request was dropped); "
                                 "rdma_kv_loads_total counts loads of either mode",
                                 ["outcome"])
        self.leases_held = make(gauge_cls, "leases_held", "rdma-kv: leases the producer holds now")
        self.resources = make(gauge_cls, "resource", "rdma-kv: what the worker holds now", ["resource"])

    def _child(self, metric: Any, *extra: str) -> Any:
        values = [*self._observing, *extra]
        return metric.labels(*values) if values else metric

    def observe(self, stats: WorkerStats | Mapping[str, Any] | None,
                labelvalues: Sequence[object] | None = None) -> None:
        """Fold one worker summary in (as :meth:`TransferMetrics.observe`);
        ``labelvalues`` overrides the constructor's for this call (vLLM
        observes per engine)."""
        typed = as_worker_stats(stats)
        if typed is None:
            return
        labels = self._labels if labelvalues is None else [str(v) for v in labelvalues]
        if len(labels) != len(self._labels):
            raise ValueError(f"labelvalues {list(labels)} do not match labelnames of length {len(self._labels)}")
        with self._lock:
            self._observing = labels
            for record in typed.requests:
                for name, value in record_values(record).items():
                    self._child(self.histograms[name]).observe(value)
                self._child(self.loads, "ok" if record.ok else "failed").inc()
                if record.ok and record.nbytes:
                    self._child(self.read_bytes).inc(record.nbytes)
                if record.ok and record.nbytes_skipped:
                    self._child(self.skipped_bytes).inc(record.nbytes_skipped)
            for name, n in typed.totals.events().items():
                if n > 0:
                    self._child(self.events, name).inc(n)
            push = typed.totals.push
            for outcome, n in (("done", push.done), ("failed", push.failed), ("aborted", push.aborted),
                               ("refused", push.refused)):
                if n > 0:
                    self._child(self.pushes, outcome).inc(n)
            if push.written_bytes > 0:
                self._child(self.push_written_bytes).inc(push.written_bytes)
            if push.overlapped_bytes > 0:
                self._child(self.push_overlapped_bytes).inc(push.overlapped_bytes)
            for push_record in typed.pushes:
                if push_record.outcome == "done" and push_record.overlap is not None:
                    self._child(self.push_overlap).observe(push_record.overlap)
            for outcome, n in (("ok", push.loads_done), ("failed", push.loads_failed),
                               ("aborted", push.loads_aborted)):
                if n > 0:
                    self._child(self.pushed_loads, outcome).inc(n)
            for name, value in _latest(self._by_rank.setdefault(tuple(labels), {}), typed, self._clock()).items():
                if name == "leases_held":
                    self._child(self.leases_held).set(value)
                else:
                    self._child(self.resources, name).set(value)

    def exposition(self) -> bytes:
        """The text exposition format of ``registry`` (or the default one)."""
        import prometheus_client

        return prometheus_client.generate_latest(self.registry or prometheus_client.REGISTRY)

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Expose ``/metrics`` on ``addr:port`` (a daemon thread of
        ``prometheus_client``). Binds loopback unless told otherwise: the
        series name engines and request counts."""
        import prometheus_client

        return prometheus_client.start_http_server(port, addr=addr,
                                                   registry=self.registry or prometheus_client.REGISTRY)
