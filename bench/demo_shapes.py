"""The demo's reads against the transport alone moving the same loads.

Issue 29 asks that the demo's reads, post to completion, reach 0.8x "the
transport bench's GB/s for the same shapes" (p10 0.5x). This makes that
denominator. Per round, in turn:

- **demo**: ``rdma-kv demo --seed S -v`` (two harness engines, the
  connector as shipped); from its table, each load's blocks and its
  transfer time (``transfer_s``: first read posted -> last read completed,
  as the transport's shim saw it).
- **replay**: the same loads, in the same order, read by the transport
  alone: a target process registers a KV cache of the demo's shape (vLLM's
  CPU layout, ``--layers`` regions of ``--num-blocks`` blocks of
  ``--block-bytes`` each, one allocation) and fills it; the reader (an
  ``Agent`` as the connector makes it: ``progress="thread"``, default
  lanes) posts one ``read_prepared`` per load (every layer of its blocks,
  contiguous block ids, as the demo's fresh allocations are) and takes
  each load's ``Transfer.elapsed_s``, the same span. Two replays: one load
  at a time (``c1``: the shape's own speed) and ``--concurrency`` loads in
  flight, a new one posted as one completes (``cN``: as many as the demo
  lets run at once, the most its loads can share the copy with).

Per side: per-load GB/s median and p10, and the demo's aggregate (bytes /
summed transfer time); for a replay also its wall GB/s (bytes / first post
to last completion: what the copy moved while loads shared it); the
ratios demo / replay. Every replayed byte is checked at the end of each
replay (the last load written to each block). ``--express`` turns on
express endpoints on both sides (the connector's ``express`` setting in
the demo, ``AgentConfig.express`` in the replay).

    .venv/bin/python bench/demo_shapes.py [--rounds 3] [--seed 1] [--concurrency 8] [--json OUT]
        [--requests 48] [--max-tokens 1500] [--layers 8] [--num-blocks 1024] [--block-bytes 65536]
        [--express]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import queue
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROW = re.compile(r"^\s*(req-\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+ok$")
WAIT_S = 60.0


def run_demo(python: str, demo_args: list[str]) -> dict[str, Any]:
    """One demo run: its loads (blocks, bytes, transfer seconds) in request order."""
    proc = subprocess.run([python, "-m", "rdma_kv", "demo", "-v", *demo_args],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the demo failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    loads = []
    for line in proc.stdout.splitlines():
        m = ROW.match(line)
        if m and int(m.group(5)) > 0:
            blocks, mib, xfer_ms = int(m.group(5)), float(m.group(7)), float(m.group(9))
            loads.append({"request": m.group(1), "blocks": blocks, "nbytes": int(mib * 2**20),
                          "transfer_s": xfer_ms / 1e3})
    if not loads:
        raise SystemExit("no loads in the demo's table (did its format change?)")
    return {"loads": loads, "summary": [ln for ln in proc.stdout.splitlines() if ln.startswith(("transfer", "load"))]}


def _pattern(layers: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    rng = np.random.default_rng(20261128)
    return rng.integers(0, 255, layers * num_blocks * block_bytes, dtype=np.uint8)


def _target(conn: Any, layers: int, num_blocks: int, block_bytes: int) -> None:
    from rdma_kv.transport import Agent

    agent = Agent("demo-shapes-target")
    buf = _pattern(layers, num_blocks, block_bytes)
    agent.register(buf)
    conn.send((buf.ctypes.data, agent.metadata()))
    conn.recv()  # close
    agent.close()


def _put(done: queue.Queue[tuple[int, Any]], i: int, xfer: Any) -> None:
    done.put((i, xfer))


class Replay:
    """A reader connected to a target process that holds the demo-shaped KV cache."""

    def __init__(self, layers: int, num_blocks: int, block_bytes: int, express: bool = False) -> None:
        from rdma_kv.transport import Agent, AgentConfig, DescList

        self.layers, self.num_blocks, self.block_bytes = layers, num_blocks, block_bytes
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target, args=(child, layers, num_blocks, block_bytes), daemon=True)
        self._proc.start()
        if not self._conn.poll(120):
            raise SystemExit("the replay's target did not start within 120 s")
        address, meta = self._conn.recv()
        # As the connector makes it: progress="thread", default lanes (and its express setting).
        self.agent = Agent("demo-shapes-reader", AgentConfig(express=express))
        self.local = np.zeros(layers * num_blocks * block_bytes, dtype=np.uint8)
        self.agent.register(self.local)
        peer = self.agent.add_peer(meta)
        offsets = np.arange(layers * num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
        self.lprep = self.agent.prep_local(DescList.from_regions(self.local.ctypes.data, offsets, block_bytes))
        self.rprep = self.agent.prep_remote(peer, DescList.from_regions(address, offsets, block_bytes))
        zero = np.zeros(1, dtype=np.int64)
        self.agent.read_prepared(self.lprep, zero, self.rprep, zero).wait(WAIT_S)  # wire-up, untimed

    def _ids(self, start: int, blocks: int) -> np.ndarray:
        """Every layer of blocks start .. start + blocks - 1 (layer-major, as the connector orders them)."""
        b = (np.arange(blocks, dtype=np.int64) + start) % self.num_blocks
        return (np.arange(self.layers, dtype=np.int64)[:, None] * self.num_blocks + b[None, :]).ravel()

    def run(self, loads: list[dict[str, Any]], concurrency: int) -> list[float]:
        """Each load's transfer seconds, ``concurrency`` in flight; checks every byte after."""
        self.local.fill(0)
        self.span_s = 0.0
        done: queue.Queue[tuple[int, Any]] = queue.Queue()
        times: list[float] = [0.0] * len(loads)
        nxt = start = inflight = 0
        first, last = time.perf_counter(), 0.0
        while nxt < len(loads) or inflight:
            while nxt < len(loads) and inflight < concurrency:
                ids = self._ids(start, loads[nxt]["blocks"])
                start += loads[nxt]["blocks"]
                xfer = self.agent.read_prepared(self.lprep, ids, self.rprep, ids, timeout_s=WAIT_S)
                xfer.add_done_callback(functools.partial(_put, done, nxt))
                nxt += 1
                inflight += 1
            i, x = done.get(timeout=WAIT_S)
            x.wait(0)  # raises if it failed
            times[i] = x.elapsed_s
            last = max(last, x.finished)
            inflight -= 1
        self.span_s = last - first
        want = _pattern(self.layers, self.num_blocks, self.block_bytes).reshape(-1, self.block_bytes)
        got = self.local.reshape(-1, self.block_bytes)
        touched = self._ids(0, min(start, self.num_blocks))  # every block some load wrote (start: blocks posted)
        if not np.array_equal(got[touched], want[touched]):
            raise SystemExit("replay: some block holds the wrong bytes")
        return times

    def close(self) -> None:
        self.agent.close()
        self._conn.send("close")
        self._proc.join(30)


