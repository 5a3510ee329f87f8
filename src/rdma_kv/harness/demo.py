"""``rdma-kv demo``: prefill in one process, decode in another, KV over UCX.

Starts a producer (prefill) engine and a consumer (decode) engine as two
spawned processes on 127.0.0.1, runs a stream of requests with varied
prompt lengths (partial last blocks, shared prefixes that hit the decode
side's prefix cache, repeated block-aligned prompts that hit it fully),
fills the producer's KV deterministically, moves it with one-sided reads,
verifies every decode-side block bit-exact, and prints per-request and
aggregate latency and GB/s. Exit status 0 only if every block verified and
no load failed.

Usage: ``python -m rdma_kv.harness.demo [--requests N] [--layers L] ...``

Imports the standard library, numpy and ``rdma_kv.harness`` (torch in the
children).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.rdma import auth
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.errors import ConfigError
from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.process import EngineProcess, HarnessError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdma-kv demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--requests", type=int, default=48, help="requests to run (default 48)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--min-tokens", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=None, help="request stream seed (printed)")
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for both engines, e.g. tcp or sm,self")
    p.add_argument("--extra-config", type=_json_object, default={}, metavar="JSON",
                   help='more kv_connector_extra_config for both engines, e.g. \'{"read_pin": false}\'')
    p.add_argument("--verbose", "-v", action="store_true", help="one line per request")
    # Handled by rdma_kv.cli.demo before this parser runs; listed so that
    # `rdma-kv demo --help` shows the other mode.
    p.add_argument("--transport", action="store_true",
                   help="run the transport alone instead: one process registers a KV-shaped buffer, "
                   "another reads blocks from it (`rdma-kv demo --transport --help` for its options)")
    return p


def _prompts(n: int, lo: int, hi: int, block_size: int, rng: np.random.Generator) -> list[list[int]]:
    """Varied lengths; about 1 in 4 shares a prefix with an earlier prompt,
    1 in 10 repeats an earlier block-aligned prompt (a full prefix hit)."""
    out: list[list[int]] = []
    for i in range(n):
        kind = rng.random()
        if out and kind < 0.1:
            base = out[int(rng.integers(len(out)))]
            full = max(1, len(base) // block_size) * block_size
            out.append(list(base[:full]) if len(base) >= block_size else list(base))
        elif out and kind < 0.35:
            base = out[int(rng.integers(len(out)))]
            keep = (len(base) // block_size) * block_size
            suffix = rng.integers(1, 32000, int(rng.integers(1, 3 * block_size))).tolist()
            out.append(list(base[:keep]) + suffix)
        else:
            length = int(rng.integers(lo, hi + 1))
            out.append(rng.integers(1, 32000, length).tolist())
    return out


class _Bar:
    """tqdm if installed, else a one-line counter on stderr."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.n, self.desc = total, 0, desc
        try:
            from tqdm import tqdm

            self._tqdm: Any = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)
        except ImportError:
            self._tqdm = None

    def update(self, k: int = 1) -> None:
        self.n += k
        if self._tqdm is not None:
            self._tqdm.update(k)
        else:
            width = 30
            fill = int(width * self.n / max(self.total, 1))
            sys.stderr.write(f"\r{self.desc} [{'#' * fill}{'.' * (width - fill)}] {self.n}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of kv_connector_extra_config keys, got {text!r}")
    return value


