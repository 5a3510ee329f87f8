"""``rdma-kv bench``: rdma-kv against the kernel's copy limit (batched
``process_vm_readv``), ``ucx_perftest`` and, with ``--vs nixl``, NIXL, on
identical workloads in one run.

Each backend runs in its own pair of processes (target and reader) on the
same batches: same buffers, offsets, block ids and order; every repetition is
verified bit-exact outside the timed region.

``--sweep`` (implied by ``--plot FILE.png``) runs a descriptor-size sweep
instead of the workloads: the same bytes per point (``--sweep-bytes``,
default 64 MiB) as random descriptors of each size (``--sizes``, default
4KiB:4MiB, powers of two) for rdma-kv, NIXL (skipped with a note when it
is not installed) and ``ucx_perftest ucp_get``; it prints a table of median
GB/s [min - max] per size and backend, and ``--plot`` draws GB/s against
descriptor size (needs matplotlib: ``pip install 'rdma-kv[plot]'``).
Progress goes to stderr: a bar on a terminal, one final line otherwise.

``--scale concurrency,producers`` runs the scale curves instead: aggregate
GB/s and p50/p99 per-request load latency against concurrent requests
(``--concurrency``, default 1:256, one producer) and against producers
feeding one consumer (``--producers``, default 1:8, ``--producer-requests``
each), for rdma-kv and NIXL; a table on stdout, ``--csv``, ``--json``, and
with ``--plot FILE.png`` a figure (without matplotlib: the CSV beside it,
``FILE.csv``, and a note saying so).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from typing import Any

from rdma_kv.errors import ConfigError

KV_SHAPE_HELP = "LAYERS:BLOCKS:BLOCK_BYTES[:random|contiguous] (a custom KV workload, e.g. 32:256:32768:random)"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure GB/s of one-sided reads between two processes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vs", default="", help="comma list of peers to compare with: nixl")
    p.add_argument("--workloads", default=None,
                   help="comma list of presets (default: all): kv-random, kv-contiguous, kv-one-block, contiguous-256m")
    p.add_argument("--kv-shape", action="append", default=[], help=KV_SHAPE_HELP)
    p.add_argument("--reps", type=int, default=5, help="repetitions per workload and backend (default 5)")
    p.add_argument("--rounds", type=int, default=1,
                   help="backends of a workload take turns this many times, --reps each, pooled per row "
                        "(default 1)")
    p.add_argument("--progress", choices=("poll", "thread"), default="poll",
                   help="rdma-kv reader progress mode (default poll, like NIXL's reader; thread: as shipped and "
                        "as the connector runs it); applies to --scale too")
    p.add_argument("--lanes", type=int, default=None,
                   help="rdma-kv reader's workers per transfer (AgentConfig.lanes; default: AgentConfig's own, "
                        "from this host's CPUs); with N > 1 the run adds rdma-kv-l1 (one worker), cma-tN (the "
                        "kernel copy on N threads) and, with --vs nixl, nixl-tN (NIXL num_threads=N, "
                        "split_batch_size=N)")
    p.add_argument("--notify", action="store_true",
                   help="a notification on every transfer, for rdma-kv (notify=) and NIXL (notif_msg), as "
                        "NixlConnector's reads carry; each target checks one arrived per repetition")
    p.add_argument("--no-cma", action="store_true", help="skip the batched process_vm_readv baseline")
    p.add_argument("--perftest", default="32768,268435456",
                   help="ucx_perftest ucp_get message sizes, comma list (bytes or KiB/MiB/GiB; "
                        "'' or 'none': no ucx_perftest run)")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    s = p.add_argument_group("descriptor-size sweep")
    s.add_argument("--sweep", action="store_true", help="run the descriptor-size sweep instead of the workloads")
    s.add_argument("--plot", metavar="FILE.png", help="draw GB/s vs descriptor size into FILE (implies --sweep)")
    s.add_argument("--sizes", default="4KiB:4MiB",
                   help="descriptor sizes: MIN:MAX (powers of two) or a comma list (default 4KiB:4MiB)")
    s.add_argument("--sweep-bytes", default="64MiB", help="bytes moved per point, at every size (default 64MiB)")
    s.add_argument("--sweep-backends", default="rdma-kv,nixl,ucx_perftest",
                   help="comma list of rdma-kv, nixl, ucx_perftest, cma (default rdma-kv,nixl,ucx_perftest)")
    c = p.add_argument_group("scale curves")
    c.add_argument("--scale", metavar="AXES",
                   help="comma list of concurrency, producers: run the scale curves instead of the workloads")
    c.add_argument("--concurrency", default="1:256",
                   help="concurrent requests, one producer: MIN:MAX (powers of two) or a comma list (default 1:256)")
    c.add_argument("--producers", default="1:8",
                   help="producers feeding one consumer: MIN:MAX or a comma list (default 1:8)")
    c.add_argument("--producer-requests", type=int, default=8,
                   help="concurrent requests from each producer on the producers axis (default 8)")
    c.add_argument("--scale-request", default="16x32KiB",
                   help="one request: BLOCKSxSIZE random blocks (default 16x32KiB)")
    c.add_argument("--scale-backends", default=None,
                   help="comma list of rdma-kv, nixl, cma-t2 (the kernel's copy on two threads); default "
                        "rdma-kv, the --vs peers (nixl without --vs) and cma-t2")
    c.add_argument("--csv", metavar="PATH", help="with --scale: also write the table as CSV")
    p.set_defaults(run=run)


def perftest_sizes(text: str) -> list[int]:
    """``--perftest``: message sizes for ``ucx_perftest``; none for '' or 'none'."""
    from rdma_kv.bench.sweep import parse_nbytes

    if text.strip().lower() in ("", "none"):
        return []
    try:
        return [parse_nbytes(v) for v in text.split(",") if v.strip()]
    except ConfigError as exc:
        raise ConfigError(f"--perftest: {exc}; or '' / none for no ucx_perftest run") from None


def parse_kv_shape(text: str) -> Any:
    from rdma_kv.bench.workloads import PRESETS

    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ConfigError(f"--kv-shape {text!r}: expected {KV_SHAPE_HELP}")
    try:
        layers, blocks, block_bytes = (int(v) for v in parts[:3])
    except ValueError:
        raise ConfigError(f"--kv-shape {text!r}: LAYERS, BLOCKS and BLOCK_BYTES must be integers") from None
    order = parts[3] if len(parts) == 4 else "random"
    if order not in ("random", "contiguous"):
        raise ConfigError(f"--kv-shape {text!r}: order must be random or contiguous, got {order!r}")
    base = PRESETS["kv-random"]
    return base.replace(name=f"kv-{layers}x{blocks}x{block_bytes}-{order}", num_layers=layers,
                        blocks_per_request=blocks, block_nbytes=block_bytes,
                        pool_blocks=max(2 * blocks, 8), block_order=order)


def run(args: argparse.Namespace) -> int:
    from rdma_kv.cli import check_output, pin_loopback

    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        check_output(flag, path)
    pin_loopback()
    from rdma_kv.bench import baselines, rdmakv_peer
    from rdma_kv.bench.progress import ProgressBar
    from rdma_kv.bench.report import run_meta, table, to_json
    from rdma_kv.bench.workloads import PRESETS, preset

    if args.reps < 1 or args.rounds < 1:
        raise ConfigError(f"--reps and --rounds must be >= 1, got {args.reps} and {args.rounds}")
    from rdma_kv.transport.config import default_lanes
    from rdma_kv.transport.lanes import MAX_LANES

    if args.lanes is not None and not 1 <= args.lanes <= MAX_LANES:
        raise ConfigError(f"--lanes must be 1..{MAX_LANES}, got {args.lanes}")
    # The readers run on this host: the default they get is the one computed here.
    lanes = default_lanes() if args.lanes is None else args.lanes
    notify = args.notify
    baselines.register_backend(
        "rdma-kv",
        lambda w, reps: rdmakv_peer.run_backend(w, reps, progress=args.progress, lanes=args.lanes, notify=notify))
    if args.scale:
        return run_scale(args)
    if args.sweep or args.plot:
        return run_sweep(args)
    peers = [v for v in args.vs.split(",") if v]
    unknown = [v for v in peers if v not in ("nixl",)]
    if unknown:
        raise ConfigError(f"--vs {','.join(unknown)}: unknown; valid: nixl")
    names = args.workloads.split(",") if args.workloads else ([] if args.kv_shape else list(PRESETS))
    workloads = [preset(n, repetitions=args.reps) for n in names if n]
    workloads += [parse_kv_shape(s).replace(repetitions=args.reps) for s in args.kv_shape]
    backends = ["rdma-kv"]
    if lanes > 1:  # the same run, one worker: what the lanes add
        backends.append(baselines.add_variant("rdma-kv-l1", "rdma-kv", progress=args.progress, lanes=1,
                                              notify=notify))
    for peer in peers:
        backends.append(baselines.add_variant(peer, peer, notify=notify) if notify else peer)
        if peer == "nixl" and lanes > 1:
            # NIXL's own parallelism: its UCX thread pool splits a request over
            # num_threads workers, but only from split_batch_size descriptors on
            # (default 1024: never on three of the four presets); rdma-kv's lanes
            # stripe any request of 2 x lane_min_bytes. Each its smallest split.
            backends.append(baselines.add_variant(f"nixl-t{lanes}", "nixl", num_threads=lanes,
                                                  split_batch_size=lanes, notify=notify))
    if not args.no_cma:
        backends.append("cma")
        if lanes > 1:  # the kernel's own copy with as many threads: what any N workers can reach
            backends.append(baselines.add_variant(f"cma-t{lanes}", "cma", threads=lanes))
    started = datetime.datetime.now()
    sizes = perftest_sizes(args.perftest)
    bar = ProgressBar(len(workloads) * len(backends) * args.rounds + len(sizes), "rdma-kv bench")

    def progress(line: str) -> None:
        bar.write(line)
        bar.advance()

    results = baselines.run(workloads, backends, args.reps, progress=progress, rounds=args.rounds)
    for size in sizes:
        bar.start(f"ucx_perftest {size} B")
        results += baselines.run_perftests([size])
        bar.advance()
    bar.close(f"{sum(r.status == 'ok' for r in results)} ok of {len(results)}")
    print(table(results))
    print(f"rdma-kv: AgentConfig(lanes={lanes}{'' if args.lanes else ', the default'}), progress={args.progress}"
          + ("; every transfer notifies (rdma-kv notify=, NIXL notif_msg)" if notify else "")
          + ("; rdma-kv-l1: lanes=1" if lanes > 1 else "")
          + ("; nixl: nixl_agent_config defaults (num_threads=0)" if "nixl" in peers else "")
          + (f"; nixl-t{lanes}: num_threads={lanes}, split_batch_size={lanes} (NixlConnector passes num_threads)"
             if "nixl" in peers and lanes > 1 else "")
          + (f"; cma-t{lanes}: {lanes} threads, longest single-thread syscall span"
             if not args.no_cma and lanes > 1 else ""))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(to_json(results, **run_meta(started, args.reps), lanes=lanes, notify=notify,
                             rounds=args.rounds))
    return 0 if all(r.status != "failed" for r in results) else 1


def run_sweep(args: argparse.Namespace) -> int:
    from rdma_kv.bench import sweep
    from rdma_kv.bench.progress import ProgressBar

    sizes = sweep.parse_sizes(args.sizes)
    total = sweep.parse_nbytes(args.sweep_bytes)
    backends = [b for b in args.sweep_backends.split(",") if b]
    if args.vs and "nixl" not in backends:
        backends.append("nixl")
    if args.plot:
        from rdma_kv.bench.plot import require_matplotlib

        require_matplotlib()  # before a long run, not after it
    started = datetime.datetime.now()
    bar = ProgressBar(len(sizes) * len(backends), "rdma-kv bench --sweep")
    try:
        points = sweep.run_sweep(sizes, backends, args.reps, total, bar=bar)
    finally:
        bar.close()
    meta = sweep_meta(points, started, total, args.reps)
    print(sweep.sweep_table(points))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(sweep.to_json(points, **meta))
    if args.plot:
        from rdma_kv.bench.plot import plot_sweep

        path = plot_sweep(points, args.plot, title="One-sided GET bandwidth vs descriptor size",
                          subtitle=meta["subtitle"], footer=meta["footer"], total_nbytes=total)
        print(f"plot written to {path}", file=sys.stderr)
    return 0 if all(p.result.status != "failed" for p in points) else 1


def parse_scale(args: argparse.Namespace) -> dict[str, Any]:
    """The scale run's parameters from ``args``, every one checked before a run."""
    from rdma_kv.bench import scale

    axes = [a for a in args.scale.split(",") if a]
    unknown = [a for a in axes if a not in scale.AXES]
    if not axes or unknown:
        raise ConfigError(f"--scale {args.scale!r}: expected a comma list of {', '.join(scale.AXES)}")
    peers = [v for v in args.vs.split(",") if v] or ["nixl"]
    text = args.scale_backends or ",".join(["rdma-kv", *peers, "cma-t2"])
    backends = [b for b in text.split(",") if b]
    bad = [b for b in backends if b not in scale.BACKENDS]
    if not backends or bad:
        raise ConfigError(f"--scale-backends {text!r}: valid: {', '.join(scale.BACKENDS)}")
    if not 1 <= args.producer_requests <= scale.MAX_CONCURRENCY:
        raise ConfigError(f"--producer-requests must be 1..{scale.MAX_CONCURRENCY}, got {args.producer_requests}")
    if args.reps < 1:
        raise ConfigError(f"--reps must be >= 1, got {args.reps}")
    return {"axes": axes, "backends": backends, "request": scale.parse_request(args.scale_request),
            "concurrency": scale.parse_counts(args.concurrency, "concurrency", scale.MAX_CONCURRENCY),
            "producers": scale.parse_counts(args.producers, "producers", scale.MAX_PRODUCERS),
            "per_producer": args.producer_requests, "reps": args.reps}


