"""Descriptor-size sweep: GB/s against descriptor size, one point per
(backend, size), for ``rdma-kv bench --sweep`` / ``--plot``.

What one point moves: the same number of bytes at every size
(``total_nbytes``, default 64 MiB), as ``total_nbytes / size`` descriptors
of ``size`` bytes. A fixed descriptor count is not an option: 16,384
descriptors of 4 MiB would need 64 GiB per side. The descriptors are random
slot ids, drawn independently on each side, from a pool twice as large
(one region of ``2 * total_nbytes`` per side), so they rarely merge and
the small sizes measure the per-operation cost (the ops actually posted
are recorded per rep). Every rep is verified bit-exact outside the timed
region, as in the workload runs.

Backends:

- ``rdma-kv`` and ``nixl`` (skipped with its reason when NIXL does not
  import), through the same two-process runner as the workload table;
- ``ucx_perftest``: ``-t ucp_get -s SIZE -O 64`` with the iterations that
  move ``total_nbytes`` (at least 100), once per rep, with the UCX settings
  rdma-kv applies by default (``RNDV_THRESH=inf``, ``MAX_RMA_RAILS=2``)
  unless the operator set them, so all three run the same UCX protocol;
- ``cma`` (on request only): the kernel's batched ``process_vm_readv``.

Imports the stdlib and ``rdma_kv.bench`` siblings; never ``rdma_kv.transport``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rdma_kv.bench import baselines, perftest
from rdma_kv.bench.runner import BenchError
from rdma_kv.bench.progress import ProgressBar
from rdma_kv.bench.report import Result
from rdma_kv.bench.workloads import KiB, MiB, Workload
from rdma_kv.errors import ConfigError

__all__ = ["BACKENDS", "DEFAULT_BACKENDS", "DEFAULT_SIZES", "DEFAULT_TOTAL_NBYTES", "Point",
           "format_nbytes", "parse_nbytes", "parse_sizes", "run_sweep", "sweep_table", "to_json", "workload_for"]

DEFAULT_SIZES = tuple(4 * KiB << i for i in range(11))  # 4 KiB .. 4 MiB
DEFAULT_TOTAL_NBYTES = 64 * MiB
DEFAULT_BACKENDS = ("rdma-kv", "nixl", "ucx_perftest")
BACKENDS = ("rdma-kv", "nixl", "ucx_perftest", "cma")
PERFTEST_OUTSTANDING = 64
PERFTEST_MIN_ITERATIONS = 100
# The settings rdma-kv's Agent applies unless the operator set them that
# change a host-memory transfer (rdma_kv.transport.ucx.DEFAULT_OPTIONS, whose
# other two act on GPU memory and IB devices only; not imported: no UCX in
# this process).
RDMA_KV_UCX_DEFAULTS = {"UCX_RNDV_THRESH": "inf", "UCX_MAX_RMA_RAILS": "2"}

_UNITS = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_nbytes(text: str) -> int:
    """``4096``, ``4K``, ``4KiB``, ``64MiB`` -> bytes (K/M/G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{text!r} is not a size; use bytes or a KiB/MiB/GiB suffix, e.g. 4096, 4KiB, 64MiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_nbytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def parse_sizes(text: str) -> list[int]:
    """``MIN:MAX`` (every power of two from MIN to MAX) or a comma list."""
    if ":" in text:
        lo_text, hi_text = text.split(":", 1)
        lo, hi = parse_nbytes(lo_text), parse_nbytes(hi_text)
        if lo <= 0 or lo & (lo - 1) or hi & (hi - 1) or hi < lo:
            raise ConfigError(f"--sizes {text!r}: MIN:MAX must be powers of two with MIN <= MAX")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
    else:
        sizes = [parse_nbytes(v) for v in text.split(",") if v.strip()]
    bad = [s for s in sizes if s <= 0 or s % 8]
    if not sizes or bad:
        raise ConfigError(f"--sizes {text!r}: need at least one size, each a positive multiple of 8 bytes")
    return sorted(set(sizes))


def workload_for(size: int, total_nbytes: int, reps: int = 1, seed: int = 0) -> Workload:
    """The workload of one sweep point: ``total_nbytes // size`` random
    descriptors of ``size`` bytes out of one region of twice that."""
    if total_nbytes < size:
        raise ConfigError(f"sweep total {format_nbytes(total_nbytes)} is smaller than descriptor size "
                          f"{format_nbytes(size)}; raise --sweep-bytes")
    count = total_nbytes // size
    return Workload(f"sweep-{format_nbytes(size).replace(' ', '')}", "kv", num_layers=1, regions_per_layer=1,
                    blocks_per_request=count, block_nbytes=size, pool_blocks=2 * count, block_order="random",
                    repetitions=reps, seed=seed)


@dataclass
class Point:
    """One backend at one descriptor size."""

    backend: str
    descriptor_nbytes: int
    result: Result

    @property
    def ok(self) -> bool:
        return self.result.status == "ok" and bool(self.result.gbps)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "descriptor_nbytes": self.descriptor_nbytes, **self.result.to_dict()}


