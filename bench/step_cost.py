"""The engine thread's time in the connector per load, many loads at once.

vLLM calls the connector on its engine-core thread: the scheduler's hooks
as it schedules (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``) and the worker's
as it runs the step (``bind_connector_metadata``, ``start_load_kv``,
``get_finished``). While the connector runs, the engine computes nothing:
its time per load is what many concurrent requests cost the engine's step,
whatever the transfers themselves take.

Two harness engines in this process (a producer and a decode, the
connector as shipped, UCX loopback between their agents). Per geometry and
batch size ``N``: the producer prefills ``N`` prompts of ``--tokens``; the
decode admits the ``N`` loads in one step and steps back to back until
every one is reported (vLLM's loop while requests wait for remote KV).
Every connector hook the decode calls is timed on the engine's thread in
CPU time (``time.thread_time``: what the engine thread spent in the
connector; a thread blocked, in a wait or for the interpreter lock,
spends none). Reported per load (medians over ``--reps``):

- **the admitting step**: the scheduler's hooks and the worker's up to
  its ``get_finished`` (``start_load_kv`` plans every load and posts its
  reads), their CPU time over the step divided by ``N``; and the step's
  ``start_load_kv``
  wall time (the interpreter lock's waits included: completion callbacks
  of the first loads run on the transport's thread while it posts);
- **after it**, until every load is reported (the admitting step's
  ``get_finished`` included): the hooks' CPU time per load, of it
  ``get_finished`` (in an idle step, with ``idle_wait_s`` as
  shipped, it waits for the loads in flight and may copy for a lane that
  has no CPU: work the transfer needs, not overhead), the steps taken,
  and the wall time from admission to the last report.

    .venv/bin/python bench/step_cost.py [--batch 1,16,64] [--geometry tiny,8b] [--tokens 128] [--reps 10]
        [--idle-wait-s 0.002] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import connector_overhead  # (bench/, beside this file: its geometries and its command line's ending)
from rdma_kv.connector import KVRole, KVTransferConfig
from rdma_kv.harness.engine import Engine

GEOMETRIES = {name: dataclasses.replace(shape, num_blocks=600)  # room for 64 prompts of 128 tokens
              for name, shape in connector_overhead.GEOMETRIES.items()}
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished")
WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                "get_block_ids_with_load_errors", "clear_connector_metadata")


def config(role: KVRole, engine_id: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_connector_extra_config=extra)


class Timed:
    """Times the named methods of ``target`` (bound methods replaced on the
    instance, so only this engine's connector is timed): CPU seconds of the
    calling thread per hook since the last :meth:`take`, and the last
    call's wall seconds of each."""

    def __init__(self, target: Any, hooks: tuple[str, ...]) -> None:
        self.spent: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.last: dict[str, float] = {}
        for name in hooks:
            setattr(target, name, self._timed(name, getattr(target, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[name] += time.thread_time() - c0
                self.last[name] = time.perf_counter() - t0
        return call

    def take(self) -> collections.defaultdict[str, float]:
        spent, self.spent = self.spent, collections.defaultdict(float)
        return spent


def merged(*spent: dict[str, float]) -> collections.defaultdict[str, float]:
    out: collections.defaultdict[str, float] = collections.defaultdict(float)
    for one in spent:
        for hook, seconds in one.items():
            out[hook] += seconds
    return out


def run_batch(P: Engine, D: Engine, timers: list[Timed], n: int, tokens: int, rng: np.random.Generator,
              tag: str) -> dict[str, float]:
    rids = [f"{tag}-{i}" for i in range(n)]
    prompts = [rng.integers(1, 30000, tokens).tolist() for _ in rids]
    for rid, prompt in zip(rids, prompts):
        P.add_request(rid, prompt, {"do_remote_decode": True})
    P.run(until=lambda: all(rid in P.results and P.results[rid].status.value == "finished" for rid in rids),
          timeout_s=120)
    P.step()  # ships the lease grants to the producer's worker, as its next step would
    params = [P.results[rid].kv_transfer_params for rid in rids]
    for timer in timers:
        timer.take()
    t0 = time.perf_counter()
    for rid, prompt, p in zip(rids, prompts, params):
        D.add_request(rid, prompt, p)
    D.step()  # the admitting step: every load planned and its reads posted
    posting = timers[1].last["start_load_kv"]
    admit = merged(timers[0].take(), timers[1].take())
    waited = {"get_finished": admit.pop("get_finished", 0.0)}  # (counted after: it waits)
    steps, deadline = 0, time.monotonic() + 120
    while not all(D.results[rid].status.value == "finished" for rid in rids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"loads not done after 120 s: {D.describe()}")
        D.step()
        steps += 1
    wall = time.perf_counter() - t0
    failed = [rid for rid in rids if D.results[rid].load_failed]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} loads failed: {failed[:4]}")
    after = merged(timers[0].take(), timers[1].take(), waited)
    P.run(until=lambda: not P.held, timeout_s=60)  # the leases released, the blocks freed
    for rid in rids:  # the decode's blocks back to its pool for the next batch
        D.requests.pop(rid, None)
    row = {f"{hook}_us": admit[hook] / n * 1e6 for hook in SCHEDULER_HOOKS + WORKER_HOOKS}
    row["admit_scheduler_us"] = sum(admit[h] for h in SCHEDULER_HOOKS) / n * 1e6
    row["admit_worker_us"] = sum(admit[h] for h in WORKER_HOOKS) / n * 1e6
    row["admit_us"] = row["admit_scheduler_us"] + row["admit_worker_us"]
    row["posting_step_us"] = posting * 1e6
    row["after_us"] = sum(after.values()) / n * 1e6
    row["after_get_finished_us"] = after["get_finished"] / n * 1e6
    row["after_steps"] = steps
    row["wall_ms"] = wall * 1e3
    return row


def run_geometry(name: str, batches: list[int], tokens: int, reps: int, seed: int,
                 idle_wait_s: float = 0.002) -> dict[str, Any]:
    shape = GEOMETRIES[name]
    need = max(batches) * -(-tokens // shape.block_size)
    if need > shape.num_blocks:
        raise SystemExit(f"{max(batches)} prompts of {tokens} tokens need {need} blocks; {name} has "
                         f"{shape.num_blocks}: lower --batch or --tokens")
    P = Engine(config(KVRole.PRODUCER, f"step-{name}-P"), shape, fill=False, verify=False)
    D = Engine(config(KVRole.CONSUMER, f"step-{name}-D", idle_wait_s=idle_wait_s), shape, fill=False, verify=False)
    timers = [Timed(D.scheduler, SCHEDULER_HOOKS), Timed(D.worker, WORKER_HOOKS)]
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"geometry": name, "tokens": tokens, "reps": reps, "idle_wait_s": idle_wait_s,
                           "batches": {}}
    try:
        run_batch(P, D, timers, 2, tokens, rng, f"{name}-warm")  # the handshake, first touch
        for n in batches:
            rows = [run_batch(P, D, timers, n, tokens, rng, f"{name}-{n}-{rep}") for rep in range(reps)]
            out["batches"][str(n)] = {"medians": {k: statistics.median(r[k] for r in rows) for k in rows[0]},
                                     "rows": rows}
    finally:
        P.shutdown()
        D.shutdown()
    return out


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['geometry']}: {result['tokens']} tokens per load, {result['reps']} reps, decode "
             f"idle_wait_s {result['idle_wait_s']:g}; medians. The admitting step: the engine thread's CPU "
             "in the connector per load, and the step's start_load_kv wall time. After it, until every load "
             "is reported: CPU per load in the hooks (an idle step's wait copies loads in flight), steps, "
             "wall time from admission"]
    lines.append(f"  {'loads':>5} | {'admit us':>8} {'sched':>7} {'matched':>7} {'alloc':>7} {'meta':>6} "
                 f"{'worker':>7} {'start_load':>10} | {'post step us':>12} | {'after us':>8} "
                 f"{'get_fin':>8} {'steps':>6} | {'all done ms':>11}")
    for n, b in result["batches"].items():
        m = b["medians"]
        lines.append(
            f"  {n:>5} | {m['admit_us']:8.1f} {m['admit_scheduler_us']:7.1f} "
            f"{m['get_num_new_matched_tokens_us']:7.1f} {m['update_state_after_alloc_us']:7.1f} "
            f"{m['build_connector_meta_us']:6.1f} {m['admit_worker_us']:7.1f} {m['start_load_kv_us']:10.1f} | "
            f"{m['posting_step_us']:12.0f} | {m['after_us']:8.1f} {m['after_get_finished_us']:8.1f} "
            f"{m['after_steps']:6.0f} | {m['wall_ms']:11.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,16,64", help="loads admitted in one step (comma list)")
    ap.add_argument("--geometry", default="tiny,8b", help=f"comma list of {sorted(GEOMETRIES)}")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle-wait-s", type=float, default=0.002,
                    help="the decode's idle_wait_s (default 0.002, as shipped)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    names = connector_overhead.geometry_names(ap, args.geometry, GEOMETRIES)
    batches = [int(b) for b in args.batch.split(",") if b]
    if not batches or min(batches) < 1:
        ap.error("--batch takes positive integers")
    connector_overhead.run_and_report(
        lambda g: run_geometry(g, batches, args.tokens, args.reps, args.seed, args.idle_wait_s),
        names, report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
