"""The connector's own per-request cost: a load through RdmaKVConnector
against the raw transport's read of the same blocks, stage by stage.

Two harness engines in this process (a producer and a decode, the
connector as shipped: its default settings, UCX loopback between their
agents). Per geometry, every repetition prefills one ``--tokens`` prompt on
the producer, then, in alternating order:

- **connector**: the decode loads it (admission -> the worker reports it
  in ``get_finished``), stepping back to back as vLLM's engine does while
  requests wait for remote KV (``--idle-s``: a sleep between steps); its
  ``LoadRecord`` (``get_kv_connector_stats``) gives the stages:
  ``start_s`` (the step's metadata bound -> first read posted; ``plan_s``
  in it), ``transfer_s`` (posted -> last read completed, with the held
  words' read chained behind the data; ``post_s`` in it), ``finish_s``
  (completed -> reported; ``confirm_s`` in it: the check of the held
  words, the wait for the read pin's answer, or the CONFIRM round trip)
  and ``total_s``;
- **raw**: ``Agent.read_prepared`` of the same producer blocks, on the
  same two agents (the connector's, kept by the transport factory) and
  over the same endpoint, with ``wait()``: call -> completion.

Reports per geometry the medians of each stage, ``total_s`` / raw (the
issue's bar: at most 1.2), the connector's transfer alone / raw, ops
posted by each, and the load average before and after.

Geometries (vLLM's CPU layout, one allocation, ``[blocks, heads, block,
2 x head]`` per layer): ``tiny``, the vLLM tests' model (2 layers, 2 KV
heads, head 32, block 32, fp32: 16 KiB per layer per block); ``8b``, a
Llama-3-8B-like one (32 layers, 8 KV heads, head 128, block 16, fp16:
64 KiB per layer per block).

``--held-words off`` runs both engines with ``held_words: false`` (the
producer publishes no held words, so the decode pins its reads, as before
protocol 12); ``--read-pin off`` runs the decode with ``read_pin: false``
(then, without held words, a CONFIRM after every read, as before protocol
7): A/Bs against the default.

    .venv/bin/python bench/connector_overhead.py [--reps 30] [--geometry tiny,8b] [--tokens 128]
        [--held-words on|off] [--read-pin on|off] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rdma_kv.connector import KVRole, KVTransferConfig
from rdma_kv.connector.rdma import RdmaSettings, RemotePrefillParams, agent_transport, parse_kv_transfer_params
from rdma_kv.connector.rdma.stats import LoadRecord
from rdma_kv.connector.rdma.statsparse import parse_worker_stats
from rdma_kv.harness.engine import Engine, ModelShape
from rdma_kv.transport import Agent, DescList, PreparedList

GEOMETRIES = {
    "tiny": ModelShape(num_layers=2, num_kv_heads=2, head_size=32, block_size=32, num_blocks=256,
                       dtype="float32"),
    "8b": ModelShape(num_layers=32, num_kv_heads=8, head_size=128, block_size=16, num_blocks=256,
                     dtype="float16"),
}
STAGES = ("start_s", "plan_s", "transfer_s", "post_s", "finish_s", "confirm_s", "total_s")


def config(role: KVRole, engine_id: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_connector_extra_config=extra)


class Raw:
    """``read_prepared`` of whole (layer, block) slots between the two
    engines' KV caches, on the decode's agent and its endpoint to the producer."""

    def __init__(self, reader: Agent, P: Engine, D: Engine) -> None:
        (peer,) = reader.peers
        self.reader, self.shape = reader, P.shape
        self.local: PreparedList = reader.prep_local(self._slots(D))
        self.remote: PreparedList = reader.prep_remote(peer, self._slots(P))

    def _slots(self, engine: Engine) -> DescList:
        shape = engine.shape
        nbytes = shape.block_nbytes // shape.num_layers  # one layer's block: contiguous in the CPU layout
        count = shape.num_layers * shape.num_blocks
        return DescList.slots(engine.kv.data_ptr(), count, nbytes)

    def read(self, block_ids: list[int]) -> tuple[float, int]:
        """Read the producer's ``block_ids`` into the same ids of the decode:
        (seconds from the call to completion, ops posted)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        index = (np.arange(self.shape.num_layers, dtype=np.int64)[:, None] * self.shape.num_blocks
                 + ids[None, :]).ravel()
        t0 = time.perf_counter()
        xfer = self.reader.read_prepared(self.local, index, self.remote, index, timeout_s=30.0)
        xfer.wait(30.0)
        return time.perf_counter() - t0, xfer.ops_posted


