"""One producer rank against thousands of simulated consumer ranks.

    .venv/bin/python bench/cluster_sim.py [--ranks 100,1024,4096] [--duration 30] \\
        [--confirm-rate 500] [--renew-s 10] [--procs 4] [--validate confirm|pin] [--out FILE.json]

What runs, all on loopback:

- **the producer rank**: a harness engine (the real RDMA connector: worker,
  lease table, side channel, UCX transport) in its own process, with a
  shared secret, as deployed off loopback;
- **one real consumer engine** doing verified loads from it throughout
  (prefill, then the decode reads the blocks over UCX and checks them
  bit-exact), a load every ``--load-gap`` s;
- **N simulated consumer ranks** in ``--procs`` processes, each rank from
  its own loopback address (127.10.x.y), each with the real
  ``SideChannelClient``: connect, HELLO/AUTH, HANDSHAKE (with the real
  compatibility record of the model), then RENEW every ``--renew-s``
  (the default cadence: a third of the 30 s TTL) and CONFIRM+RELEASE of
  real leases: the bench prefills one-block prompts on the producer at
  ``--confirm-rate`` per second and hands each prefill's params to a
  simulated rank, which confirms and releases it (HELD expected) as a
  decode rank would after its reads; with ``--validate pin``, it pins the
  lease (a RENEW with ``pin``, as a decode rank does when it posts its
  reads) and then releases it: two messages per load, as with read pins
  (the "confirm" figures are then the pin's). The simulated ranks do not read (no
  UCX endpoint each); they are the control plane of a cluster.

Recorded per N: handshake latency p50/p99 (connect to HANDSHAKE reply),
RENEW and CONFIRM latency p50/p99, their failures and non-HELD answers, the
producer's RSS before the ranks connected, once they are connected (per
connection), and at the end, its threads, CPU
seconds per second, the side channel's refusals and evictions, the rate of
CONFIRM+RELEASE reached, and the real loads' latency (idle, before the
ranks connect, and loaded) and correctness.

Uses public APIs only: the engine harness, the side channel's client and
wire messages. (The "before" figures in docs/benchmarks/ were taken with an
older tree, whose client could not bind a source address; this script no
longer carries the workaround.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import heapq
import json
import multiprocessing as mp
import os
import platform
import resource
import secrets
import subprocess
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch

from rdma_kv.connector import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from rdma_kv.connector.geometry import derive_geometry
from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.params import RemotePrefillParams, parse_kv_transfer_params
from rdma_kv.connector.rdma.compat import compat_info, rank_info
from rdma_kv.harness.engine import ModelShape
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.harness.process import EngineProcess

SHAPE = ModelShape(num_layers=4, num_kv_heads=4, head_size=32, block_size=16, num_blocks=8192)
TTL_S = 30.0


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def source(i: int) -> str:
    return f"127.10.{i // 250}.{1 + i % 250}"


def compat_and_rank() -> tuple[wire.CompatInfo, wire.RankInfo]:
    """The handshake record a decode rank of the same model sends (the
    harness engine's KV layout, as its worker derives it)."""
    shape = SHAPE
    names = shape.layer_names
    kv = torch.zeros(shape.num_layers, 2, shape.num_kv_heads, shape.block_size, 2 * shape.head_size,
                     dtype=shape.torch_dtype)
    caches = {name: kv[i] for i, name in enumerate(names)}
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.num_kv_heads,
                             head_size=shape.head_size, dtype=shape.dtype)
    config = KVCacheConfig(2, (KVCacheTensor(kv.numel() * kv.element_size(), names),), (KVCacheGroupSpec(names, spec),))
    rank = rank_info(config, 0, 1)
    return compat_info(config, derive_geometry(caches, config), shape.num_kv_heads), rank


def connect(port: int, index: int, secret: auth.Secret) -> SideChannelClient:
    return SideChannelClient("127.0.0.1", port, secret=secret, source_address=source(index), rpc_timeout_s=10.0,
                             connect_timeout_s=10.0)


