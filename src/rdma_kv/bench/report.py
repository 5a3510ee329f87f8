"""Benchmark results: one record per (backend, workload), statistics, table, JSON.

Units: GB/s is 1e9 bytes per second (decimal, like NIXL's and the issue's
figures); ``ucx_perftest`` prints MB/s with MB = 2**20 bytes and is
converted. ``seconds`` is post-to-completion time; ``prep_seconds`` is the
time to build the request from the batch (NIXL ``make_prepped_xfer``, cma
iovec building); ``post_seconds`` the post call alone where a backend has
one. ``total`` = prep + transfer.

Imports the stdlib and ``rdma_kv.bench.workloads`` only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from rdma_kv.bench.workloads import Workload

GB = 1e9
STATUSES = ("ok", "skipped", "failed")


@dataclass
class Result:
    """Per-rep measurements of one backend on one workload."""

    backend: str
    workload: str
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    descriptors: int = 0
    seconds: list[float] = field(default_factory=list)
    prep_seconds: list[float] = field(default_factory=list)
    post_seconds: list[float] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_records(
        cls, backend: str, workload: Workload, records: Sequence[dict[str, Any]], config: dict[str, Any] | None = None
    ) -> Result:
        res = cls(backend, workload.name, descriptors=workload.descriptor_count, config=dict(config or {}))
        extra_keys: set[str] = set()
        for r in records:
            res.seconds.append(float(r["seconds"]))
            res.prep_seconds.append(float(r.get("prep_seconds", 0.0)))
            if r.get("post_seconds") is not None:
                res.post_seconds.append(float(r["post_seconds"]))
            res.ops.append(int(r["ops"]))
            res.nbytes.append(int(r["nbytes"]))
            extra_keys |= set(r) - {"type", "rep", "seconds", "prep_seconds", "post_seconds", "ops", "nbytes", "descriptors"}
        for key in sorted(extra_keys):
            res.extra[key] = [r.get(key) for r in records]
        return res

    def extend(self, later: Result) -> Result:
        """Pool ``later``'s repetitions of the same backend and workload (a
        later round) into this one; a round that did not succeed wins."""
        if later.status != "ok" or self.status != "ok":
            return later if self.status == "ok" else self
        n = len(self.seconds)
        for name in ("seconds", "prep_seconds", "post_seconds", "ops", "nbytes"):
            getattr(self, name).extend(getattr(later, name))
        for key in set(self.extra) | set(later.extra):
            self.extra[key] = list(self.extra.get(key, [None] * n)) + list(
                later.extra.get(key, [None] * len(later.seconds)))
        self.config.setdefault("rounds", 1)
        self.config["rounds"] += 1
        return self

    @classmethod
    def skipped(cls, backend: str, workload: str, reason: str) -> Result:
        return cls(backend, workload, status="skipped", reason=reason)

    @classmethod
    def failed(cls, backend: str, workload: str, reason: str) -> Result:
        return cls(backend, workload, status="failed", reason=reason)

    # --- statistics ---------------------------------------------------------------

    @property
    def gbps(self) -> list[float]:
        return [n / s / GB for n, s in zip(self.nbytes, self.seconds) if s > 0]

    @property
    def median_gbps(self) -> float | None:
        return statistics.median(self.gbps) if self.gbps else None

    @property
    def min_gbps(self) -> float | None:
        return min(self.gbps) if self.gbps else None

    @property
    def max_gbps(self) -> float | None:
        return max(self.gbps) if self.gbps else None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.seconds) * 1e3 if self.seconds else None

    @property
    def median_total_ms(self) -> float | None:
        if not self.seconds:
            return None
        prep = self.prep_seconds or [0.0] * len(self.seconds)
        return statistics.median(p + s for p, s in zip(prep, self.seconds)) * 1e3

    @property
    def prep_us_per_desc(self) -> float | None:
        if not self.prep_seconds or not self.descriptors:
            return None
        return statistics.median(self.prep_seconds) * 1e6 / self.descriptors

    @property
    def post_us_per_desc(self) -> float | None:
        if not self.post_seconds or not self.descriptors:
            return None
        return statistics.median(self.post_seconds) * 1e6 / self.descriptors

    @property
    def median_ops(self) -> int | None:
        return int(statistics.median(self.ops)) if self.ops else None

    def summary(self) -> dict[str, Any]:
        keys = ("median_gbps", "min_gbps", "max_gbps", "median_ms", "median_total_ms",
                "prep_us_per_desc", "post_us_per_desc", "median_ops")
        return {k: getattr(self, k) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), summary=self.summary(), units={"GB": "1e9 bytes"})


# --- output ------------------------------------------------------------------------------


def run_meta(started: datetime.datetime, reps: int) -> dict[str, Any]:
    """What every results file records about the run that made it."""
    return {"started": started.isoformat(timespec="seconds"), "argv": list(sys.argv),
            "host": platform.node(), "python": platform.python_version(), "reps": reps}


def to_json(results: Iterable[Result], **meta: Any) -> str:
    return json.dumps({"meta": meta, "results": [r.to_dict() for r in results]}, indent=2)


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(results: Sequence[Result], baseline: str = "nixl") -> str:
    """Plain-text side-by-side table; ratios are against ``baseline`` on the
    same workload (GB/s ratio: higher is better; time ratio: lower is better)."""
    base = {r.workload: r for r in results if r.backend == baseline and r.status == "ok"}
    head = ("workload", "backend", "descs", "ops", "GB/s med", "[min - max]", "xfer ms",
            "total ms", "prep us/desc", "post us/desc", f"GB/s / {baseline}", f"total / {baseline}")
    rows = [head]
    notes = []
    for r in results:
        if r.status != "ok":
            rows.append((r.workload, r.backend, "-", "-", r.status, "", "", "", "", "", "", ""))
            notes.append(f"{r.backend} on {r.workload}: {r.status}: {r.reason.strip().splitlines()[-1] if r.reason else ''}")
            continue
        b = base.get(r.workload)
        ratio = r.median_gbps / b.median_gbps if b and b.median_gbps and r.median_gbps else None
        tratio = r.median_total_ms / b.median_total_ms if b and b.median_total_ms and r.median_total_ms else None
        rows.append((
            r.workload, r.backend, str(r.descriptors), str(r.median_ops), _f(r.median_gbps, ".2f"),
            f"[{_f(r.min_gbps, '.2f')} - {_f(r.max_gbps, '.2f')}]", _f(r.median_ms, ".3f"),
            _f(r.median_total_ms, ".3f"), _f(r.prep_us_per_desc, ".4f"), _f(r.post_us_per_desc, ".4f"),
            _f(ratio, ".2f"), _f(tratio, ".2f"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("GB = 1e9 bytes; medians over reps; xfer = post to completion; total = prep + xfer.")
    lines.extend(notes)
    return "\n".join(lines)