def perftest_env() -> dict[str, str]:
    """rdma-kv's UCX defaults for the ucx_perftest processes, unless already set."""
    return {k: v for k, v in RDMA_KV_UCX_DEFAULTS.items() if k not in os.environ}


def perftest_point(size: int, total_nbytes: int, reps: int) -> Result:
    """``ucx_perftest ucp_get`` at ``size``, ``reps`` runs as one Result."""
    workload = workload_for(size, total_nbytes, reps)
    try:
        perftest.perftest_binary()
    except BenchError as exc:
        return Result.skipped(perftest.NAME, workload.name, str(exc))
    iterations = max(PERFTEST_MIN_ITERATIONS, total_nbytes // size)
    env = perftest_env()
    res = Result(perftest.NAME, workload.name, descriptors=iterations,
                 config={"iterations": iterations, "outstanding": PERFTEST_OUTSTANDING,
                         "env": {**RDMA_KV_UCX_DEFAULTS, **{k: os.environ[k] for k in RDMA_KV_UCX_DEFAULTS
                                                              if k in os.environ}}})
    latencies = []
    for _ in range(reps):
        try:
            r = perftest.run_perftest(size, iterations, outstanding=PERFTEST_OUTSTANDING, env=env)
        except (BenchError, OSError, TimeoutError, subprocess.TimeoutExpired) as exc:
            return Result.failed(perftest.NAME, workload.name, f"{type(exc).__name__}: {exc}")
        nbytes = size * iterations
        res.nbytes.append(nbytes)
        res.seconds.append(nbytes / (r.bandwidth_mib_s * MiB))  # run time implied by its bandwidth
        res.ops.append(iterations)
        latencies.append(r.latency_avg_us)
    res.extra = {"latency_avg_us": latencies}
    return res


Runner = Callable[[str, Workload, int], Result]


def run_sweep(
    sizes: Sequence[int],
    backends: Sequence[str] = DEFAULT_BACKENDS,
    reps: int = 5,
    total_nbytes: int = DEFAULT_TOTAL_NBYTES,
    *,
    bar: ProgressBar | None = None,
    runner: Runner | None = None,
) -> list[Point]:
    """Every backend at every size, size-major (neighbours in time sit side
    by side in the table). ``runner(name, workload, reps)`` defaults to
    :func:`rdma_kv.bench.baselines.run_one`; ucx_perftest is run here."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"sweep backends {unknown}: unknown; valid: {', '.join(BACKENDS)}")
    if reps < 1:
        raise ConfigError(f"reps must be >= 1, got {reps}")
    for size in sizes:
        workload_for(size, total_nbytes)  # validate every size before the first run
    run = runner or baselines.run_one
    points = []
    for size in sizes:
        workload = workload_for(size, total_nbytes, reps)
        for name in backends:
            if bar is not None:
                bar.start(f"{name} @ {format_nbytes(size)}")
            t0 = time.perf_counter()
            result = perftest_point(size, total_nbytes, reps) if name == perftest.NAME else run(name, workload, reps)
            result.config.setdefault("wall_s", time.perf_counter() - t0)
            points.append(Point(name, size, result))
            if bar is not None:
                if result.status == "failed":
                    bar.write(f"{name} @ {format_nbytes(size)}: failed: {_last_line(result.reason)}")
                bar.advance()
    return points


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def skipped_notes(points: Sequence[Point]) -> list[str]:
    """One note per backend that was skipped or failed somewhere, with its reason."""
    notes: dict[str, str] = {}
    for p in points:
        if p.result.status != "ok" and p.backend not in notes:
            notes[p.backend] = f"{p.backend}: {p.result.status} ({_last_line(p.result.reason)})"
    return list(notes.values())


def sweep_table(points: Sequence[Point]) -> str:
    """Descriptor size down, backends across: median GB/s [min - max]."""
    backends = list(dict.fromkeys(p.backend for p in points))
    sizes = sorted({p.descriptor_nbytes for p in points})
    by_key = {(p.backend, p.descriptor_nbytes): p for p in points}
    head = ["descriptor", "descs/point"] + [f"{b} GB/s [min - max]" for b in backends]
    rows = [head]
    for size in sizes:
        descs = [p.result.descriptors for p in points
                 if p.descriptor_nbytes == size and p.backend != perftest.NAME and p.result.descriptors]
        row = [format_nbytes(size), str(descs[0]) if descs else "-"]
        for b in backends:
            p = by_key.get((b, size))
            if p is None:
                row.append("-")
            elif not p.ok:
                row.append(p.result.status)
            else:
                r = p.result
                row.append(f"{r.median_gbps:.2f} [{r.min_gbps:.2f} - {r.max_gbps:.2f}]")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", "GB = 1e9 bytes; median over reps, [min - max]; same bytes per point at every size."]
    lines += skipped_notes(points)
    return "\n".join(lines)


def ucx_version(points: Sequence[Point]) -> str:
    """The UCX version an rdma-kv reader reported ("" if none ran)."""
    for p in points:
        version = p.result.config.get("ucx_version")
        if version:
            return str(version)
    return ""


def to_json(points: Sequence[Point], **meta: Any) -> str:
    return json.dumps({"meta": meta, "sweep": [p.to_dict() for p in points]}, indent=2, default=str)
