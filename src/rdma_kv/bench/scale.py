"""Scale curves: aggregate GB/s and per-request load latency against
concurrent requests and against producers feeding one consumer, for
``rdma-kv bench --scale``.

What one point is: ``concurrency`` requests, all ready at once, each
reading ``request.blocks`` random blocks of ``request.block_nbytes`` from
one of ``producers`` target processes (request ``i`` from producer
``i % producers``) into blocks of its own on the one reader. The reader
posts every request, then waits for all of them. Measured per rep:

- aggregate GB/s: all bytes over the span from the first post to the last
  completion;
- per-request latency: from the moment the batch was ready (the first
  post) to that request's completion, so it includes the time a request
  waits behind the others, as a request that arrived with the batch would.
  p50 and p99 pool every request of every rep.

Every rep is verified bit-exact (every target fills its pool with its own
pattern per rep) outside the timed region. One set of processes serves a
whole concurrency axis; each point of the producers axis starts exactly
its own targets.

Backends: ``rdma-kv`` (one ``read_prepared`` per request, reader polling),
``nixl`` (one ``make_prepped_xfer`` + ``transfer`` per request, then
``check_xfer_state`` on all; skipped with its reason when NIXL does not
import) and ``cma-t2``, the kernel's own copy of the same blocks on two
threads (batched ``process_vm_readv``, the requests' blocks shared out
whole between the threads; its span is the longer thread's syscalls and
stands as every request's latency): the limit of any two-worker engine. NIXL's targets run without NIXL's progress thread here, unlike
the workload table's: that thread spins a core per target, and with
several targets on one 2-core host the curve would measure the spinning,
not the fan-in. Each target's command loop progresses its worker every
millisecond instead (wire-up needs the target's progress). Child bodies are in :mod:`rdma_kv.bench.scale_peers`.

Imports numpy, the stdlib and ``rdma_kv.bench`` siblings; never the
transport (the children import it).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import multiprocessing as mp
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdma_kv.bench import runner
from rdma_kv.bench.sweep import format_nbytes, parse_nbytes
from rdma_kv.errors import ConfigError

__all__ = ["AXES", "BACKENDS", "RequestShape", "ScalePoint", "parse_counts", "parse_request", "run_axis",
           "scale_csv", "scale_table"]

AXES = ("concurrency", "producers")
BACKENDS = ("rdma-kv", "nixl", "cma-t2")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_PRODUCERS = (1, 2, 4, 8)
MAX_CONCURRENCY = 1024
MAX_PRODUCERS = 16
POOL_BLOCKS = 1024  # each producer's pool of blocks to draw from
_PEER_MODULES = {"rdma-kv": "rdma_kv.bench.scale_peers:rdmakv", "nixl": "rdma_kv.bench.scale_peers:nixl",
                 "cma-t2": "rdma_kv.bench.scale_peers:cma"}


@dataclasses.dataclass(frozen=True)
class RequestShape:
    """One request: ``blocks`` random blocks of ``block_nbytes``."""

    blocks: int = 16
    block_nbytes: int = 32 << 10

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_nbytes

    def __str__(self) -> str:
        return f"{self.blocks}x{format_nbytes(self.block_nbytes).replace(' ', '')}"


def parse_request(text: str) -> RequestShape:
    """``BLOCKSxSIZE``, e.g. ``16x32KiB``."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\S+)\s*", text)
    if not m:
        raise ConfigError(f"--scale-request {text!r}: expected BLOCKSxSIZE, e.g. 16x32KiB")
    blocks, size = int(m.group(1)), parse_nbytes(m.group(2))
    if not 1 <= blocks <= POOL_BLOCKS or size <= 0 or size % 8:
        raise ConfigError(f"--scale-request {text!r}: BLOCKS must be 1..{POOL_BLOCKS} and SIZE a positive "
                          "multiple of 8 bytes")
    return RequestShape(blocks, size)


def parse_counts(text: str, what: str, maximum: int) -> list[int]:
    """A comma list (``1,2,4``) or ``MIN:MAX`` (every power of two between)."""
    try:
        if ":" in text:
            lo, hi = (int(v) for v in text.split(":", 1))
            counts = []
            n = lo
            while 0 < n <= hi:
                counts.append(n)
                n *= 2
        else:
            counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: expected a comma list of integers or MIN:MAX") from None
    if not counts or any(not 1 <= c <= maximum for c in counts):
        raise ConfigError(f"--{what} {text!r}: need at least one value, each 1..{maximum}")
    return sorted(set(counts))


