"""``RdmaKVConnectorStats`` and ``RdmaKVPromMetrics``: the connector's
transfer records as vLLM stats, and as Prometheus series through vLLM's
metrics hook (``build_prom_metrics``).

Owns the ``KVConnectorStats`` subclass vLLM moves from the worker to the
front end (``to_dict`` -> ``build_kv_connector_stats``), aggregates across
workers and intervals, and logs through ``reduce()`` ("KV Transfer metrics:
..."). The payload is the worker's ``get_kv_connector_stats()`` summary:
per-request records (bytes, descriptors, ops posted, block runs, plan /
post / transfer / confirm / total seconds, outcome) plus totals.

Imports vLLM's ``metrics`` module (only ``rdma_kv.vllm`` may).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from rdma_kv.connector.rdma.stats import WorkerStats

__all__ = ["RdmaKVConnectorStats", "RdmaKVLoggedStats", "RdmaKVPromMetrics"]

logger = logging.getLogger(__name__)

_UNREADABLE_SAID = False

@dataclasses.dataclass
class RdmaKVConnectorStats(KVConnectorStats):
    """``data``: the worker's summary in its dict form,
    ``{"requests": [record, ...], "totals": {name: number}, "leases_held": n[, "resources": {...}]}``
    (``rdma_kv.connector.rdma.stats.WorkerStats.to_dict``), parsed once, at
    first use, into the typed summary every method reads."""

    def __post_init__(self) -> None:
        self._typed: WorkerStats | None = None
        self.unreadable = False
        """``data`` could not be read (dropped: an empty summary stands for it)."""

    def _parsed(self) -> WorkerStats:
        if self._typed is None:
            # Lazy, as in RdmaKVPromMetrics: vLLM imports this module in its front end.
            from rdma_kv.connector.rdma.stats import WorkerStats
            from rdma_kv.connector.rdma.statsparse import parse_worker_stats

            try:
                self._typed = parse_worker_stats(self.data)
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                # This runs in vLLM's API server, in the task that hands every request its
                # output: a stats report it cannot read (processes of two rdma-kv versions)
                # is dropped and said, never raised there (that stopped the task).
                global _UNREADABLE_SAID
                if not _UNREADABLE_SAID:
                    _UNREADABLE_SAID = True
                    logger.warning("rdma-kv: a KV-transfer stats report could not be read and is dropped "
                                   "(do all engine processes run the same rdma-kv?): %s", exc)
                self._typed, self.unreadable = WorkerStats(), True
        return self._typed

    def reset(self) -> None:
        self.data: dict[str, Any] = {}
        self._typed, self.unreadable = None, False

    def is_empty(self) -> bool:
        """No record, no count and no gauge: a worker's gauge-only report (its
        leases or resources moved) is not empty, else ``aggregate`` and vLLM's
        scheduler would drop that rank's gauges."""
        return not self.carries_events() and not self._parsed().carries_gauges()

    def carries_events(self) -> bool:
        """A load, a push or a counted event: what an interval's "KV Transfer
        metrics" line is for."""
        typed = self._parsed()
        return bool(typed.requests or typed.pushes or any(typed.totals.to_dict().values()))

    def aggregate(self, other: KVConnectorStats) -> RdmaKVConnectorStats:
        """Fold ``other`` (another worker, or a later interval) in with the
        connector's one merge: records concatenated (the newest
        ``MAX_RECORDS`` kept), totals summed, gauges kept per TP rank (the
        later report's for a rank in both) and leases held and resources
        summed over the ranks."""
        if not isinstance(other, RdmaKVConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into RdmaKVConnectorStats")
        if RdmaKVConnectorStats.is_empty(other):
            return self
        from rdma_kv.connector.rdma.stats import WorkerStats, merge

        merged = merge([self._parsed(), other._parsed()]) or WorkerStats()
        self._typed, self.data = merged, merged.to_dict()  # the dict vLLM carries, kept in step
        return self

    def reduce(self) -> dict[str, int | float]:
        typed = self._parsed()
        totals = typed.totals
        ok = [r for r in typed.requests if r.ok]
        out: dict[str, int | float] = {
            "loads": len(typed.requests),
            "loads_failed": len(typed.requests) - len(ok),
            "bytes": totals.nbytes,
            "bytes_skipped": totals.nbytes_skipped,
            "descriptors": totals.num_descs,
            "ops_posted": totals.ops_posted,
            "handshakes": totals.consumer.handshakes,
        }
        if typed.carries_gauges():
            out["leases_held"] = typed.leases_held
        for name, values in (("transfer", [r.transfer_s for r in ok]), ("total", [r.total_s for r in ok])):
            measured = [v for v in values if v is not None]
            if measured:
                out[f"median_{name}_ms"] = round(1e3 * statistics.median(measured), 3)
        done = [p for p in typed.pushes if p.outcome == "done"]
        if typed.pushes:  # a push producer: how much of what it wrote overlapped its prefills
            out["pushes"] = len(typed.pushes)
            written = sum(p.nbytes for p in done)
            if written:
                out["push_overlap"] = round(sum(p.overlapped_nbytes for p in done) / written, 3)
        return out


class RdmaKVLoggedStats(RdmaKVConnectorStats):
    """The stats vLLM's API server rebuilds for its periodic "KV Transfer
    metrics" line (``build_kv_connector_stats``, which vLLM calls only
    there, directly or under its MultiConnector). A worker reports its
    gauges again every ``GAUGE_REFRESH_S`` while its engine steps, with or
    without transfers; an interval of such reports only is empty here, so
    an engine that moves no KV logs no line. The scheduler's stats, which
    carry the gauges to Prometheus, are ``RdmaKVConnectorStats`` and still
    count them. ``aggregate`` folds into ``self``: the logger's accumulator
    keeps this type, and the latest gauges reach the next line that has
    events."""

    def is_empty(self) -> bool:
        return not self.carries_events()


class RdmaKVPromMetrics(KVConnectorPromMetrics):
    """vLLM's per-connector Prometheus hook: rdma-kv's series (``rdma_kv_*``:
    transfer/post/load seconds, GB/s, bytes, descriptors and ops per request,
    loads by outcome, events), registered with the metric classes vLLM hands
    over and labelled per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # Lazy: the rdma package pulls in the worker; vLLM imports this module
        # in its front-end process, where it must stay cheap.
        from rdma_kv.connector.rdma.metrics import PrometheusMetrics

        first = next(iter(per_engine_labelvalues.values()), [""] * len(labelnames))
        self._metrics = PrometheusMetrics(labelnames=labelnames, labelvalues=first,
                                          counter_cls=self._counter_cls, histogram_cls=self._histogram_cls,
                                          gauge_cls=self._gauge_cls)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Parsed as the logger's copy is: a report it cannot read is dropped, never raised
        # (this runs in the API server's output handler too).
        stats = RdmaKVConnectorStats(data=transfer_stats_data)
        typed = stats._parsed()
        if not stats.unreadable:
            self._metrics.observe(typed, labelvalues=self.per_engine_labelvalues[engine_idx])