def run_geometry(name: str, shape: ModelShape, tokens: int, reps: int, idle_s: float,
                 seed: int, read_pin: bool = True, held_words: bool = True) -> dict[str, Any]:
    agents: dict[str, Agent] = {}

    def keep(agent_name: str, settings: RdmaSettings) -> Any:
        transport = agent_transport(agent_name, settings)
        assert isinstance(transport, Agent)
        agents[agent_name] = transport
        return transport

    kw = {"transport_factory": keep}
    P = Engine(config(KVRole.PRODUCER, f"ovh-{name}-P", held_words=held_words), shape, connector_kwargs=kw,
               fill=False, verify=False)
    D = Engine(config(KVRole.CONSUMER, f"ovh-{name}-D", read_pin=read_pin, held_words=held_words), shape,
               connector_kwargs=kw, fill=False, verify=False)
    rng = np.random.default_rng(seed)
    rows: list[dict[str, float]] = []
    raw: Raw | None = None
    try:
        for rep in range(reps + 1):  # rep 0: warm-up (the handshake, first touch), not reported
            rid = f"{name}-{rep}"
            prompt = rng.integers(1, 30000, tokens).tolist()
            P.add_request(rid, prompt, {"do_remote_decode": True})
            P.run(until=lambda: rid in P.results and P.results[rid].status.value == "finished", timeout_s=60)
            params = P.results[rid].kv_transfer_params
            assert params is not None
            P.step()  # ships the lease grant to the producer's worker, as its next step would
            parsed = parse_kv_transfer_params(params)
            assert isinstance(parsed, RemotePrefillParams)
            block_ids = [int(b) for b in parsed.remote_block_ids[0]]

            def connector() -> LoadRecord:
                D.add_request(rid, prompt, params)
                step_until(D, lambda: D.results[rid].status.value == "finished", idle_s)
                stats = D.worker.get_kv_connector_stats()
                assert stats is not None
                (rec,) = [r for r in parse_worker_stats(stats).requests if r.request_id == rid]
                if not rec.ok or D.results[rid].load_failed:
                    raise RuntimeError(f"load {rid} failed: {rec.error}")
                return rec

            if raw is None:
                rec = connector()  # the handshake happens here; the raw path then uses its endpoint
                (reader,) = [a for n, a in agents.items() if n.startswith(f"ovh-{name}-D")]
                raw = Raw(reader, P, D)
                raw_s, raw_ops = raw.read(block_ids)
            elif rep % 2:
                raw_s, raw_ops = raw.read(block_ids)
                rec = connector()
            else:
                rec = connector()
                raw_s, raw_ops = raw.read(block_ids)
            P.run(until=lambda: not P.held, timeout_s=30)  # the lease released, the blocks freed
            if rep == 0:
                continue
            row = {k: float(getattr(rec, k) or 0.0) for k in STAGES}
            row.update(raw_s=raw_s, raw_ops=raw_ops, ops=float(rec.ops_posted or 0), nbytes=float(rec.nbytes or 0))
            rows.append(row)
    finally:
        P.shutdown()
        D.shutdown()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["wait_s"] = statistics.median(r["finish_s"] - r["confirm_s"] for r in rows)
    ratios = [r["total_s"] / r["raw_s"] for r in rows]
    return {"geometry": name, "read_pin": read_pin, "held_words": held_words, "shape": shape.__dict__,
            "tokens": tokens,
            "blocks": -(-tokens // shape.block_size),
            "reps": reps, "medians": med, "ratio_total_raw": med["total_s"] / med["raw_s"],
            "ratio_transfer_raw": med["transfer_s"] / med["raw_s"],
            "ratio_per_rep_p50": statistics.median(ratios),
            "ratio_per_rep_p10_p90": [float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))],
            "rows": rows}


