"""Run one 1P1D pair of offline vLLM engines on 127.0.0.1 and compare the
decode output with a plain run: the reference for any P/D connector.

    .venv-vllm/bin/python tests/vllm/pd_pair.py --connector NixlConnector

Three steps, one vLLM process at a time except the pair itself:

1. plain: greedy generation without a connector (the reference);
2. prefill (``kv_role=kv_both``, params ``{"do_remote_decode": true}``,
   ``max_tokens=1``): prints the ``kv_transfer_params`` its outputs return,
   then stays alive (its KV blocks are held for the decode to read) until
   the parent closes its stdin;
3. decode (``kv_role=kv_both``): gets each prompt's params verbatim, as a
   router would, generates ``max_tokens`` greedily; the parent compares the
   token ids with step 1.

Prefill and decode are children of this script, rendezvous over pipes
(JSON lines), each with its own side-channel port. A child's failure is
forwarded with the tail of its log. Exit status 0 when every decode output
matches the plain run.

Imports only the standard library at module level: vLLM runs in children.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _child(role: str, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    from tiny_model import (
        PROMPTS, apply_vllm_env, build_tiny_llama, generate_greedy, greedy, make_llm,
        shutdown_llm,
    )

    apply_vllm_env(multiprocessing=args.multiprocessing)
    model = build_tiny_llama(args.model_dir)
    prompts = list(PROMPTS)

    results = os.fdopen(args.result_fd, "w")

    def emit(obj: Any) -> None:
        results.write(json.dumps(obj) + "\n")
        results.flush()

    if role == "plain":
        out = generate_greedy(model, prompts, max_tokens=args.max_tokens)
        emit({"outputs": out})
        return

    config = {
        "kv_connector": args.connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": json.loads(args.extra_config),
    }
    if args.module_path:
        config["kv_connector_module_path"] = args.module_path
    if role == "prefill":
        llm = make_llm(model, kv_transfer_config=config)
        t0 = time.monotonic()
        out = greedy(llm, prompts, max_tokens=1,
                     kv_transfer_params=[{"do_remote_decode": True}] * len(prompts))
        emit({"outputs": out, "elapsed_s": time.monotonic() - t0})
        sys.stdin.read()  # hold the engine (and its KV) until the parent is done
        return
    params = json.loads(sys.stdin.readline())
    llm = make_llm(model, kv_transfer_config=config)
    try:
        t0 = time.monotonic()  # generation only: handshake, loads, decode steps
        out = greedy(llm, prompts, max_tokens=args.max_tokens, kv_transfer_params=params)
        emit({"outputs": out, "elapsed_s": time.monotonic() - t0})
    finally:
        shutdown_llm(llm)


def _spawn(role: str, argv: list[str], env: dict[str, str], log_dir: Path
           ) -> subprocess.Popen[str]:
    """The child's results come back on a pipe of their own; its stdout and
    stderr (vLLM logs to stdout) go to ``log_dir/<role>.log``, never to an
    unread pipe that would block it once full."""
    read_fd, write_fd = os.pipe()
    with open(log_dir / f"{role}.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--result-fd", str(write_fd), *argv],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
            pass_fds=(write_fd,),
        )
    os.close(write_fd)
    proc.results = os.fdopen(read_fd)  # type: ignore[attr-defined]
    proc.log_path = log.name  # type: ignore[attr-defined]
    return proc


def _read_result(proc: subprocess.Popen[str], role: str, timeout_s: float) -> dict[str, Any]:
    """The child's result line; its log tail if it exits (or times out) first."""
    results = proc.results  # type: ignore[attr-defined]
    ready, _, _ = select.select([results], [], [], timeout_s)
    line = results.readline() if ready else ""
    if line:
        return json.loads(line)
    proc.kill()
    proc.communicate(timeout=30)
    err = Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
    raise RuntimeError(f"{role} exited (rc={proc.returncode}) without a result; "
                       f"stderr tail ({proc.log_path}):\n{err[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["plain", "prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--connector", default="NixlConnector")
    ap.add_argument("--module-path", default="", help="kv_connector_module_path, if out of tree")
    ap.add_argument("--extra-config", default="{}", help="kv_connector_extra_config (JSON)")
    ap.add_argument("--model-dir", default="/tmp/rdma-kv-tiny-llama")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--multiprocessing", action="store_true",
                    help="VLLM_ENABLE_V1_MULTIPROCESSING=1 in each engine")
    ap.add_argument("--prefill-port", type=int, default=5600,
                    help="side channel of the prefill (VLLM_NIXL_SIDE_CHANNEL_PORT)")
    ap.add_argument("--decode-port", type=int, default=5610)
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--log-dir", default="", help="children's stderr (default: a temp dir)")
    args = ap.parse_args()
    if args.role:
        _child(args.role, args)
        return 0

    argv = [
        "--connector", args.connector, "--module-path", args.module_path,
        "--extra-config", args.extra_config, "--model-dir", args.model_dir,
        "--max-tokens", str(args.max_tokens),
        *(["--multiprocessing"] if args.multiprocessing else []),
    ]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pd-pair-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ)
    # Loopback only: the side channel binds 127.0.0.1 and UCX (NIXL's
    # backend) is kept off other interfaces.
    base.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_NET_DEVICES": "lo"})
    # vLLM's ZMQ IPC sockets (ipc://$VLLM_RPC_BASE_PATH/<uuid>) in a directory of
    # the pair's own, removed at the end: a killed engine never unlinks them.
    private = tempfile.mkdtemp(prefix="vllm-tmp-pd-pair-")
    base.update({"TMPDIR": private, "VLLM_RPC_BASE_PATH": private})
    try:
        return _run_pair(args, argv, base, log_dir)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _run_pair(args: argparse.Namespace, argv: list[str], base: dict[str, str], log_dir: Path) -> int:
    """The plain run, then the pair; 0 when every decode output matches."""
    t0 = time.monotonic()
    plain = _spawn("plain", argv, base, log_dir)
    ref = _read_result(plain, "plain", args.timeout_s)["outputs"]
    plain.communicate(timeout=60)
    t_plain = time.monotonic() - t0

    prefill_env = {**base, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(args.prefill_port)}
    decode_env = {**base, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(args.decode_port)}
    prefill = _spawn("prefill", argv, prefill_env, log_dir)
    decode = None
    try:
        t1 = time.monotonic()
        pre = _read_result(prefill, "prefill", args.timeout_s)
        params = [o["kv_transfer_params"] for o in pre["outputs"]]
        decode = _spawn("decode", argv, decode_env, log_dir)
        assert decode.stdin is not None
        decode.stdin.write(json.dumps(params) + "\n")
        decode.stdin.flush()
        dec = _read_result(decode, "decode", args.timeout_s)
        t_pair = time.monotonic() - t1
    finally:
        for proc in (decode, prefill):
            if proc is not None and proc.poll() is None:
                try:
                    proc.communicate(timeout=60)  # closes stdin: the prefill exits
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()

    ok = True
    for i, (r, p, d) in enumerate(zip(ref, pre["outputs"], dec["outputs"])):
        match = r["token_ids"] == d["token_ids"]
        ok &= match
        print(json.dumps({
            "prompt": i, "num_prompt_tokens": len(r["prompt_token_ids"]),
            "plain": r["token_ids"], "prefill_first": p["token_ids"], "decode": d["token_ids"],
            "match": match, "prefill_params": p["kv_transfer_params"],
        }))
    print(json.dumps({"connector": args.connector, "all_match": ok,
                      "plain_s": round(t_plain, 1), "pair_s": round(t_pair, 1),
                      "prefill_generate_s": round(pre["elapsed_s"], 1),
                      "decode_generate_s": round(dec["elapsed_s"], 1),
                      "logs": str(log_dir)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
