"""GPU reads by descriptor size: where the per-operation cost of CUDA IPC
ends and the copy engine's bandwidth starts.

Run on a GPU node (it needs torch with CUDA): every case is the selftest's
two-process read (``rdma_kv.selftest.pair.run_reads``: the real ``Agent``,
prepared lists, a KV-shaped read by block-table indices, bit-exact) with a
64 MiB transfer cut into blocks of 16 KiB .. 2 MiB, random or contiguous
block ids, one lane or the default. Beside it, the device's own copy limit:
one in-process ``torch`` device-to-device copy of 64 MiB.

    python bench/experiments/gpu_sweep.py --json gpu_sweep.json > ucx.log

Recorded: docs/benchmarks/2026-11-26-h200-gpu-sweep-get-zcopy.json (one
H200, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on, sizes 16K,256K,2M); with UCX's
default the same cases ran over software emulation (deploy.md, section 5).

UCX's ``PROTO_INFO`` tables go to stdout (fd 1, which is why the results
go to ``--json`` and stderr); the protocol each read used is read from it.

May import: torch, rdma_kv (its selftest's pair), the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rdma_kv.bench.workloads import Workload
from rdma_kv.selftest.pair import ReadSpec, run_reads
from rdma_kv.selftest.supervise import Collect, Deadline, UcxLog

TOTAL = 64 << 20


def d2d_gbps(nbytes: int = TOTAL, reps: int = 10) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--sizes", default="16K,64K,256K,1M,2M", help="block sizes, at most 2M (64 MiB = 16 layers x K/V x blocks)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--device", default="cuda:0", help="the GPU; 'host' runs the same cases on host memory (a smoke test)")
    args = ap.parse_args()
    log_path = os.path.realpath("/proc/self/fd/1")
    log = UcxLog(log_path) if os.path.isfile(log_path) else None
    rows: list[dict[str, object]] = []
    if args.device != "host":
        rows.append({"case": "torch d2d copy (in-process)", "gbps": round(d2d_gbps(), 2)})
        print(json.dumps(rows[0]), file=sys.stderr)
    for size in args.sizes.split(","):
        block = int(size[:-1]) << (10 if size.endswith("K") else 20)
        per_region = TOTAL // (16 * 2) // block
        if per_region < 1:
            ap.error(f"block size {size} is over 2M: a 64 MiB read of 16 layers x K/V holds no such block")
        for order in ("random", "contiguous"):
            for lanes in (1, None):
                w = Workload(f"gpu-{size}-{order}", "kv", num_layers=16, blocks_per_request=per_region,
                             block_nbytes=block, pool_blocks=per_region * 2, block_order=order, repetitions=3)
                sink = Collect()
                reads = run_reads([ReadSpec("gpu-gpu", args.device, args.device),
                                   ReadSpec("gpu-host", "host", args.device)],
                                  w, sink, Deadline(args.timeout), ucx_options={}, lanes=lanes, log=log)
                for check in reads.checks:
                    row = {"case": f"{check.name} {size} {order} lanes={reads.lanes}", "status": check.status.value,
                           **{k: check.figures.get(k) for k in ("gbps", "ops", "descriptors", "workers",
                                                                  "ucx_protocol")}}
                    if check.status != "PASS":
                        row["detail"] = check.detail
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