def ranks_proc(conn: Any, port: int, first: int, count: int, secret_value: bytes, renew_s: float,
               threads: int, validate: str = "confirm") -> None:
    """Child: ``count`` simulated consumer ranks; handshake all, then renew and
    confirm until told to stop; report latencies."""
    raise_nofile()
    secret = auth.Secret(secret_value, "bench")
    compat, rank = compat_and_rank()
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    clients: list[Any] = [None] * count
    out: dict[str, list[float]] = {"handshake": [], "renew": [], "confirm": [], "release": []}
    errors: dict[str, int] = {}
    answers: dict[str, int] = {}
    lock = threading.Lock()
    last: list[Any] = [None] * count  # each rank's last lease (renewed at its cadence)
    claims = [secrets.token_bytes(16) for _ in range(count)]

    def note_error(kind: str, exc: BaseException) -> None:
        key = f"{kind}: {type(exc).__name__}: {str(exc)[:80]}"
        with lock:
            errors[key] = errors.get(key, 0) + 1

    def handshake(i: int) -> None:
        start = time.perf_counter()
        try:
            client = connect(port, first + i, secret)
            client.handshake(wire.Handshake(wire.PROTOCOL_VERSION, f"sim{first + i}", rank, compat))
            clients[i] = client
            with lock:
                out["handshake"].append(time.perf_counter() - start)
        except Exception as exc:
            note_error("handshake", exc)

    list(pool.map(handshake, range(count)))
    conn.send(("connected", sum(c is not None for c in clients)))

    def call(kind: str, i: int, message: Any) -> None:
        start = time.perf_counter()
        try:
            status = clients[i].lease_call(message).statuses[0]
        except Exception as exc:
            note_error(kind, exc)
            return
        with lock:
            out[kind].append(time.perf_counter() - start)
            key = f"{kind}:{status.name}"
            answers[key] = answers.get(key, 0) + 1

    def lease(i: int, params: dict[str, Any]) -> wire.LeaseWire:
        parsed = parse_kv_transfer_params(params)
        if not isinstance(parsed, RemotePrefillParams):
            raise ValueError(f"not a prefill's kv_transfer_params: {params}")
        return wire.LeaseWire.of(parsed.lease, claims[i])

    def pin_then_release(i: int, lw: wire.LeaseWire) -> None:
        call("confirm", i, wire.Renew(wire.PROTOCOL_VERSION, [lw], pin=True))
        call("release", i, wire.Release(wire.PROTOCOL_VERSION, [lw]))

    alive = [i for i in range(count) if clients[i] is not None]
    renew_at = [(time.monotonic() + renew_s * (k / max(1, len(alive))), i) for k, i in enumerate(alive)]
    heapq.heapify(renew_at)
    turn = 0
    while True:
        try:
            msg = conn.recv() if conn.poll(0.005) else None
        except EOFError:
            break
        if msg == "stop":
            break
        for params in msg or ():
            i = alive[turn % len(alive)]
            turn += 1
            last[i] = params
            if validate == "pin":
                pool.submit(pin_then_release, i, lease(i, params))
            else:
                pool.submit(call, "confirm", i, wire.Confirm(wire.PROTOCOL_VERSION, [lease(i, params)],
                                                             release=True))
        now = time.monotonic()
        while renew_at and renew_at[0][0] <= now:
            _, i = heapq.heappop(renew_at)
            heapq.heappush(renew_at, (now + renew_s, i))
            if last[i] is not None:
                pool.submit(call, "renew", i, wire.Renew(wire.PROTOCOL_VERSION, [lease(i, last[i])]))
    pool.shutdown(wait=True)
    for client in clients:
        if client is not None:
            client.close()
    conn.send(("report", {"lat": out, "errors": errors, "answers": answers}))