def _stats(loads: list[dict[str, Any]], times: list[float]) -> dict[str, float]:
    gbps = [ld["nbytes"] / t / 1e9 for ld, t in zip(loads, times) if t > 0]
    return {"median_gbps": statistics.median(gbps),
            "p10_gbps": float(np.percentile(gbps, 10)),
            "aggregate_gbps": sum(ld["nbytes"] for ld in loads) / sum(times) / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="the demo's request stream (default 1)")
    p.add_argument("--concurrency", type=int, default=8, help="the demo's requests in flight (default 8)")
    p.add_argument("--layers", type=int, default=8, help="the demo's model: layers (default 8)")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--block-bytes", type=int, default=64 << 10,
                   help="one layer's share of a block (default 64 KiB: 8 KV heads x 128 x block 16, fp16, K and V)")
    p.add_argument("--requests", type=int, default=48, help="the demo's requests (default 48)")
    p.add_argument("--max-tokens", type=int, default=1500, help="the demo's longest prompt (default 1500)")
    p.add_argument("--express", action="store_true",
                   help="express endpoints on both sides: the demo's connector setting and the replay's AgentConfig")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    demo_args = ["--seed", str(args.seed), "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                 "--max-tokens", str(args.max_tokens), "--layers", str(args.layers),
                 "--num-blocks", str(args.num_blocks)]
    if args.express:
        demo_args += ["--extra-config", json.dumps({"express": True})]
    python = sys.executable
    rows = []
    replay = Replay(args.layers, args.num_blocks, args.block_bytes, args.express)
    try:
        for r in range(args.rounds):
            load0 = os.getloadavg()[0]
            demo = run_demo(python, demo_args)
            loads = demo["loads"]
            for ld in loads:  # the replay moves exactly the demo's bytes
                if ld["nbytes"] != ld["blocks"] * args.layers * args.block_bytes:
                    raise SystemExit(f"{ld['request']}: the demo moved {ld['nbytes']} bytes in {ld['blocks']} "
                                     f"blocks, not {args.layers} x {args.block_bytes} per block: pass its shape")
            demo_stats = _stats(loads, [ld["transfer_s"] for ld in loads])
            c1 = _stats(loads, replay.run(loads, 1))
            c1["wall_gbps"] = sum(ld["nbytes"] for ld in loads) / replay.span_s / 1e9
            cn = _stats(loads, replay.run(loads, args.concurrency))
            cn["wall_gbps"] = sum(ld["nbytes"] for ld in loads) / replay.span_s / 1e9
            row = {"round": r + 1, "loads": len(loads), "mib": sum(ld["nbytes"] for ld in loads) / 2**20,
                   "demo": demo_stats, "replay_c1": c1, f"replay_c{args.concurrency}": cn,
                   "load_avg": (load0, os.getloadavg()[0]), "demo_summary": demo["summary"]}
            rows.append(row)
            print(f"round {r + 1} ({len(loads)} loads, {row['mib']:.0f} MiB, load {load0:.1f}-{os.getloadavg()[0]:.1f})")
            for name, st in (("demo", demo_stats), ("replay c1", c1), (f"replay c{args.concurrency}", cn)):
                print(f"  {name:<12} per load GB/s median {st['median_gbps']:5.2f}  p10 {st['p10_gbps']:5.2f}"
                      f"  aggregate {st['aggregate_gbps']:5.2f}"
                      + (f"  wall {st['wall_gbps']:5.2f}" if "wall_gbps" in st else ""))
            for name, st in (("c1", c1), (f"c{args.concurrency}", cn)):
                print(f"  demo / replay {name:<4} median x{demo_stats['median_gbps'] / st['median_gbps']:.2f}"
                      f"  p10 x{demo_stats['p10_gbps'] / st['p10_gbps']:.2f}"
                      f"  aggregate x{demo_stats['aggregate_gbps'] / st['aggregate_gbps']:.2f}")
    finally:
        replay.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
    main()