def step_until(engine: Engine, done: Callable[[], bool], idle_s: float, timeout_s: float = 60.0) -> None:
    """Step ``engine`` until ``done()``; ``idle_s`` between steps (0: back to
    back, yielding the GIL, as vLLM's engine loop steps while requests wait)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done after {timeout_s} s: {engine.describe()}")
        engine.step()
        time.sleep(idle_s)


def report(result: dict[str, Any]) -> str:
    m, us = result["medians"], 1e6
    mib = m["nbytes"] / 2**20
    lines = [
        f"{result['geometry']} (held words {'on' if result.get('held_words', False) else 'off'}, "
        f"read pin {'on' if result['read_pin'] else 'off'}): {result['tokens']} tokens = "
        f"{result['blocks']} blocks, {mib:.3g} MiB; "
        f"{result['reps']} reps, medians in us",
        f"  raw read_prepared + wait     {m['raw_s'] * us:9.1f}   ({m['raw_ops']:.0f} ops, "
        f"{m['nbytes'] / m['raw_s'] / 1e9:.2f} GB/s)",
        f"  connector (bind -> reported) {m['total_s'] * us:9.1f}   "
        f"x{result['ratio_total_raw']:.2f} raw (per rep p50 x{result['ratio_per_rep_p50']:.2f}, "
        f"p10-p90 x{result['ratio_per_rep_p10_p90'][0]:.2f}-{result['ratio_per_rep_p10_p90'][1]:.2f})",
        f"    start  (bind -> post)      {m['start_s'] * us:9.1f}   (plan {m['plan_s'] * us:.1f})",
        f"    transfer (post -> done)    {m['transfer_s'] * us:9.1f}   (post loop {m['post_s'] * us:.1f}; "
        f"x{result['ratio_transfer_raw']:.2f} raw; {m['ops']:.0f} ops)",
        f"    finish (done -> reported)  {m['finish_s'] * us:9.1f}   (words, pin or CONFIRM {m['confirm_s'] * us:.1f}, "
        f"the rest {m['wait_s'] * us:.1f})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--geometry", default="tiny,8b", help=f"comma list of {sorted(GEOMETRIES)}")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--idle-s", type=float, default=0.0, help="sleep between the decode's steps (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--read-pin", choices=("on", "off"), default="on",
                    help="the decode's read_pin (default on, as shipped; off: CONFIRM after every read)")
    ap.add_argument("--held-words", choices=("on", "off"), default="on",
                    help="both engines' held_words (default on, as shipped; off: the decode pins, or CONFIRMs)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    names = geometry_names(ap, args.geometry, GEOMETRIES)
    run_and_report(lambda g: run_geometry(g, GEOMETRIES[g], args.tokens, args.reps, args.idle_s, args.seed,
                                          read_pin=args.read_pin == "on", held_words=args.held_words == "on"),
                   names, report, args.json, idle_s=args.idle_s)
    return 0


def geometry_names(ap: argparse.ArgumentParser, text: str, geometries: dict[str, ModelShape]) -> list[str]:
    """``--geometry``'s comma list, each one of ``geometries`` (else the parser's error)."""
    names = [g for g in text.split(",") if g]
    unknown = sorted(set(names) - set(geometries))
    if unknown:
        ap.error(f"unknown geometry {unknown}; valid: {sorted(geometries)}")
    return names


def run_and_report(run: Callable[[str], dict[str, Any]], names: list[str], report: Callable[[dict[str, Any]], str],
                   json_path: str | None, **extra: Any) -> None:
    """``run`` each geometry of ``names``, print each ``report`` and the load
    average before and after, and write the results to ``json_path`` (with
    the command line, the load average and ``extra``)."""
    load_before = os.getloadavg()
    results = [run(g) for g in names]
    load_after = os.getloadavg()
    for result in results:
        print(report(result))
    print(f"load average: {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"argv": sys.argv[1:], "load_average": {"before": load_before, "after": load_after},
                       **extra, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