def run_scale(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rdma_kv.bench import scale
    from rdma_kv.bench.report import run_meta

    params = parse_scale(args)
    started = datetime.datetime.now()
    points = []
    for axis in params["axes"]:
        points += scale.run_axis(axis, params["backends"], request=params["request"], reps=params["reps"],
                                 concurrency=params["concurrency"], producers=params["producers"],
                                 per_producer=params["per_producer"], reader_progress=args.progress,
                                 progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(scale.scale_table(points))
    print(f"rdma-kv reader: progress={args.progress}")
    csv_path = args.csv
    if args.plot:
        try:
            from rdma_kv.bench.plot import plot_scale

            path = plot_scale(points, args.plot, title="Scale: aggregate GB/s and per-request latency",
                              subtitle=f"host {platform.node()}  \u00b7  two or more processes on one host  "
                                       f"\u00b7  {started:%Y-%m-%d %H:%M}",
                              footer=f"One request: {params['request']} random blocks, all requests ready at "
                                     f"once, latency from then to each completion; median of {params['reps']} "
                                     "rep(s), bars min-max; every rep verified bit-exact. GB = 1e9 bytes.")
            print(f"plot written to {path}", file=sys.stderr)
        except ConfigError as exc:  # no matplotlib: the numbers still go somewhere
            csv_path = csv_path or str(Path(args.plot).with_suffix(".csv"))
            print(f"{exc}; wrote the table as CSV to {csv_path} instead", file=sys.stderr)
    if csv_path:
        Path(csv_path).write_text(scale.scale_csv(points))
    if args.json:
        Path(args.json).write_text(scale.to_json(points, **run_meta(started, params["reps"]),
                                                 request=str(params["request"]), reader_progress=args.progress))
    return 0 if all(p.status != "failed" for p in points) else 1


def sweep_meta(points: Any, started: datetime.datetime, total: int, reps: int) -> dict[str, Any]:
    """Host, UCX, transports and date for the JSON and the figure's title."""
    import os

    from rdma_kv.bench import sweep
    from rdma_kv.bench.report import run_meta

    version = sweep.ucx_version(points)
    library = next((str(p.result.config["ucx_library"]) for p in points if p.result.config.get("ucx_library")), "")
    source = "wheel" if "/libucx/" in library else "system" if library else ""
    ucx = f"UCX {version}" + (f" ({source})" if source else "") if version else "UCX version unknown (rdma-kv not run)"
    env = ", ".join(f"{k}={os.environ[k]}" for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ)
    host = platform.node()
    subtitle = (f"host {host}  \u00b7  {ucx}  \u00b7  {env or 'UCX_TLS unset'}  \u00b7  two processes on one host"
                f"  \u00b7  {started:%Y-%m-%d %H:%M}")
    footer = (f"Each point: {sweep.format_nbytes(total)} read by one process from another on this host as "
              f"random descriptors of one size (verified bit-exact); median of {reps} rep(s), band and bars = "
              f"min-max. GB = 1e9 bytes. ucx_perftest: -t ucp_get -O {sweep.PERFTEST_OUTSTANDING}, "
              f"with rdma-kv's UCX defaults (RNDV_THRESH=inf, MAX_RMA_RAILS=2) unless set.")
    return {**run_meta(started, reps), "ucx_version": version, "ucx_library": library,
            "sweep_nbytes": total, "subtitle": subtitle, "footer": footer}
