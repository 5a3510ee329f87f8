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
import statistics

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["RdmaKVConnectorStats", "RdmaKVPromMetrics"]

@dataclasses.dataclass
class RdmaKVConnectorStats(KVConnectorStats):
    """``data``: the worker's summary in its dict form,
    ``{"requests": [record, ...], "totals": {name: number}, "leases_held": n[, "resources": {...}]}``
    (``rdma_kv.connector.rdma.stats.WorkerStats.to_dict``)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def is_empty(self) -> bool:
        return not self.data.get("requests") and not any(self.data.get("totals", {}).values())

    def aggregate(self, other: KVConnectorStats) -> RdmaKVConnectorStats:
        """Fold ``other`` (another worker, or a later interval) in with the
        connector's one merge: records concatenated (the newest
        ``MAX_RECORDS`` kept), totals, leases held and resources summed."""
        if not isinstance(other, RdmaKVConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into RdmaKVConnectorStats")
        if other.is_empty():
            return self
        # Lazy, as in RdmaKVPromMetrics: vLLM imports this module in its front end.
        from rdma_kv.connector.rdma.stats import WorkerStats, merge

        merged = merge([WorkerStats.from_dict(self.data), WorkerStats.from_dict(other.data)])
        self.data = merged.to_dict() if merged is not None else {}
        return self

    def reduce(self) -> dict[str, int | float]:
        records = self.data.get("requests", [])
        totals = self.data.get("totals", {})
        ok = [r for r in records if r.get("ok")]
        out: dict[str, int | float] = {
            "loads": len(records),
            "loads_failed": len(records) - len(ok),
            "bytes": int(totals.get("nbytes", 0)),
            "bytes_skipped": int(totals.get("nbytes_skipped", 0)),
            "descriptors": int(totals.get("num_descs", 0)),
            "ops_posted": int(totals.get("ops_posted", 0)),
            "handshakes": int(totals.get("handshakes", 0)),
        }
        for key in ("transfer_s", "total_s"):
            values = [float(r[key]) for r in ok if key in r]
            if values:
                out[f"median_{key[:-2]}_ms"] = round(1e3 * statistics.median(values), 3)
        return out


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
        self._metrics.observe(transfer_stats_data, labelvalues=self.per_engine_labelvalues[engine_idx])

