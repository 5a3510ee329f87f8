"""1P1D inside real vLLM: NixlConnector vs RdmaKVConnector, side by side.

    .venv-vllm/bin/python bench/vllm_pd.py [--reps 5] [--model large|small] [--json out.json]

For each connector, one prefill and one decode engine (separate processes,
multiprocessing off, 127.0.0.1, ``UCX_NET_DEVICES=lo``) on the same tiny
Llama: ``large`` (default; 8 layers, 8 KV heads of 64, fp32: 32 KiB of KV
per token, 1 MiB per 32-token block) or ``small`` (tests/vllm's model: 2
layers, 2 KV heads of 32, 512 B per token). Both engines start before the first prefill. Then, per
repetition: the prefill instance runs the prompts (``do_remote_decode``,
``max_tokens=1``), the decode instance gets the params verbatim and
generates ``--max-tokens`` greedily; token ids are checked against a plain
run. Reported, per connector (medians over the warm repetitions):

- ``load_step_ms``: decode engine, queued -> first token, per request (the
  KV load from admission to finished_recving, plus one step); median over
  requests and repetitions;
- ``handshake_ms``: first repetition's ``load_step_ms`` minus the warm
  median (the first request pays the handshake);
- ``e2e_ms``: decode ``generate()`` wall time for the batch (loads + all
  decode steps); ``prefill_ms`` likewise for the prefill batch;
- ``first_e2e_ms``: the first decode ``generate()`` (cold: handshake and
  every first-time cost), against ``plain``: a plain engine's
  ``generate()`` of the same prompts (its first call, and the median of as
  many more), in the same invocation;
- ``breakdown``: where the first and the warm decode requests spend their
  time, from the engine's timestamps and the connector's calls and
  per-load records (``tests/vllm/connector_trace.py``): queued ->
  admitted (``get_num_new_matched_tokens``), admitted -> the load's
  records (handshake, plan, post, transfer, confirm, and what is left of
  the load's total: waiting to be posted or polled; and the load's three
  stages end to end: start, from the step's metadata bound to its first
  read posted, the forward pass between them included, transfer, and
  finish, from the last read to ``get_finished`` reporting it), reported
  (``finished_recving``) -> first token, first -> last token. Medians over
  the batch's requests.

The connectors run one after the other (one pair at a time: 2 shared cores).
Imports only the standard library at module level; vLLM runs in children
(``tests/vllm/engine_proc.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))

from engine_proc import EngineProcess  # noqa: E402

MODELS = {
    # 32 KiB of KV per token: the transfer is a real part of the request.
    "large": dict(num_layers=8, hidden=512, heads=8, kv_heads=8),
    # tests/vllm's default tiny model (512 B of KV per token): the forward
    # pass costs next to nothing, so what the connector adds stands out.
    "small": dict(num_layers=2, hidden=128, heads=4, kv_heads=2),
}
LLM = dict(kv_cache_memory_bytes=512 << 20, disable_log_stats=False)
# BOS + one token per word: 7, 73, 131, 201 and 250 tokens (block 32).
_WORDS = ("the cat sat on the mat and the dog sat on the log a quick brown fox jumps over the "
          "lazy dog to be or not to be that is the question").split()
PROMPTS = [" ".join((_WORDS * 10)[:n - 1]) for n in (7, 73, 131, 201, 250)]


def configs(name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, str]]:
    """(prefill config, decode config, prefill env, decode env)."""
    if name == "NixlConnector":
        # NIXL's side channel ignores kv_port: host and port come from the environment.
        cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        host = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        return (cfg, cfg, {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"},
                {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5610"})
    base = {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
            "kv_port": 0}
    return {**base, "kv_role": "kv_producer"}, {**base, "kv_role": "kv_consumer"}, {}, {}


def run_connector(name: str, model_dir: str, log_dir: Path, reps: int, max_tokens: int,
                  reference: list[list[int]], model: dict[str, int]) -> dict[str, Any]:
    pre_cfg, dec_cfg, pre_env, dec_env = configs(name)
    prefill = EngineProcess(f"{name}-prefill", model_dir, log_dir, env=pre_env, timeout_s=300)
    decode = EngineProcess(f"{name}-decode", model_dir, log_dir, env=dec_env, timeout_s=300)
    try:
        prefill.start(pre_cfg, model=model, **LLM)
        decode.start(dec_cfg, model=model, **LLM)
        rows = []
        for rep in range(reps + 1):
            pre = prefill.generate(PROMPTS, max_tokens=1,
                                   kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))
            params = [o["kv_transfer_params"] for o in pre["outputs"]]
            dec = decode.generate(PROMPTS, max_tokens=max_tokens, kv_transfer_params=params,
                                  trace=True)
            tokens = [o["token_ids"] for o in dec["outputs"]]
            loads = [o["queued_to_first_token_s"] for o in dec["outputs"]]
            rows.append({"rep": rep, "match": tokens == reference, "prefill_s": pre["elapsed_s"],
                         "e2e_s": dec["elapsed_s"], "load_step_s": loads,
                         "breakdown": breakdown(dec)})
    finally:
        decode.close()
        prefill.close()
    warm = rows[1:]
    load_ms = statistics.median(1e3 * x for r in warm for x in r["load_step_s"] if x is not None)
    first_ms = statistics.median(1e3 * x for x in rows[0]["load_step_s"] if x is not None)
    return {
        "connector": name, "all_match": all(r["match"] for r in rows),
        "load_step_ms": round(load_ms, 1), "first_rep_load_step_ms": round(first_ms, 1),
        "handshake_ms": round(first_ms - load_ms, 1),
        "e2e_ms": round(1e3 * statistics.median(r["e2e_s"] for r in warm), 1),
        "first_e2e_ms": round(1e3 * rows[0]["e2e_s"], 1),
        "first_breakdown": rows[0]["breakdown"],
        "warm_breakdown": {k: round(statistics.median(r["breakdown"][k] for r in warm
                                                      if r["breakdown"].get(k) is not None), 2)
                           for k in rows[0]["breakdown"]
                           if any(r["breakdown"].get(k) is not None for r in warm)},
        "prefill_ms": round(1e3 * statistics.median(r["prefill_s"] for r in warm), 1),
        "reps": reps, "rows": rows,
    }


PHASES = ("queued_to_admitted", "handshake", "plan", "post", "transfer", "confirm", "load_other",
          "start", "finish", "load_total", "reported_to_first_token", "first_to_last_token", "steps_while_loading")


def breakdown(dec: dict[str, Any]) -> dict[str, float | None]:
    """Medians over the batch's requests, in ms (``steps_while_loading``: a
    count), of where a decode request's time went (module docstring)."""
    trace = dec.get("trace") or {}
    records = {r.get("request_id"): r for r in trace.get("records", ())}
    admitted, recving = trace.get("admitted", {}), trace.get("recving", {})
    steps = trace.get("steps", [])
    per: dict[str, list[float]] = {k: [] for k in PHASES}
    for out in dec["outputs"]:
        rid = out["request_id"]
        # vLLM may suffix the request id it hands the connector.
        key = next((k for k in admitted if k == rid or k.startswith(f"{rid}-")), None)
        rec = records.get(key, {})
        t_admit, t_recv = admitted.get(key), recving.get(key)
        if t_admit is not None and "queued_s" in out:
            per["queued_to_admitted"].append(t_admit - out["queued_s"])
        parts = 0.0
        for name in ("handshake", "plan", "post", "transfer", "confirm"):
            value = rec.get(f"{name}_s")
            if value is not None:
                per[name].append(value)
                parts += value
        for name in ("start", "finish"):  # stages that contain the parts above: not summed
            if rec.get(f"{name}_s") is not None:
                per[name].append(rec[f"{name}_s"])
        if rec.get("total_s") is not None:
            per["load_total"].append(rec["total_s"])
            per["load_other"].append(rec["total_s"] - parts)
        if t_recv is not None and "first_token_s" in out:
            per["reported_to_first_token"].append(out["first_token_s"] - t_recv)
        if "first_token_s" in out and "last_token_s" in out:
            per["first_to_last_token"].append(out["last_token_s"] - out["first_token_s"])
        if t_admit is not None and t_recv is not None:
            per["steps_while_loading"].append(sum(1 for t in steps if t_admit < t <= t_recv))
    return {k: (round(statistics.median(v) * (1 if k == "steps_while_loading" else 1e3), 2)
                if v else None) for k, v in per.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="warm repetitions (after one cold)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", choices=sorted(MODELS), default="large",
                    help="large: 8 layers, 8 KV heads of 64 (default); small: tests/vllm's tiny model")
    ap.add_argument("--model-dir", default="", help="default /tmp/rdma-kv-bench-llama[-small]")
    ap.add_argument("--connectors", default="NixlConnector,RdmaKVConnector")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-pd-bench-"))
    model = MODELS[args.model]
    model_dir = args.model_dir or "/tmp/rdma-kv-bench-llama" + ("" if args.model == "large" else f"-{args.model}")
    t0 = time.monotonic()
    with EngineProcess("plain", model_dir, log_dir, timeout_s=300) as plain:
        plain.start(model=model, **LLM)
        runs = [plain.generate(PROMPTS, max_tokens=args.max_tokens) for _ in range(args.reps + 1)]
        reference = [o["token_ids"] for o in runs[0]["outputs"]]
    plain_ms = {"first_e2e_ms": round(1e3 * runs[0]["elapsed_s"], 1),
                "e2e_ms": round(1e3 * statistics.median(r["elapsed_s"] for r in runs[1:]), 1)}
    results = [run_connector(name, model_dir, log_dir, args.reps, args.max_tokens, reference, model)
               for name in args.connectors.split(",")]
    print(f"{'engine':<16} {'match':>5} {'load+step ms':>12} {'handshake ms':>12} "
          f"{'first e2e ms':>12} {'/ plain':>7} {'decode e2e ms':>13} {'prefill ms':>10}")
    print(f"{'plain':<16} {'-':>5} {'-':>12} {'-':>12} {plain_ms['first_e2e_ms']:>12} {'1.00':>7} "
          f"{plain_ms['e2e_ms']:>13} {'-':>10}")
    for r in results:
        ratio = r['first_e2e_ms'] / plain_ms['first_e2e_ms']
        print(f"{r['connector']:<16} {str(r['all_match']):>5} {r['load_step_ms']:>12} "
              f"{r['handshake_ms']:>12} {r['first_e2e_ms']:>12} {ratio:>7.2f} {r['e2e_ms']:>13} "
              f"{r['prefill_ms']:>10}")
    print("\nwhere a decode request's time goes, ms (median over the batch; first rep / warm median):")
    print(f"{'phase':<26}" + "".join(f" {r['connector']:>24}" for r in results))
    for k in PHASES:
        cells = [f"{r['first_breakdown'].get(k)} / {r['warm_breakdown'].get(k)}" for r in results]
        print(f"{k:<26}" + "".join(f" {c:>24}" for c in cells))
    print(f"({len(PROMPTS)} prompts of {[len(p.split()) + 1 for p in PROMPTS]} tokens, "
          f"{args.reps} warm reps, {time.monotonic() - t0:.0f} s, logs in {log_dir})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": {"name": args.model, **model}, "llm": LLM, "plain": plain_ms,
                                               "results": results}, indent=1))
    return 0 if all(r["all_match"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
