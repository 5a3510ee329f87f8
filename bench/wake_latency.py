"""What this machine charges to wake an idle CPU the way a lane is woken.

Builds ``bench/wake_latency.c`` with the system C compiler (``$CC``, else
``cc``) in a temporary directory and runs it: a sleeper thread blocked in
``epoll_wait`` on an eventfd (as a lane's progress thread sleeps on its
worker's event fd) is woken by an eventfd write from another CPU (as
``ucp_worker_signal`` does) after the poster has idled ``gap`` us. Prints,
per gap, the poster's write syscall and the write-to-wake-up delay
(p10 / median / p90, in microseconds).

    .venv/bin/python bench/wake_latency.py [--reps 201] [--gaps 100,1000,20000] [--json PATH]

On bare metal both are a few microseconds; on a microVM they can cost a
large share of a one-block transfer (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("wake_latency.c")


def compiler() -> str | None:
    """The C compiler to build the probe with: ``$CC``, else ``cc`` or ``gcc``."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(out_dir: str) -> str:
    """Compile the probe into ``out_dir``; returns the executable's path."""
    cc = compiler()
    if not cc:
        raise SystemExit("wake_latency: no C compiler (set CC or install gcc)")
    exe = os.path.join(out_dir, "wake_latency")
    proc = subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", str(SOURCE), "-o", exe],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"wake_latency: {cc} failed:\n{proc.stderr}")
    return exe


def run(reps: int, gaps: list[int]) -> dict[str, Any]:
    """Build and run the probe; its JSON report as a dict."""
    with tempfile.TemporaryDirectory(prefix="rdma-kv-wake-") as tmp:
        exe = build(tmp)
        # reps x (gap + wake) per gap, plus a 1 s bound per wake-up inside the probe
        budget = 30 + sum(reps * (g / 1e6 + 0.01) for g in gaps)
        proc = subprocess.run([exe, str(reps), *map(str, gaps)], capture_output=True, text=True,
                              timeout=budget)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr.strip() or f"wake_latency exited with {proc.returncode}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=201)
    ap.add_argument("--gaps", default="100,1000,20000", help="idle time before each wake-up, us (comma list)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = ap.parse_args(argv)
    try:
        gaps = [int(g) for g in args.gaps.split(",") if g.strip()]
    except ValueError:
        ap.error(f"--gaps must be a comma list of integers (microseconds), got {args.gaps!r}")
    report = run(args.reps, gaps)
    print(f"poster on CPU {report['poster_cpu']}, sleeper on CPU {report['sleeper_cpu']}, "
          f"{report['reps']} reps per gap; microseconds, p10 / median / p90")
    print(f"{'idle gap':>10}  {'eventfd write':>22}  {'write -> wake-up':>22}")
    for gap, r in report["gaps"].items():
        w, k = r["write_us"], r["wake_us"]
        print(f"{gap + ' us':>10}  {w['p10']:6.1f} {w['median']:6.1f} {w['p90']:6.1f}    "
              f"  {k['p10']:6.1f} {k['median']:6.1f} {k['p90']:6.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
