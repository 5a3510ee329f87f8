"""1P1D inside real vLLM: NixlConnector vs RdmaKVConnector, side by side.

    .venv-vllm/bin/python bench/vllm_pd.py [--reps 5] [--json out.json]

For each connector, one prefill and one decode engine (separate processes,
multiprocessing off, 127.0.0.1, ``UCX_NET_DEVICES=lo``) on the same larger
tiny Llama (8 layers, 8 KV heads of 64, fp32: 32 KiB of KV per token, 1 MiB
per 32-token block). Both engines start before the first prefill. Then, per
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
  decode steps); ``prefill_ms`` likewise for the prefill batch.

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

MODEL = dict(num_layers=8, hidden=512, heads=8, kv_heads=8)
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
                  reference: list[list[int]]) -> dict[str, Any]:
    pre_cfg, dec_cfg, pre_env, dec_env = configs(name)
    prefill = EngineProcess(f"{name}-prefill", model_dir, log_dir, env=pre_env, timeout_s=300)
    decode = EngineProcess(f"{name}-decode", model_dir, log_dir, env=dec_env, timeout_s=300)
    try:
        prefill.start(pre_cfg, model=MODEL, **LLM)
        decode.start(dec_cfg, model=MODEL, **LLM)
        rows = []
        for rep in range(reps + 1):
            pre = prefill.generate(PROMPTS, max_tokens=1,
                                   kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))
            params = [o["kv_transfer_params"] for o in pre["outputs"]]
            dec = decode.generate(PROMPTS, max_tokens=max_tokens, kv_transfer_params=params)
            tokens = [o["token_ids"] for o in dec["outputs"]]
            loads = [o["queued_to_first_token_s"] for o in dec["outputs"]]
            rows.append({"rep": rep, "match": tokens == reference, "prefill_s": pre["elapsed_s"],
                         "e2e_s": dec["elapsed_s"], "load_step_s": loads})
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
        "prefill_ms": round(1e3 * statistics.median(r["prefill_s"] for r in warm), 1),
        "reps": reps, "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="warm repetitions (after one cold)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model-dir", default="/tmp/rdma-kv-bench-llama")
    ap.add_argument("--connectors", default="NixlConnector,RdmaKVConnector")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-pd-bench-"))
    t0 = time.monotonic()
    with EngineProcess("plain", args.model_dir, log_dir, timeout_s=300) as plain:
        plain.start(model=MODEL, **LLM)
        reference = [o["token_ids"] for o in
                     plain.generate(PROMPTS, max_tokens=args.max_tokens)["outputs"]]
    results = [run_connector(name, args.model_dir, log_dir, args.reps, args.max_tokens, reference)
               for name in args.connectors.split(",")]
    print(f"{'connector':<16} {'match':>5} {'load+step ms':>12} {'handshake ms':>12} "
          f"{'decode e2e ms':>13} {'prefill ms':>10}")
    for r in results:
        print(f"{r['connector']:<16} {str(r['all_match']):>5} {r['load_step_ms']:>12} "
              f"{r['handshake_ms']:>12} {r['e2e_ms']:>13} {r['prefill_ms']:>10}")
    print(f"({len(PROMPTS)} prompts of {[len(p.split()) + 1 for p in PROMPTS]} tokens, "
          f"{args.reps} warm reps, {time.monotonic() - t0:.0f} s, logs in {log_dir})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": MODEL, "llm": LLM, "results": results},
                                              indent=1))
    return 0 if all(r["all_match"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
