"""Where a held words' check spends its time: ``bench/connector_overhead.py``
run with the consumer's word path timed at each hop (it wraps private
methods of ``consumer.loads.RdmaConsumer`` and ``consumer.words.WordChecks``).

Since the words' read is chained behind the data in the shim (2026-12-02),
a load's check has three hops in Python, medians per load: its words
prepared (``WordChecks.prepare``: unique ids, slots, zeroing, the chained
read's lists) before the post; then, after the shim completed the data
and the words' read behind it (``Transfer.finished``), -> the completion
callback (the wake and the settle), -> the load confirmed (the compare and
``_vouch``). ``--spin-s`` makes the agents with that
``AgentConfig.spin_s`` (the pumps' spin after their last event) instead of
the default, to A/B it.

    PYTHONPATH=src .venv/bin/python bench/experiments/words_path.py [--geometry tiny] [--reps 60] [--spin-s S]
"""

from __future__ import annotations

import argparse
import pathlib
import runpy
import statistics
import sys
import time
from typing import Any

from rdma_kv.connector.rdma.consumer import loads, words

HOPS = [("prepare", "prepared"), ("finished", "settled"), ("settled", "confirmed")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="tiny")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--spin-s", type=float, default=None)
    args = ap.parse_args()
    rows: list[dict[str, float]] = []
    prep: dict[str, float] = {}
    on_read_done, prepare = loads.RdmaConsumer._on_read_done, words.WordChecks.prepare

    def timed_prepare(self: Any, *a: Any, **k: Any) -> Any:
        prep["prepare"] = time.perf_counter()
        check = prepare(self, *a, **k)
        prep["prepared"] = time.perf_counter()
        return check

    def timed_on_read_done(self: Any, load: Any, src: Any, peer: Any, xfer: Any) -> Any:
        row = dict(prep, settled=time.perf_counter())
        chained = src.words is not None
        out = on_read_done(self, load, src, peer, xfer)
        if chained and xfer.finished is not None:
            rows.append(dict(row, finished=xfer.finished, confirmed=time.perf_counter()))
        return out

    loads.RdmaConsumer._on_read_done = timed_on_read_done  # type: ignore[method-assign]
    words.WordChecks.prepare = timed_prepare  # type: ignore[method-assign]
    if args.spin_s is not None:
        import rdma_kv.connector.rdma as rdma
        from rdma_kv.transport import Agent, AgentConfig

        def agent_transport(name: str, settings: Any) -> Any:
            return Agent(name, AgentConfig(progress="thread", ucx_options=dict(settings.ucx_options),
                                           transfer_timeout_s=settings.read_timeout_s, lanes=settings.lanes,
                                           express=settings.express, spin_s=args.spin_s))

        rdma.agent_transport = agent_transport  # type: ignore[assignment]
    sys.argv = ["connector_overhead.py", "--reps", str(args.reps), "--geometry", args.geometry]
    try:
        runpy.run_path(str(pathlib.Path(__file__).parents[1] / "connector_overhead.py"), run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise
    for a, b in HOPS:
        spans = [(r[b] - r[a]) * 1e6 for r in rows if a in r and b in r]
        print(f"  {a:>11} -> {b:<11} {statistics.median(spans):7.1f} us (n={len(spans)})")


if __name__ == "__main__":
    main()