def _config(role: str, engine_id: str, ucx_tls: str | None, more: dict[str, Any] | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"side_channel_host": "127.0.0.1", "read_timeout_s": 10.0}
    if ucx_tls:
        extra["ucx_options"] = {"TLS": ucx_tls}
    extra.update(more or {})
    return {"kv_connector": "RdmaKVConnector", "kv_role": role, "engine_id": engine_id,
            "kv_port": 0, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def _pct(values: Iterable[float], q: float) -> float:
    arr = np.asarray(list(values), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.transport:
        parser.error("--transport is the other mode of `rdma-kv demo`: run `rdma-kv demo --transport`")
    for name in ("requests", "concurrency", "min_tokens", "max_tokens", "layers", "kv_heads", "head_size",
                 "block_size", "num_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_tokens > args.max_tokens:
        parser.error(f"--min-tokens {args.min_tokens} exceeds --max-tokens {args.max_tokens}")
    for role in ("kv_producer", "kv_consumer"):  # a bad --extra-config said here, not in two engines' tracebacks
        try:
            settings = RdmaSettings.from_config(KVTransferConfig.from_dict(_config(role, "check", args.ucx_tls,
                                                                                   args.extra_config)))
            auth.load_secret(settings.auth_secret_env, settings.auth_secret_file)  # as each worker will
        except ConfigError as exc:
            parser.error(f"--extra-config: {exc}")
    entropy = np.random.SeedSequence().entropy
    assert isinstance(entropy, int)
    seed = args.seed if args.seed is not None else entropy % (2**32)
    rng = np.random.default_rng(seed)
    shape = ModelShape(args.layers, args.kv_heads, args.head_size, args.block_size, args.num_blocks, args.dtype)
    max_blocks_needed = args.concurrency * 2 * (-(-args.max_tokens // args.block_size) + 2)
    if args.max_tokens >= args.num_blocks * args.block_size or max_blocks_needed > args.num_blocks * 2:
        print(f"--num-blocks {args.num_blocks} is too small for --max-tokens {args.max_tokens} at "
              f"--concurrency {args.concurrency}", file=sys.stderr)
        return 2
    prompts = _prompts(args.requests, args.min_tokens, args.max_tokens, args.block_size, rng)
    print(f"rdma-kv demo: {args.requests} requests, seed {seed}; model {args.layers} layers x "
          f"{args.kv_heads} kv heads x {args.head_size} x block {args.block_size} {args.dtype} "
          f"({shape.block_nbytes / 1024:.0f} KiB per block)")
    t_start = time.perf_counter()
    try:
        with EngineProcess("prefill", _config("kv_producer", "prefill-0", args.ucx_tls, args.extra_config),
                           shape) as prefill, \
                EngineProcess("decode", _config("kv_consumer", "decode-0", args.ucx_tls, args.extra_config),
                              shape) as decode:
            print(f"prefill pid {prefill.pid} (side channel 127.0.0.1:{prefill.info['port']}), "
                  f"decode pid {decode.pid}; started in {time.perf_counter() - t_start:.1f} s")
            rows = _run(prefill, decode, prompts, args)
            stats = decode.call("stats") or {}
            status_p = prefill.wait_status(lambda s: s["held"] == 0 and s["leases"] == 0, timeout_s=15)
            status_d = decode.call("status")
    except HarnessError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    return _report(rows, stats, status_p, status_d, args, shape)


def _run(prefill: EngineProcess, decode: EngineProcess, prompts: list[list[int]],
         args: argparse.Namespace) -> list[dict[str, Any]]:
    bar = _Bar(len(prompts), "requests")
    ids = [f"req-{i:05d}" for i in range(len(prompts))]
    submitted, finished = 0, 0
    decoding: set[str] = set()
    in_prefill: set[str] = set()
    rows = []
    deadline = time.monotonic() + 120 + 0.5 * len(prompts)
    try:
        while finished < len(prompts):
            if time.monotonic() > deadline:
                raise HarnessError("the demo did not finish in time")
            while submitted < len(prompts) and len(in_prefill) + len(decoding) < args.concurrency:
                rid = ids[submitted]
                prefill.add(rid, prompts[submitted], {"do_remote_decode": True})
                in_prefill.add(rid)
                submitted += 1
            for rid in [r for r in in_prefill if r in prefill.results]:
                in_prefill.discard(rid)
                params = prefill.results[rid]["kv_transfer_params"]
                if params is None:
                    raise HarnessError(f"prefill returned no kv_transfer_params for {rid}")
                decode.add(rid, prompts[int(rid[4:])], params)  # the router forwards them verbatim
                decoding.add(rid)
            for rid in [r for r in decoding if r in decode.results]:
                decoding.discard(rid)
                rows.append(decode.results[rid])
                finished += 1
                bar.update()
            try:
                prefill._recv(0.001)
            except HarnessError as exc:
                if "no message" not in str(exc):
                    raise
            try:
                decode._recv(0.001)
            except HarnessError as exc:
                if "no message" not in str(exc):
                    raise
    finally:
        bar.close()
    return rows


def _report(rows: list[dict[str, Any]], stats: dict[str, Any], status_p: dict[str, Any],
            status_d: dict[str, Any], args: argparse.Namespace, shape: ModelShape) -> int:
    records = {r["request_id"]: r for r in stats.get("requests", [])}
    bad = [r for r in rows if r["bad_blocks"]]
    failed = [r for r in rows if r["load_failed"] or r["status"] != "finished"]
    # Every block the decode engine computes holds what verification expects:
    # only blocks it loaded (or hit in its prefix cache) test the transfer.
    # A request whose connector offered nothing (it declined the params:
    # "computing locally") moved nothing and verified nothing.
    local = [r for r in rows if not r["load_failed"]
             and r["local_hit_tokens"] + r["external_tokens"] < r["num_prompt_tokens"]]
    full_hits = [r for r in rows if r["external_tokens"] == 0 and r["local_hit_tokens"] == r["num_prompt_tokens"]]
    partial = [r for r in rows if r["local_hit_tokens"] and r["external_tokens"]]
    print()
    if args.verbose:
        print(f"{'request':>10} {'prompt':>6} {'hit':>5} {'loaded':>6} {'blocks':>6} {'ops':>5} "
              f"{'MiB':>8} {'load ms':>8} {'xfer ms':>8} {'GB/s':>6}  verified")
    gbps = []
    for r in sorted(rows, key=lambda r: r["request_id"]):
        rec = records.get(r["request_id"], {})
        nbytes, xfer = rec.get("nbytes", 0), rec.get("transfer_s", 0.0)
        if nbytes and xfer:
            gbps.append(nbytes / xfer / 1e9)
        if args.verbose:
            verdict = ("FAIL " + str(r["bad_blocks"]) if r["bad_blocks"] else "load error" if r["load_failed"]
                       else "computed locally" if r in local else "ok")
            print(f"{r['request_id']:>10} {r['num_prompt_tokens']:>6} {r['local_hit_tokens']:>5} "
                  f"{r['external_tokens']:>6} {rec.get('num_blocks', 0):>6} {rec.get('ops_posted', 0):>5} "
                  f"{nbytes / 2**20:>8.2f} {r['load_s'] * 1e3:>8.2f} {xfer * 1e3:>8.2f} "
                  f"{(nbytes / xfer / 1e9 if xfer else 0):>6.2f}  {verdict}")
    loads = [r["load_s"] for r in rows if r["external_tokens"]]
    totals = stats.get("totals", {})
    total_bytes, total_xfer = totals.get("nbytes", 0), totals.get("transfer_s", 0.0)
    print(f"requests: {len(rows)} finished, {len(partial)} partial prefix hits, {len(full_hits)} full hits, "
          f"{len(failed)} load failures, {len(bad)} with wrong blocks, {len(local)} computed by the decode "
          "engine instead of loaded")
    print(f"moved {total_bytes / 2**20:.1f} MiB in {totals.get('num_blocks', 0)} blocks, "
          f"{totals.get('num_descs', 0)} descriptors -> {totals.get('ops_posted', 0)} ops posted "
          f"(contiguous runs: {totals.get('block_runs', 0)})")
    print(f"load latency (admission -> done_recving): p50 {_pct(loads, 50) * 1e3:.2f} ms, "
          f"p99 {_pct(loads, 99) * 1e3:.2f} ms, max {max(loads, default=0) * 1e3:.2f} ms")
    print(f"transfer GB/s per request: median {_pct(gbps, 50):.2f}, p10 {_pct(gbps, 10):.2f}; "
          f"all loads {total_bytes / total_xfer / 1e9 if total_xfer else 0:.2f} GB/s (bytes over their "
          f"summed transfer time, {total_xfer * 1e3:.1f} ms: loads overlap, so not a wall rate)")
    print(f"after the run: prefill holds {status_p['held']} requests' blocks, {status_p['leases']} leases, "
          f"{status_p['free_blocks']}/{shape.num_blocks} blocks free; decode "
          f"{status_d['free_blocks']}/{shape.num_blocks} free, {status_d['inflight_loads']} loads in flight")
    ok = (not bad and not failed and not local and status_p["held"] == 0
          and totals.get("ops_posted") == totals.get("block_runs"))
    print("VERIFIED: every decode-side block is bit-exact" if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
