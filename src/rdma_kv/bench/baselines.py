"""Runner: every backend on every workload, sequentially, in one run.

A backend is a plain function ``run_backend(workload: Workload, reps: int)
-> Result`` registered in ``BACKENDS`` by name; the rdma-kv backend plugs
in with ``register_backend("rdma-kv", fn)``. Each backend run gets its own
child processes (reaped by the runner, each step under a timeout). A
backend whose dependency is missing is reported as *skipped*; one that
fails is reported as *failed* with the child's traceback; neither stops
the run.

    python -m rdma_kv.bench.baselines [--reps 5] [--workloads a,b] \
        [--backends cma,nixl] [--perftest 32768,268435456] [--json PATH]

Imports the stdlib and ``rdma_kv.bench`` siblings; never ``rdma_kv.transport``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Callable, Iterable, Sequence

from rdma_kv.bench import cma, nixl_peer, perftest, rdmakv_peer
from rdma_kv.bench.runner import BackendUnavailableError, BenchError
from rdma_kv.bench.report import Result, run_meta, table, to_json
from rdma_kv.bench.workloads import PRESETS, Workload, preset
from rdma_kv.errors import ConfigError

Backend = Callable[[Workload, int], Result]

BACKENDS: dict[str, Backend] = {
    "rdma-kv": rdmakv_peer.run_backend,
    "rdma-kv-thread": lambda w, reps: _renamed(rdmakv_peer.run_backend(w, reps, progress="thread"), "rdma-kv-thread"),
    "cma": cma.run_backend,
    "nixl": nixl_peer.run_backend,  # strided prepared lists (NIXL >= 1.5)
    "nixl-blocks": lambda w, reps: _renamed(nixl_peer.run_backend(w, reps, list_mode="blocks"), "nixl-blocks"),
}


def _renamed(result: Result, name: str) -> Result:
    result.backend = name
    return result


def register_backend(name: str, fn: Backend) -> None:
    """Add (or replace) a backend; ``fn(workload, reps) -> Result``."""
    BACKENDS[name] = fn


_MODULES = {"rdma-kv": rdmakv_peer, "nixl": nixl_peer, "cma": cma}


def add_variant(name: str, base: str, **options: object) -> str:
    """Register ``name``: backend ``base`` (rdma-kv, nixl or cma) with ``options``; returns ``name``."""
    module = _MODULES[base]
    register_backend(name, lambda w, reps: _renamed(module.run_backend(w, reps, **options), name))
    return name


def run_one(name: str, workload: Workload, reps: int) -> Result:
    try:
        fn = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None
    try:
        return fn(workload, reps)
    except BackendUnavailableError as exc:
        return Result.skipped(name, workload.name, str(exc))
    except (BenchError, TimeoutError, OSError) as exc:
        return Result.failed(name, workload.name, f"{type(exc).__name__}: {exc}")


def run(
    workloads: Iterable[Workload | str],
    backends: Sequence[str] = ("cma", "nixl"),
    reps: int = 5,
    progress: Callable[[str], None] | None = None,
    rounds: int = 1,
) -> list[Result]:
    """Run each backend on each workload, one at a time (workload-major, so
    results for one workload sit side by side). With ``rounds`` > 1 the
    backends of a workload take turns, ``rounds`` times (A B C A B C ...),
    ``reps`` repetitions each in fresh processes, and each row pools its
    rounds: drift of a shared machine then falls on every backend alike."""
    results: list[Result] = []
    for w in workloads:
        workload = preset(w) if isinstance(w, str) else w
        pooled: dict[str, Result] = {}
        for _ in range(rounds):
            for name in backends:
                t0 = time.perf_counter()
                result = run_one(name, workload, reps)
                if progress:
                    progress(f"{name:>12} {workload.name:<16} {result.status:<8} {time.perf_counter() - t0:6.1f} s"
                             + (f"  median {result.median_gbps:.2f} GB/s" if result.median_gbps else ""))
                pooled[name] = pooled[name].extend(result) if name in pooled else result
        results.extend(pooled[name] for name in backends)
    return results


def run_perftests(sizes: Sequence[int], outstanding: int = 0) -> list[Result]:
    """ucx_perftest ucp_get at each size; iterations scaled to ~256 MiB moved."""
    out = []
    for size in sizes:
        iterations = max(10, min(20000, (256 << 20) // size * 4))
        out.append(perftest.run_backend(size, iterations, outstanding=outstanding))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rdma_kv.bench.baselines", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workloads", default=",".join(PRESETS), help=f"comma list of {sorted(PRESETS)}")
    ap.add_argument("--backends", default="cma,nixl", help=f"comma list of {sorted(BACKENDS)}")
    ap.add_argument("--perftest", default="32768,268435456", help="ucp_get message sizes in bytes ('' = none)")
    ap.add_argument("--perftest-outstanding", type=int, default=0, help="ucx_perftest -O (0 = its default)")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args(argv)

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = datetime.datetime.now()
    workloads = [preset(name, repetitions=args.reps) for name in args.workloads.split(",") if name]
    results = run(workloads, [b for b in args.backends.split(",") if b], args.reps, progress=say)
    sizes = [int(s) for s in args.perftest.split(",") if s]
    results += run_perftests(sizes, args.perftest_outstanding)
    print(table(results))
    for r in results:
        if r.backend == perftest.NAME and r.status == "ok":
            print(f"{r.workload}: {r.extra['bandwidth_MiB_s']:.1f} MB/s (2^20) = {r.median_gbps:.2f} GB/s, "
                  f"latency p50 {r.extra['latency_p50_us']:.2f} us, avg {r.extra['latency_avg_us']:.2f} us, "
                  f"{r.config['iterations']} iterations")
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(to_json(results, **run_meta(started, args.reps)))
    return 0 if all(r.status != "failed" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
