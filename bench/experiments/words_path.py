"""Where a held words' check spends its time: ``bench/connector_overhead.py``
run with the consumer's word path timed at each hop (it wraps private
methods of ``consumer.loads.RdmaConsumer`` and ``consumer.words.WordChecks``).

Hops, per load (medians): the data read's settling -> ``_check_words``
(the load's bookkeeping under the lock), -> ``WordChecks.check`` (the tag),
-> the words' read posted (unique ids, slots, zeroing, ``read_prepared``),
-> its completion callback (the wire and the wake), -> the load confirmed
(the compare and ``_on_words``). ``--spin-s`` makes the agents with that
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

HOPS = [("settled", "check_words"), ("check_words", "check"), ("check", "posted"), ("posted", "landed"),
        ("landed", "confirmed")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="tiny")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--spin-s", type=float, default=None)
    args = ap.parse_args()
    rows: list[dict[str, float]] = []
    now: dict[str, float] = {}
    on_read_done, check_words, check = (loads.RdmaConsumer._on_read_done, loads.RdmaConsumer._check_words,
                                        words.WordChecks.check)

    def timed_on_read_done(self: Any, *a: Any, **k: Any) -> Any:
        now["settled"] = time.perf_counter()
        return on_read_done(self, *a, **k)

    def timed_check_words(self: Any, *a: Any, **k: Any) -> Any:
        now["check_words"] = time.perf_counter()
        return check_words(self, *a, **k)

    def timed_check(self: Any, connection: Any, block_ids: Any, tag: bytes, timeout_s: float, done: Any) -> Any:
        now["check"] = time.perf_counter()

        def landed(ok: bool) -> None:
            now["landed"] = time.perf_counter()
            done(ok)
            now["confirmed"] = time.perf_counter()
            rows.append(dict(now))

        xfer = check(self, connection, block_ids, tag, timeout_s, landed)
        now["posted"] = time.perf_counter()
        return xfer

    loads.RdmaConsumer._on_read_done = timed_on_read_done  # type: ignore[method-assign]
    loads.RdmaConsumer._check_words = timed_check_words  # type: ignore[method-assign]
    words.WordChecks.check = timed_check  # type: ignore[method-assign]
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