@dataclasses.dataclass
class ScalePoint:
    """One backend at one (producers, concurrency)."""

    backend: str
    axis: str
    producers: int
    concurrency: int
    request_nbytes: int
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    gbps: list[float] = dataclasses.field(default_factory=list)  # per rep
    latencies_s: list[float] = dataclasses.field(default_factory=list)  # every request of every rep

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.gbps)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "axis": self.axis, "producers": self.producers,
                               "concurrency": self.concurrency, "request_nbytes": self.request_nbytes,
                               "status": self.status}
        if self.ok:
            lat = np.asarray(self.latencies_s) * 1e3
            out.update(gbps_median=float(np.median(self.gbps)), gbps_min=min(self.gbps), gbps_max=max(self.gbps),
                       p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)),
                       reps=len(self.gbps))
        else:
            out["reason"] = self.reason
        return out


def _points(axis: str, producers: Sequence[int], concurrency: Sequence[int],
            per_producer: int) -> list[tuple[int, int]]:
    """(producers, concurrency) of every point of ``axis``."""
    if axis == "concurrency":
        return [(1, c) for c in concurrency]
    return [(p, p * per_producer) for p in producers]


def run_axis(
    axis: str,
    backends: Sequence[str],
    *,
    request: RequestShape,
    reps: int,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    producers: Sequence[int] = DEFAULT_PRODUCERS,
    per_producer: int = 8,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    timeout_s: float = 180.0,
    reader_progress: str = "poll",
) -> list[ScalePoint]:
    """Every point of ``axis`` for every backend (one set of processes per
    backend). ``concurrency`` axis: one producer, each concurrency;
    ``producers`` axis: each producer count with ``per_producer`` requests
    from each. ``reader_progress``: the rdma-kv reader's
    ``AgentConfig.progress`` ("poll", like NIXL's reader; "thread", as the
    connector runs it)."""
    if axis not in AXES:
        raise ConfigError(f"--scale {axis!r}: unknown; valid: {', '.join(AXES)}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"--scale-backends {unknown}: unknown; valid: {', '.join(BACKENDS)}")
    if reps < 1:
        raise ConfigError(f"reps must be >= 1, got {reps}")
    from rdma_kv.transport.config import PROGRESS_MODES  # AgentConfig's own list

    if reader_progress not in PROGRESS_MODES:
        raise ConfigError(f"reader progress {reader_progress!r}: valid: {', '.join(PROGRESS_MODES)}")
    points = _points(axis, producers, concurrency, per_producer)
    out = []
    for backend in backends:
        results = [ScalePoint(backend, axis, p, c, request.nbytes) for p, c in points]
        reason = _unavailable(backend)
        if reason:
            for r in results:
                r.status, r.reason = "skipped", reason
        else:
            # The producers axis starts the targets of each point afresh: an
            # idle target is not free everywhere (NIXL's spins a core).
            groups = [results] if axis == "concurrency" else [[r] for r in results]
            for group in groups:
                try:
                    _run_backend(backend, group, request, reps, seed, progress, timeout_s, reader_progress)
                except Exception as exc:  # reported per point, the other points and backends still run
                    for r in group:
                        if not r.gbps:
                            r.status, r.reason = "failed", f"{type(exc).__name__}: {exc}"
        out.extend(results)
    return out


def _unavailable(backend: str) -> str | None:
    if backend == "nixl":
        from rdma_kv.bench.nixl_peer import nixl_available

        return nixl_available()
    return None


def _run_backend(backend: str, results: list[ScalePoint], request: RequestShape, reps: int, seed: int,
                 progress: Callable[[str], None] | None, timeout_s: float, reader_progress: str) -> None:
    ctx = mp.get_context("spawn")
    module, prefix = _PEER_MODULES[backend].split(":")
    num_targets = max(r.producers for r in results)
    max_concurrency = max(r.concurrency for r in results)
    start = {"type": "start", "seed": seed, "block_nbytes": request.block_nbytes, "pool_blocks": POOL_BLOCKS,
             "local_blocks": max_concurrency * request.blocks, "reader_progress": reader_progress}
    children: list[runner.Child] = []
    try:
        targets = []
        for i in range(num_targets):
            child = runner.Child(ctx, f"{module}:{prefix}_target", f"{backend} target {i}")
            children.append(child)
            child.chan.send(dict(start, index=i))
            targets.append(child)
        reader = runner.Child(ctx, f"{module}:{prefix}_reader", f"{backend} reader")
        children.append(reader)
        reader.chan.send(dict(start, targets=num_targets))
        for i, child in enumerate(targets):
            info, blob = child.chan.expect("ready", timeout_s)
            reader.chan.send(dict(info, type="peer", index=i), blob)
        reader.chan.expect("ready", timeout_s)
        for point in results:
            t0 = time.perf_counter()
            for rep in range(reps):
                for child in targets[:point.producers]:
                    child.chan.send({"type": "fill", "rep": rep})
                    child.chan.expect("filled", timeout_s)
                reader.chan.send({"type": "rep", "rep": rep, "producers": point.producers,
                                  "concurrency": point.concurrency, "blocks": request.blocks})
                record, _ = reader.chan.expect("rep_result", timeout_s)
                point.gbps.append(record["nbytes"] / record["span_s"] / 1e9)
                point.latencies_s.extend(record["latencies_s"])
            if progress is not None:
                s = point.summary()
                progress(f"{backend} P={point.producers} C={point.concurrency}: {s['gbps_median']:.2f} GB/s, "
                         f"p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms ({time.perf_counter() - t0:.1f} s)")
        for child in [reader, *targets]:  # reader first: it holds the targets' keys
            child.chan.send({"type": "close"})
            child.chan.expect("closed", timeout_s)
    finally:
        for child in reversed(children):
            child.close(timeout_s=10)


# --- the requests drawn and their check (used by the reader children) ---------------------


def draw_requests(seed: int, rep: int, producers: int, concurrency: int, blocks: int,
                  pool_blocks: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(producer, local block ids, remote block ids) of each request of one
    rep: request ``i`` reads from producer ``i % producers`` into local
    blocks ``[i * blocks, (i + 1) * blocks)``, from random distinct pool blocks."""
    rng = np.random.default_rng([seed, rep, producers, concurrency])
    return [(i % producers, np.arange(i * blocks, (i + 1) * blocks, dtype=np.int64),
             rng.choice(pool_blocks, blocks, replace=False).astype(np.int64))
            for i in range(concurrency)]


def verify(local: np.ndarray, requests: list[tuple[int, np.ndarray, np.ndarray]], seed: int, rep: int,
           block_nbytes: int, who: str) -> None:
    """Raise ``VerificationError`` unless every request's blocks hold its
    producer's pattern for ``rep`` (producer ``t`` fills with seed ``seed + t``)."""
    row_words = block_nbytes // 8
    rows = local.view(np.uint64).reshape(-1, row_words)
    col = np.arange(row_words, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i, (producer, local_ids, remote_ids) in enumerate(requests):
            salt = runner.pattern_salt(seed + producer, rep)
            want = (remote_ids.astype(np.uint64)[:, None] * np.uint64(row_words) + col) * runner._MUL + salt
            if not np.array_equal(rows[local_ids], want):
                raise runner.VerificationError(f"{who}: rep {rep} request {i} (producer {producer}) does not "
                                                "hold the producer's bytes")


# --- output ---------------------------------------------------------------------------------


def scale_table(points: Sequence[ScalePoint]) -> str:
    """One row per point: GB/s median [min - max], p50 and p99 latency."""
    head = ["axis", "backend", "producers", "requests", "GB/s [min - max]", "p50 ms", "p99 ms"]
    rows = [head]
    for p in points:
        s = p.summary()
        if p.ok:
            rows.append([p.axis, p.backend, str(p.producers), str(p.concurrency),
                         f"{s['gbps_median']:.2f} [{s['gbps_min']:.2f} - {s['gbps_max']:.2f}]",
                         f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}"])
        else:
            rows.append([p.axis, p.backend, str(p.producers), str(p.concurrency), p.status, "-", "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    request = points[0].request_nbytes if points else 0
    lines += ["", f"GB = 1e9 bytes; one request = {format_nbytes(request)}; latency: batch ready -> "
                  "the request's completion, every request of every rep pooled."]
    notes = {p.backend: f"{p.backend}: {p.status} ({p.reason.strip().splitlines()[-1] if p.reason else ''})"
             for p in points if not p.ok}
    return "\n".join(lines + list(notes.values()))


def scale_csv(points: Sequence[ScalePoint]) -> str:
    fields = ["axis", "backend", "producers", "concurrency", "request_nbytes", "status", "gbps_median",
              "gbps_min", "gbps_max", "p50_ms", "p99_ms", "reps", "reason"]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for p in points:
        writer.writerow(p.summary())
    return out.getvalue()


def to_json(points: Sequence[ScalePoint], **meta: Any) -> str:
    return json.dumps({"meta": meta, "scale": [dict(p.summary(), gbps=p.gbps) for p in points]},
                      indent=1, default=str)