def proc_stat(pid: int) -> tuple[float, int, int]:
    """(cpu seconds, RSS bytes, threads) of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return cpu, rss, threads


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], 2)


def config(role: str, engine_id: str, secret_file: str) -> dict:
    return {"kv_connector": "RdmaKVConnector", "kv_role": role, "engine_id": engine_id, "kv_port": 0,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"auth_secret_file": secret_file, "lease_ttl_s": TTL_S}}


class RealLoads:
    """Verified loads from one real consumer engine, one at a time."""

    def __init__(self, p: EngineProcess, d: EngineProcess, rng: np.random.Generator) -> None:
        self.p, self.d, self.rng = p, d, rng
        self.n = 0
        self.latency: list[float] = []
        self.verified = self.failed = 0

    def one(self) -> None:
        self.n += 1
        rid = f"real{self.n}"
        prompt = self.rng.integers(1, 999, 8 * SHAPE.block_size).tolist()
        self.p.add(rid, prompt, {"do_remote_decode": True})
        params = self.p.wait_results([rid], timeout_s=60)[rid]["kv_transfer_params"]
        self.d.add(rid, prompt, params)
        r = self.d.wait_results([rid], timeout_s=60)[rid]
        if r["status"] == "finished" and not r["load_failed"] and r["bad_blocks"] == []:
            self.verified += 1
            self.latency.append(r["load_s"])
        else:
            self.failed += 1


def run(n: int, args: argparse.Namespace, secret_file: str, secret_value: bytes) -> dict:
    rng = np.random.default_rng(n)
    with EngineProcess("sim-prefill", config("kv_producer", "SP", secret_file), SHAPE, start_timeout_s=120) as p, \
            EngineProcess("sim-decode", config("kv_consumer", "SD", secret_file), SHAPE, start_timeout_s=120) as d:
        port = p.info["port"]
        real = RealLoads(p, d, rng)
        for _ in range(args.idle_loads):
            real.one()
        idle = list(real.latency)
        real.latency.clear()
        cpu0, rss0, threads0 = proc_stat(p.pid)
        ctx = mp.get_context("spawn")
        procs, pipes = [], []
        per = -(-n // args.procs)
        for k in range(args.procs):
            count = min(per, n - k * per)
            if count <= 0:
                break
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=ranks_proc, args=(child, port, k * per, count, secret_value, args.renew_s,
                                                        args.threads, args.validate), daemon=True)
            proc.start()
            procs.append(proc)
            pipes.append(parent)
        connected = 0
        start = time.monotonic()
        for pipe in pipes:
            if not pipe.poll(600):
                raise RuntimeError("simulated ranks did not finish their handshakes in 600 s")
            connected += pipe.recv()[1]
        connect_s = time.monotonic() - start
        _, rss_connected, _ = proc_stat(p.pid)
        # The steady state: prefills fed at the target rate, their params to the ranks.
        cpu1, _, _ = proc_stat(p.pid)
        t1 = time.monotonic()
        end = t1 + args.duration
        fed = done = 0
        pending: set[str] = set()
        next_load = t1
        peak_threads = threads0
        rr = 0
        while time.monotonic() < end:
            now = time.monotonic()
            want = int((now - t1) * args.confirm_rate)
            while fed < want and len(pending) < args.confirm_rate:  # at most a second's worth queued
                fed += 1
                rid = f"c{fed}"
                pending.add(rid)
                p.add(rid, rng.integers(1, 999, SHAPE.block_size).tolist(), {"do_remote_decode": True})
            p.pump(0.005)
            finished = [rid for rid in pending if rid in p.results]
            if finished:
                batch = [p.results.pop(rid)["kv_transfer_params"] for rid in finished]
                pending.difference_update(finished)
                done += len(batch)
                for k in range(0, len(batch), 16):
                    pipes[rr % len(pipes)].send(batch[k:k + 16])
                    rr += 1
            if now >= next_load:
                real.one()
                next_load = time.monotonic() + args.load_gap
            peak_threads = max(peak_threads, proc_stat(p.pid)[2])
        t2 = time.monotonic()
        cpu2, rss2, threads2 = proc_stat(p.pid)
        side = p.call("sidechannel")
        for pipe in pipes:
            pipe.send("stop")
        reports = [pipe.recv()[1] for pipe in pipes if pipe.poll(300)]
        for proc in procs:
            proc.join(60)
    lat: dict[str, list[float]] = {"handshake": [], "renew": [], "confirm": [], "release": []}
    errors: dict[str, int] = {}
    answers: dict[str, int] = {}
    for rep in reports:
        for k, v in rep["lat"].items():
            lat[k].extend(v)
        for k, v in rep["errors"].items():
            errors[k] = errors.get(k, 0) + v
        for k, v in rep["answers"].items():
            answers[k] = answers.get(k, 0) + v
    row = {
        "ranks": n, "connected": connected, "connect_s": round(connect_s, 1),
        "handshake_p50_ms": pct(lat["handshake"], 0.5), "handshake_p99_ms": pct(lat["handshake"], 0.99),
        "renew_p50_ms": pct(lat["renew"], 0.5), "renew_p99_ms": pct(lat["renew"], 0.99),
        "confirm_p50_ms": pct(lat["confirm"], 0.5), "confirm_p99_ms": pct(lat["confirm"], 0.99),
        "validate": args.validate, "release_p50_ms": pct(lat["release"], 0.5),
        "confirms": len(lat["confirm"]), "renews": len(lat["renew"]), "releases": len(lat["release"]),
        "confirm_rate_per_s": round(len(lat["confirm"]) / (t2 - t1), 1), "prefills_fed": fed, "prefills_done": done,
        "answers": answers, "errors": errors,
        "producer_rss_before_mib": round(rss0 / 2**20, 1), "producer_rss_after_mib": round(rss2 / 2**20, 1),
        "producer_rss_growth_mib": round((rss2 - rss0) / 2**20, 1),
        "producer_rss_connections_mib": round((rss_connected - rss0) / 2**20, 1),
        "producer_rss_per_connection_kib": round((rss_connected - rss0) / 1024 / max(1, connected), 2),
        "producer_threads_before": threads0, "producer_threads_peak": peak_threads,
        "producer_cpu_s_per_s": round((cpu2 - cpu1) / (t2 - t1), 3),
        "sidechannel": {k: v for k, v in side.items() if v} if isinstance(side, dict) else None,
        "real_loads": {"idle_p50_ms": pct(idle, 0.5), "idle_p99_ms": pct(idle, 0.99),
                       "loaded_p50_ms": pct(real.latency, 0.5), "loaded_p99_ms": pct(real.latency, 0.99),
                       "verified": real.verified, "failed": real.failed},
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="100,1024,4096", help="simulated consumer ranks, comma-separated")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of steady state per size")
    ap.add_argument("--confirm-rate", type=float, default=500.0, help="CONFIRM+RELEASE per second, in all")
    ap.add_argument("--renew-s", type=float, default=TTL_S / 3, help="each rank's RENEW cadence")
    ap.add_argument("--procs", type=int, default=4, help="processes the simulated ranks run in")
    ap.add_argument("--threads", type=int, default=16, help="RPC threads per process")
    ap.add_argument("--idle-loads", type=int, default=20, help="real loads before the ranks connect")
    ap.add_argument("--load-gap", type=float, default=0.25, help="seconds between real loads")
    ap.add_argument("--validate", choices=("confirm", "pin"), default="confirm",
                    help="what a simulated rank does with a lease: CONFIRM+RELEASE (one message), or PIN then "
                         "RELEASE (two, as a decode rank with read pins)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    raise_nofile()
    secret_value = secrets.token_hex(32).encode()
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = os.path.join(tmp, "secret")
        with open(secret_file, "wb") as f:
            f.write(secret_value)
        os.chmod(secret_file, 0o600)
        rows = [run(int(n), args, secret_file, secret_value) for n in args.ranks.split(",")]
    print(f"{'ranks':>6} {'conn':>6} {'hs p99':>8} {'renew p99':>10} {'confirm p50/p99 ms':>19} {'conf/s':>7} "
          f"{'rss +MiB':>9} {'thr':>4} {'cpu/s':>6} {'real p99 idle/loaded ms':>24} {'ok/fail':>8}")
    for r in rows:
        rl = r["real_loads"]
        print(f"{r['ranks']:>6} {r['connected']:>6} {r['handshake_p99_ms']!s:>8} {r['renew_p99_ms']!s:>10} "
              f"{r['confirm_p50_ms']!s:>9}/{r['confirm_p99_ms']!s:<9} {r['confirm_rate_per_s']:>7} "
              f"{r['producer_rss_growth_mib']:>9} {r['producer_threads_peak']:>4} {r['producer_cpu_s_per_s']:>6} "
              f"{rl['idle_p99_ms']!s:>11}/{rl['loaded_p99_ms']!s:<12} {rl['verified']:>4}/{rl['failed']}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.out, "w") as f:
            json.dump({"bench": "cluster_sim", "label": args.label, "commit": commit,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "loadavg_start": os.getloadavg()},
                       "args": vars(args), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
