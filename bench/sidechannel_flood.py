"""A legitimate consumer's fresh side-channel handshakes while the side
channel is flooded.

Three processes on loopback: a ``SideChannelServer`` (a trivial handler
that answers HANDSHAKE with a canned reply and every lease request HELD),
an attacker whose sockets are bound to 127.0.0.2, and the consumer (this
process, from 127.0.0.1) that opens a fresh connection per attempt and does
HELLO / (AUTH) / HANDSHAKE with the real ``SideChannelClient`` (its
default retries). An attempt succeeds when the handshake reply arrives
within 2 s of its start.

Floods (each connection is reopened as soon as the server closes it):

- ``idle``: ``--idle`` connections (500) that send nothing;
- ``slowloris``: ``--slowloris`` connections (50) that send a frame header
  announcing 1000 bytes, then one byte a second;
- ``hello_idle``: ``--hello`` connections (300) that send HELLO, read the
  CHALLENGE and then sit idle;
- ``none``: no flood (the reference).

Each runs with and without a shared secret (``--secret on|off|both``).
Reported per run: attempts, successes within 2 s, latency p50/p99 of the
successful attempts, the WARNING lines (and bytes) the server logged over
the whole run (warm-up included), the server's stats and the attacker's
connection count.

    .venv/bin/python bench/sidechannel_flood.py [--duration 30] [--warmup 5] \\
        [--floods none,idle,slowloris,hello_idle] [--secret both] [--out FILE.json]

Only the server's public constructor is used, so the same script measures an
older tree: ``PYTHONPATH=<old>/src .venv/bin/python bench/sidechannel_flood.py``.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import multiprocessing as mp
import os
import platform
import selectors
import socket
import statistics
import struct
import subprocess
import time

from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient

SECRET = b"flood-benchmark-secret-0123456789abcdef"
ATTACKER, CONSUMER = "127.0.0.2", "127.0.0.1"
SUCCESS_WITHIN_S = 2.0
COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])


class CannedHandler:
    def on_handshake(self, request: wire.Handshake) -> wire.HandshakeReply:
        geometry = wire.GeometryWire([wire.RegionWire(4096, 4096)], [])
        return wire.HandshakeReply(wire.PROTOCOL_VERSION, "P", wire.RankInfo(0, 1, 8), COMPAT, COMPAT.compat_hash(),
                                   b"agent-metadata", geometry)

    def on_renew(self, request: wire.Renew) -> wire.LeaseReply:
        return wire.LeaseReply([wire.LeaseStatus.HELD] * len(request.leases), 30.0)

    on_confirm = on_release = on_renew

    def holds(self, leases: object) -> bool:
        return True  # every lease it answered HELD lives


class CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = self.nbytes = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1
        self.nbytes += len(f"{record.levelname} {record.name}: {record.getMessage()}\n")


def serve(conn, with_secret: bool) -> None:
    """Child: run the server until told to stop, then report."""
    counter = CountingHandler()
    logging.getLogger("rdma_kv").addHandler(counter)
    logging.getLogger("rdma_kv").setLevel(logging.INFO)
    logging.getLogger("rdma_kv").propagate = False
    secret = auth.Secret(SECRET, "bench") if with_secret else None
    with SideChannelServer(CannedHandler(), CONSUMER, 0, secret=secret) as server:
        conn.send(server.port)
        conn.recv()  # stop
        stats = dict(server.stats)
    conn.send({"warning_lines": counter.lines, "warning_bytes": counter.nbytes, "server_stats": stats})


def hello_frame() -> bytes:
    body = wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32)))
    return struct.pack(">I", len(body)) + body


def attack(port: int, kind: str, count: int, stop) -> None:
    """Child: keep ``count`` connections of ``kind`` open from ATTACKER."""
    sel = selectors.DefaultSelector()
    drip_at: dict[socket.socket, list[float]] = {}  # slowloris: [next send time, bytes sent]
    drip = struct.pack(">I", 1000) + bytes(1000)
    connects = 0
    hello = hello_frame()

    def open_one() -> None:
        nonlocal connects
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((ATTACKER, 0))
            err = s.connect_ex((CONSUMER, port))
        except OSError:
            s.close()
            return
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return
        connects += 1
        sel.register(s, selectors.EVENT_WRITE, "connecting")

    def reopen(s: socket.socket) -> None:
        sel.unregister(s)
        drip_at.pop(s, None)
        s.close()

    for _ in range(count):
        open_one()
    while not stop.is_set():
        for key, events in sel.select(0.05):
            s = key.fileobj
            if key.data == "connecting":
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    reopen(s)
                    continue
                sel.modify(s, selectors.EVENT_READ, "open")
                try:
                    if kind == "hello_idle":
                        s.send(hello)
                    elif kind == "slowloris":
                        s.send(drip[:1])
                        drip_at[s] = [time.monotonic() + 1.0, 1]
                except OSError:
                    reopen(s)
                continue
            try:
                data = s.recv(65536)  # a CHALLENGE (kept open), or the server's close
            except OSError:
                data = b""
            if not data:
                reopen(s)
        now = time.monotonic()
        for s, state in list(drip_at.items()):
            if now >= state[0]:
                try:
                    s.send(drip[int(state[1]):int(state[1]) + 1])  # header, then body, a byte a second
                    state[0] += 1.0
                    state[1] = min(state[1] + 1, len(drip) - 1)
                except OSError:
                    reopen(s)
        for _ in range(count - len(sel.get_map())):
            open_one()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    print(f"attacker {kind}: {connects} connections opened", flush=True)


def attempt(port: int, with_secret: bool) -> tuple[bool, float, str]:
    secret = auth.Secret(SECRET, "bench") if with_secret else None
    client = SideChannelClient(CONSUMER, port, connect_timeout_s=SUCCESS_WITHIN_S,
                               rpc_timeout_s=SUCCESS_WITHIN_S, secret=secret)
    start = time.monotonic()
    try:
        reply = client.call(wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 8), COMPAT))
        ok, why = isinstance(reply, wire.HandshakeReply), type(reply).__name__
    except Exception as exc:  # every failure is a data point, not a crash
        ok, why = False, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        client.close()
    elapsed = time.monotonic() - start
    return ok and elapsed <= SUCCESS_WITHIN_S, elapsed, why


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(kind: str, count: int, with_secret: bool, duration_s: float, warmup_s: float, gap_s: float) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve, args=(child, with_secret), daemon=True)
    server.start()
    if not parent.poll(30):
        raise RuntimeError("the server process did not report its port within 30 s")
    port = parent.recv()
    stop = ctx.Event()
    attacker = None
    if kind != "none":
        attacker = ctx.Process(target=attack, args=(port, kind, count, stop), daemon=True)
        attacker.start()
        time.sleep(warmup_s)
    results: list[tuple[bool, float, str]] = []
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        results.append(attempt(port, with_secret))
        time.sleep(gap_s)
    stop.set()
    if attacker is not None:
        attacker.join(30)
    parent.send("stop")
    report = parent.recv() if parent.poll(30) else {}
    server.join(30)
    ok_latencies = [elapsed for ok, elapsed, _ in results if ok]
    failures: dict[str, int] = {}
    for ok, _, why in results:
        if not ok:
            failures[why] = failures.get(why, 0) + 1
    row = {
        "flood": kind, "connections": count if kind != "none" else 0, "secret": with_secret,
        "attempts": len(results), "successes": len(ok_latencies),
        "success_rate": round(len(ok_latencies) / len(results), 3) if results else None,
        "p50_ms": None if not ok_latencies else round(1000 * statistics.median(ok_latencies), 1),
        "p99_ms": None if not ok_latencies else round(1000 * percentile(ok_latencies, 0.99), 1),
        "failures": dict(sorted(failures.items(), key=lambda kv: -kv[1])[:5]),
        **report,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of consumer attempts per run")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of flood before the first attempt")
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between consumer attempts")
    ap.add_argument("--floods", default="none,idle,slowloris,hello_idle")
    ap.add_argument("--secret", choices=("on", "off", "both"), default="both")
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--slowloris", type=int, default=50)
    ap.add_argument("--hello", type=int, default=300)
    ap.add_argument("--label", default="", help="e.g. before / after, stored in the result")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    sizes = {"none": 0, "idle": args.idle, "slowloris": args.slowloris, "hello_idle": args.hello}
    secrets = {"on": (True,), "off": (False,), "both": (False, True)}[args.secret]
    rows = [run(kind, sizes[kind], with_secret, args.duration, args.warmup, args.gap)
            for kind in args.floods.split(",") for with_secret in secrets]
    print(f"{'flood':<11} {'conns':>5} {'secret':>6} {'ok/attempts':>12} {'rate':>6} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'WARNING lines':>14}")
    for r in rows:
        print(f"{r['flood']:<11} {r['connections']:>5} {'on' if r['secret'] else 'off':>6} "
              f"{r['successes']:>5}/{r['attempts']:<6} {r['success_rate']:>6} {r['p50_ms']!s:>8} "
              f"{r['p99_ms']!s:>8} {r.get('warning_lines')!s:>14}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.out, "w") as f:
            json.dump({"bench": "sidechannel_flood", "label": args.label, "commit": commit,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
                       "args": vars(args), "success_within_s": SUCCESS_WITHIN_S, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
