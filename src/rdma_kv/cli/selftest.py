"""``rdma-kv selftest``: does rdma-kv work on this host, end to end?

One line per check, PASS / FAIL / SKIP and the reason (``rdma_kv.selftest``
says what each checks): the UCX loaded and its transports by memory type;
host-memory reads between two processes with the real agent; per visible
GPU, registration through the connector's code, GPU <-> GPU and GPU <-> host
reads and the pumps' CUDA context (skipped without a GPU driver); a
loopback read through each NIC of the rank's ``ucx_net_devices`` (inside the
HCA over verbs: not the link or switch; over tcp the kernel keeps it on
loopback, so the NIC is a SKIP, "not exercised", named in the summary);
the KV layouts the handshake relies on, on CUDA tensors.

``--config`` takes the engine's kv-transfer config (as ``rdma-kv info``
does): the checks then run with that rank's UCX options, NICs and lanes.
Every group runs under a deadline (``--timeout``); its processes are
killed when it passes. ``--quick`` moves a few MiB per read (seconds).

Exit status: 0 when nothing FAILed (SKIPs included: the summary line names
a configured NIC that could not be exercised), 1 when a check FAILed, 2
when the arguments or the config are wrong, a --json path that cannot be
written included (nothing ran).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("selftest", help="check this host end to end: UCX, reads between two processes, CUDA, NICs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small reads, one repetition each (seconds)")
    p.add_argument("--json", metavar="PATH", help='also write {"checks": [...]} to PATH')
    p.add_argument("--config", metavar="JSON_OR_FILE",
                   help="the engine's kv-transfer config (JSON text or path): its UCX options, NICs, lanes")
    p.add_argument("--engine", choices=("auto", "vllm", "rdma-kv"), default="auto",
                   help="whose config --config is (as for rdma-kv info)")
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank whose settings to check (default 0)")
    p.add_argument("--tp-size", type=int, default=None,
                   help="tensor-parallel size (default: the ranks ucx_net_devices names, else rank + 1)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="deadline of each group of checks (default 60 with --quick, else 300; "
                   "per GPU for CUDA, per device for NICs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the block ids and data pattern (default 0)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rdma_kv.cli import check_output
    from rdma_kv.errors import ConfigError
    from rdma_kv.selftest import SelftestOptions, exit_status, render, run_selftest, summary, write_json

    if args.rank < 0 or (args.tp_size is not None and not 0 <= args.rank < args.tp_size):
        raise ConfigError(f"--rank {args.rank} must be in [0, --tp-size)")
    if args.timeout is not None and not 0 < args.timeout <= 86400:
        raise ConfigError(f"--timeout must be in (0, 86400] seconds, got {args.timeout}")
    check_output("--json", args.json)
    settings = None
    if args.config:
        from rdma_kv.cli.info import load_settings

        settings = load_settings(args.config, engine=args.engine, tp_rank=args.rank, tp_size=args.tp_size)
    options = SelftestOptions(quick=args.quick, settings=settings, deadline_s=args.timeout, seed=args.seed)
    checks = run_selftest(options, on_check=lambda check: print(render(check), flush=True))
    print(summary(checks))
    if args.json:
        write_json(checks, args.json)
        print(f"wrote {args.json}")
    return exit_status(checks)
