"""Fixed cost per transfer of ``Agent.read_prepared`` + ``wait``, stage by stage.

One 2 MiB block as the ``kv-one-block`` workload reads it: 64 descriptors of
32 KiB, random slots, a notification on every transfer. The target runs in
a child process (``progress="thread"``, as ``rdma-kv bench``'s target); the
reader polls (``progress="poll"``), as the bench's reader does. Before every
rep a 1 GiB buffer is overwritten, as the bench's ``local.fill(0)`` does
(``--warm`` skips it), so every stage runs with the caches cold.

Stages, timed with ``perf_counter_ns`` by wrapping the reader's parts (each
wrapper adds ~0.1 us): ``index`` (as_index of both index arrays), ``batch``
(new_batch), ``notif`` (set_notif), ``track`` (the Transfer and its
deadline), ``submit`` (rk_submit, the C post loop), ``posted`` (accounting),
``call`` (read_prepared from call to return, all of the above), ``wait``
(return to completion: the copy plus the wake-ups), ``total`` (call + wait).
Prints medians and p90 in microseconds; ``--json`` saves every rep.

    .venv/bin/python bench/experiments/fixed_cost.py [--reps 200] [--lanes 1,2]
        [--lane-min-bytes N] [--warm] [--bare] [--help-ab] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rdma_kv.transport import Agent, AgentConfig, DescList

SLOTS, SLOT_BYTES, DESCS = 64 * 512, 32768, 64
STAGES = ("index", "batch", "notif", "track", "submit", "posted", "call", "wait", "total")


def _slots(base: int) -> DescList:
    return DescList(np.uint64(base) + np.arange(SLOTS, dtype=np.uint64) * np.uint64(SLOT_BYTES), SLOT_BYTES)


def _target(conn: Any) -> None:
    with Agent("fc-target", AgentConfig(progress="thread", lanes=1)) as agent:
        buf = np.ones(SLOTS * SLOT_BYTES, dtype=np.uint8)
        agent.register(buf)
        conn.send((agent.metadata(), buf.ctypes.data))
        conn.recv()  # stop
        got = len(agent.get_notifications())
        conn.send(got)


class _Timed:
    """Forwards attribute access to ``inner``; ``name`` is timed into ``t``."""

    def __init__(self, inner: Any, names: dict[str, str], t: dict[str, int]) -> None:
        self._inner, self._names, self._t = inner, names, t

    def __getattr__(self, attr: str) -> Any:
        fn = getattr(self._inner, attr)
        stage = self._names.get(attr)
        if stage is None:
            return fn
        t = self._t

        def timed(*a: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a)
            finally:
                t[stage] = t.get(stage, 0) + time.perf_counter_ns() - t0

        return timed


def _wrap(obj: Any, attr: str, stage: str, t: dict[str, int]) -> None:
    fn: Callable[..., Any] = getattr(obj, attr)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            t[stage] = t.get(stage, 0) + time.perf_counter_ns() - t0

    setattr(obj, attr, timed)


def run(lanes: int, lane_min_bytes: int | None, reps: int, warm: bool, instrument: bool,
        help_lanes: bool = True) -> list[dict[str, int]]:
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_target, args=(child,), daemon=True)
    proc.start()
    config = AgentConfig(progress="poll", lanes=lanes)
    if lane_min_bytes is not None:
        config = dataclasses.replace(config, lane_min_bytes=lane_min_bytes)
    rows: list[dict[str, int]] = []
    try:
        md, addr = parent.recv()
        with Agent("fc-reader", config) as reader:
            dst = np.zeros(SLOTS * SLOT_BYTES, dtype=np.uint8)
            reader.register(dst)
            peer = reader.add_peer(md)
            if not help_lanes:  # the poller waits for the lanes' pumps (as before rk_pump_help)
                reader._completions.helpers = ()
            local, remote = reader.prep_local(_slots(dst.ctypes.data)), reader.prep_remote(peer, _slots(addr))
            one = np.zeros(1, dtype=np.int64)
            reader.read_prepared(local, one, remote, one, notify=b"w").wait(10)  # wire-up, untimed
            t: dict[str, int] = {}
            if instrument:
                routes, comp = reader._routes, reader._completions
                for attr, stage in (("new_batch", "batch"), ("set_notif", "notif"), ("track", "track"),
                                    ("posted", "posted")):
                    _wrap(comp, attr, stage, t)
                routes._lib = _Timed(routes._lib, {"rk_submit": "submit"}, t)
                import rdma_kv.transport.prepared as prepared
                orig_as_index = prepared.as_index
                _wrap(prepared, "as_index", "index", t)
            sweep = np.zeros(1 << 30, dtype=np.uint8)
            rng = np.random.default_rng(0)
            for rep in range(reps):
                li = rng.choice(SLOTS, DESCS, replace=False).astype(np.int64)
                ri = rng.choice(SLOTS, DESCS, replace=False).astype(np.int64)
                if not warm:
                    sweep.fill(rep & 0xFF)
                t.clear()
                t0 = time.perf_counter_ns()
                xfer = reader.read_prepared(local, li, remote, ri, notify=b"rep%d" % rep)
                t1 = time.perf_counter_ns()
                xfer.wait(10)
                t2 = time.perf_counter_ns()
                row = dict(t, call=t1 - t0, wait=t2 - t1, total=t2 - t0, ops=xfer.ops_posted,
                           parts=len(xfer.worker_ops or (0,)))
                rows.append(row)
                first = dst[li[0] * SLOT_BYTES:(li[0] + 1) * SLOT_BYTES]
                if not (first == 1).all():  # spot check: the target's bytes are all ones
                    raise SystemExit("data check failed")
                first[:] = 0
            if instrument:
                prepared.as_index = orig_as_index
            parent.send("stop")
            got = parent.recv()
            if got < reps:  # (the wire-up's notification counts too)
                raise SystemExit(f"target got {got} notifications for {reps} reps")
    finally:
        proc.join(10)
    return rows


def _summary(rows: list[dict[str, int]]) -> dict[str, tuple[float, float]]:
    out = {}
    for s in STAGES:
        vals = sorted(r[s] / 1000 for r in rows if s in r)
        if vals:
            out[s] = (statistics.median(vals), vals[int(0.9 * (len(vals) - 1))])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--lanes", default="1,2", help="comma list; each is one run, alternating --rounds times")
    ap.add_argument("--lane-min-bytes", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="do not sweep the caches between reps")
    ap.add_argument("--bare", action="store_true", help="no stage timers: call / wait / total only")
    ap.add_argument("--help-ab", action="store_true",
                    help="each lanes value twice: the poller helping idle lanes (help) and not (nohelp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict[str, list[dict[str, int]]] = {}
    for _ in range(args.rounds):
        for lanes in (int(x) for x in args.lanes.split(",")):
            for help_lanes in ((True, False) if args.help_ab and lanes > 1 else (True,)):
                tag = "" if not args.help_ab or lanes == 1 else "/help" if help_lanes else "/nohelp"
                key = f"lanes={lanes}{tag}"
                results.setdefault(key, []).extend(
                    run(lanes, args.lane_min_bytes, args.reps, args.warm, not args.bare, help_lanes))
    print(f"{'config':14} {'parts':>5} " + " ".join(f"{s:>13}" for s in STAGES))
    for key, rows in results.items():
        summ = _summary(rows)
        parts = statistics.median(r["parts"] for r in rows)
        print(f"{key:14} {parts:>5.0f} " + " ".join(
            f"{summ[s][0]:>6.1f}/{summ[s][1]:<6.1f}" if s in summ else f"{'-':>13}" for s in STAGES))
    print("us, median/p90 per stage;", "warm" if args.warm else "caches swept (1 GiB) before every rep")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f)


if __name__ == "__main__":
    main()
