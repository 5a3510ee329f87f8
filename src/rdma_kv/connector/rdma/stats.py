"""Per-request transfer records of a worker's consumer part, and their
summary for ``get_kv_connector_stats``.

Owns what is recorded for each finished load (bytes, descriptors, ops
posted, contiguous block runs, plan / post / transfer / confirm seconds,
outcome) and the event counters (handshakes, lease RPCs, failures). Not
thread-safe: ``consumer.RdmaConsumer`` calls it under its lock;
``worker.RdmaWorker.stats`` adds the producer's lease counters and
summarizes.

Imports the standard library only.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

__all__ = ["LoadStats", "summarize"]

MAX_RECORDS = 100_000  # beyond this, the oldest half is dropped (nobody is collecting)
TOTAL_KEYS = ("nbytes", "num_descs", "ops_posted", "block_runs", "num_blocks")


class LoadStats:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.counters = collections.Counter[str]()

    def record(self, request_id: str, stats: Mapping[str, Any], *, ok: bool, total_s: float,
               error: str | None) -> None:
        entry = dict(stats)
        entry.pop("confirm_start", None)
        entry.update(request_id=request_id, ok=ok, total_s=total_s)
        if error:
            entry["error"] = error
        self.records.append(entry)
        if len(self.records) > MAX_RECORDS:
            del self.records[: len(self.records) // 2]

    def take(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """Hand over what was recorded since the last call, and reset."""
        records, self.records = self.records, []
        counters = dict(self.counters)
        self.counters.clear()
        return records, counters


def summarize(records: list[dict[str, Any]], counters: Mapping[str, int], *,
              leases_held: int) -> dict[str, Any] | None:
    if not records and not counters:
        return None
    totals: dict[str, Any] = {k: sum(int(r.get(k, 0)) for r in records) for k in TOTAL_KEYS}
    totals.update(loads_ok=sum(1 for r in records if r["ok"]),
                  transfer_s=sum(float(r.get("transfer_s", 0.0)) for r in records), **counters)
    return {"requests": records, "totals": totals, "leases_held": leases_held}
