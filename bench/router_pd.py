"""2P1D through vllm-router: RdmaKVConnector vs vLLM's NixlConnector.

    .venv-vllm/bin/python bench/router_pd.py [--rounds 3] [--completions 64] [--in-flight 16]
                                             [--model large|small] [--json out.json]

Per connector, two prefill servers and one decode server (``python -m
vllm.entrypoints.openai.api_server``, multiprocessing on, 127.0.0.1,
``UCX_NET_DEVICES=lo``) behind its own ``vllm-router --vllm-pd-disaggregation``
(0.1.17, its defaults, round robin), plus one plain server for the
reference completions; all seven servers stay up for the whole run. Each
round sends ``--completions`` streaming completions (greedy, prompts of 24
to 200 tokens, 16 output tokens) through each connector's router,
``--in-flight`` at a time, the connectors alternating (the order flips
every round). Per connector and round: wall time of the whole batch, and
TTFT per request (request sent -> first streamed token, through the
router: prefill leg, KV load, first decode step), p50 and p99; every
completion is checked against the plain server's, and the decodes' failed
loads are counted (rdma-kv: ``rdma_kv_loads_total``; NIXL: its log's
transfer failures). Round 1 includes every first-time cost (handshakes).

Timing lives here, never in a test. Imports only the standard library at
module level; vLLM runs in the servers (``tests/vllm/serve_proc.py``).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO / "tests"))

from netutil import free_base_port  # noqa: E402
from serve_proc import SERVED_MODEL, ApiServer, Router, complete, metric  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

MODELS = {
    # 32 KiB of KV per token (8 layers, 8 KV heads of 64, fp32): a 200-token
    # prompt moves 6.25 MiB.
    "large": dict(num_layers=8, hidden=512, heads=8, kv_heads=8),
    # tests/vllm's tiny model (512 B per token): the connector's fixed costs.
    "small": dict(),
}
WORDS = ("the cat sat on the mat and the dog sat on the log a quick brown fox jumps over the "
         "lazy dog to be or not to be that is the question").split()
MAX_TOKENS = 16


def prompts(n: int) -> list[str]:
    """``n`` prompts of 24 to 200 tokens (BOS + one token per word)."""
    out = []
    for i in range(n):
        length = 23 + (i * 37) % 177
        out.append(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(length)))
    return out


def stream(base_url: str, prompt: str) -> dict[str, Any]:
    """One streaming completion: TTFT (first token chunk), total, text."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    t0 = time.monotonic()
    ttft, text = None, []
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                piece = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text.append(piece)
    except Exception as e:  # reported, counted as a failed request
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": ttft is not None, "ttft_s": ttft, "total_s": time.monotonic() - t0, "text": "".join(text)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def connector_configs(name: str) -> dict[str, Any]:
    if name == "rdma-kv":
        def rdma(role: str) -> dict[str, Any]:
            return {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
                    "kv_role": role, "kv_port": 0, "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"side_channel_host": "127.0.0.1"}}
        return {"prefill": rdma("kv_producer"), "decode": rdma("kv_consumer")}
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute"}
    return {"prefill": nixl, "decode": nixl}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--completions", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--model", choices=sorted(MODELS), default="large")
    ap.add_argument("--json", default="")
    ap.add_argument("--log-dir", default="")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop every server

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="router-pd-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(log_dir / f"model-{args.model}", **MODELS[args.model])
    kv_bytes = ["--kv-cache-memory-bytes", str(512 << 20)]
    names = ("rdma-kv", "nixl")
    nixl_ports = free_base_port(3 * 8)
    servers: dict[str, dict[str, ApiServer]] = {}
    plain = ApiServer("plain", model, log_dir, extra_args=kv_bytes)
    everything = [plain]
    t_start = time.monotonic()
    try:
        for name in names:
            configs = connector_configs(name)
            group = {}
            for i, role in enumerate(("prefill0", "prefill1", "decode")):
                env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                       "VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_ports + 8 * i)} if name == "nixl" else {}
                group[role] = ApiServer(f"{name}-{role}", model, log_dir, env=env, extra_args=kv_bytes,
                                        kv_transfer_config=configs["decode" if role == "decode" else "prefill"])
                everything.append(group[role])
            servers[name] = group
        for s in everything:
            s.wait_healthy(900)
        startup_s = time.monotonic() - t_start
        routers = {name: Router(f"router-{name}", log_dir,
                                prefill=[g["prefill0"].url, g["prefill1"].url], decode=[g["decode"].url])
                   for name, g in servers.items()}
        everything.extend(routers.values())
        for r in routers.values():
            r.wait_healthy(120)

        batch = prompts(args.completions)
        want = []
        for p in batch:
            out = complete(plain.url, p, max_tokens=MAX_TOKENS)
            assert out["status"] == 200, out
            want.append(out["text"])
        rounds: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for name in order:
                t0 = time.monotonic()
                with ThreadPoolExecutor(args.in_flight) as pool:
                    got = list(pool.map(lambda p: stream(routers[name].url, p), batch))
                wall = time.monotonic() - t0
                ttfts = [g["ttft_s"] for g in got if g["ok"]]
                row = {"round": rnd + 1, "connector": name, "wall_s": round(wall, 3),
                       "ttft_p50_ms": round(1e3 * percentile(ttfts, 50), 1) if ttfts else None,
                       "ttft_p99_ms": round(1e3 * percentile(ttfts, 99), 1) if ttfts else None,
                       "failed_requests": sum(not g["ok"] for g in got),
                       "wrong_completions": sum(g["ok"] and g["text"] != w for g, w in zip(got, want))}
                rounds.append(row)
                print(json.dumps(row), flush=True)
        decode = servers["rdma-kv"]["decode"]
        nixl_log = servers["nixl"]["decode"].log()
        failed = {"rdma-kv": metric(decode.url, "rdma_kv_loads_total", outcome="failed"),
                  "rdma-kv_ok": metric(decode.url, "rdma_kv_loads_total", outcome="ok"),
                  "nixl": sum(nixl_log.count(k) for k in ("Recovered from KV load failure",
                                                          "KV transfer failed", "handshake failed"))}
        summary = {}
        for name in names:
            mine = [r for r in rounds if r["connector"] == name and r["round"] > 1] or \
                   [r for r in rounds if r["connector"] == name]
            summary[name] = {k: statistics.median(r[k] for r in mine)
                             for k in ("wall_s", "ttft_p50_ms", "ttft_p99_ms")}
        result = {"args": vars(args), "model": MODELS[args.model] or "tests/vllm tiny", "startup_s": round(startup_s),
                  "router": "vllm-router 0.1.17 (defaults, --policy round_robin)", "rounds": rounds,
                  "median_of_warm_rounds": summary, "decode_load_failures": failed, "logs": str(log_dir)}
        print(json.dumps({"median_of_warm_rounds": summary, "decode_load_failures": failed}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        bad = sum(r["failed_requests"] + r["wrong_completions"] for r in rounds)
        return 0 if bad == 0 else 1
    finally:
        for s in reversed(everything):
            s.close()


if __name__ == "__main__":
    sys.exit(main())
