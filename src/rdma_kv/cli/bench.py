"""``rdma-kv bench``: rdma-kv against the kernel's copy limit (batched
``process_vm_readv``), ``ucx_perftest`` and, with ``--vs nixl``, NIXL, on
identical workloads in one run.

Each backend runs in its own pair of processes (target and reader) on the
same plan: same buffers, offsets, block ids and order; every repetition is
verified bit-exact outside the timed region.
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
    p.add_argument("--progress", choices=("poll", "thread"), default="poll",
                   help="rdma-kv reader progress mode (default poll, like NIXL's reader)")
    p.add_argument("--no-cma", action="store_true", help="skip the batched process_vm_readv baseline")
    p.add_argument("--perftest", default="32768,268435456",
                   help="ucx_perftest ucp_get message sizes in bytes, comma list ('' = none)")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    p.set_defaults(run=run)


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
    from rdma_kv.cli import pin_loopback

    pin_loopback()
    from rdma_kv.bench import baselines, rdmakv_peer
    from rdma_kv.bench.report import table, to_json
    from rdma_kv.bench.workloads import PRESETS, preset

    if args.reps < 1:
        raise ConfigError(f"--reps must be >= 1, got {args.reps}")
    peers = [v for v in args.vs.split(",") if v]
    unknown = [v for v in peers if v not in ("nixl",)]
    if unknown:
        raise ConfigError(f"--vs {','.join(unknown)}: unknown; valid: nixl")
    names = args.workloads.split(",") if args.workloads else ([] if args.kv_shape else list(PRESETS))
    workloads = [preset(n, repetitions=args.reps) for n in names if n]
    workloads += [parse_kv_shape(s).replace(repetitions=args.reps) for s in args.kv_shape]
    baselines.register_backend("rdma-kv", lambda w, reps: rdmakv_peer.run_backend(w, reps, progress=args.progress))
    backends = ["rdma-kv"] + peers + ([] if args.no_cma else ["cma"])
    started = datetime.datetime.now().isoformat(timespec="seconds")
    results = baselines.run(workloads, backends, args.reps, progress=lambda m: print(m, file=sys.stderr, flush=True))
    sizes = [int(s) for s in args.perftest.split(",") if s]
    results += baselines.run_perftests(sizes)
    print(table(results))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(to_json(results, started=started, argv=sys.argv, host=platform.node(),
                             python=platform.python_version(), reps=args.reps))
    return 0 if all(r.status != "failed" for r in results) else 1
