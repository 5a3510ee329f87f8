"""``rdma-kv demo``: the README's main job.

By default, a prefill engine and a decode engine (two processes, the
engine harness of ``rdma_kv.harness``) run a stream of requests through the
RDMA connector over UCX loopback, verify every decode-side block bit-exact
and print per-request and aggregate latency and GB/s
(``rdma-kv demo --help`` lists its options).

``rdma-kv demo --transport`` runs the transport alone: one process registers
a KV-shaped buffer and publishes its metadata, the other reads blocks from it
with one-sided gets (random and contiguous block ids), verifies every byte
and prints what moved and at what GB/s.

Either exits non-zero if any byte is wrong.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    # add_help=False: -h/--help reach the demo's own parser.
    p = sub.add_parser("demo", help="prefill -> decode demo over UCX loopback (--transport: transport only)",
                       add_help=False)
    p.set_defaults(run=run, passthrough=True)


def transport_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdma-kv demo --transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", action="store_true", required=True)
    p.add_argument("--reps", type=int, default=3, help="repetitions per workload (default 3)")
    p.add_argument("--layers", type=int, default=32, help="KV layers (default 32)")
    p.add_argument("--blocks", type=int, default=128, help="blocks per request (default 128)")
    p.add_argument("--block-bytes", type=int, default=32768, help="bytes per block per K/V region (default 32 KiB)")
    return p


def run(args: argparse.Namespace) -> int:
    from rdma_kv.cli import pin_loopback

    pin_loopback()
    if "--transport" in args.rest:
        return run_transport(transport_parser().parse_args(args.rest))
    from rdma_kv.harness.demo import main as pd_demo

    return pd_demo(args.rest)


def run_transport(args: argparse.Namespace) -> int:
    from rdma_kv.bench import rdmakv_peer
    from rdma_kv.bench.runner import BenchError
    from rdma_kv.bench.workloads import PRESETS

    base = PRESETS["kv-random"].replace(num_layers=args.layers, blocks_per_request=args.blocks,
                                        block_nbytes=args.block_bytes, pool_blocks=2 * args.blocks,
                                        repetitions=args.reps)
    workloads = [base.replace(name="random block ids"),
                 base.replace(name="contiguous block ids", block_order="contiguous")]
    per_side = base.buffer_nbytes / 2**20
    print(f"rdma-kv demo: prefill-like target process registers {per_side:.0f} MiB of KV "
          f"({args.layers} layers x K/V x {2 * args.blocks} blocks x {args.block_bytes} B); "
          f"a decode-like reader process pulls {args.blocks} blocks per layer per request with one-sided UCX reads")
    failed = False
    for w in workloads:
        try:
            r = rdmakv_peer.run_backend(w, args.reps)
        except BenchError as exc:
            print(f"  {w.name}: FAILED\n{exc}", file=sys.stderr)
            failed = True
            continue
        mib = w.transfer_nbytes / 2**20
        print(f"  {w.name:<22} {w.descriptor_count:>6} descriptors -> {r.median_ops:>6} operations, "
              f"{mib:.0f} MiB per request: median {r.median_gbps:.2f} GB/s "
              f"[{r.min_gbps:.2f} - {r.max_gbps:.2f}], {r.median_ms:.1f} ms; verified bit-exact x{args.reps}")
    print("demo " + ("FAILED" if failed else "passed: every byte read matched the target's"))
    return 1 if failed else 0
