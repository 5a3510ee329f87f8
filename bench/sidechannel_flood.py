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
- ``many_idle``: ``--per-source`` idle connections (16) from each of
  ``--sources`` addresses (8 and 32: ``--sources 8,32`` runs both);
- ``renew_garbage`` (no secret only): connections from ``--sources``
  addresses x ``--per-source`` that send HELLO and a RENEW of a lease the
  producer never granted every second; the server answers PENDING, as a
  worker does before its first step (the old server trusted that);
- ``insider_idle`` / ``insider_slowloris`` (secret only): an authenticated
  peer's connections from ``--sources`` addresses x ``--per-source``, idle
  after AUTH / dribbling a frame after AUTH, opened 8 at a time as a
  competent attacker would (connections that evict each other while
  opening never establish); with ``--max-connections 256`` they fill the
  server as they did the old one;
- ``none``: no flood (the reference).

Each runs with and without a shared secret (``--secret on|off|both``; the
``renew_garbage`` and ``insider_*`` floods only where they apply).
Reported per run: attempts, successes within 2 s, latency p50/p99 of the
successful attempts, the WARNING lines (and bytes) the server logged over
the whole run (warm-up included), the server's stats and the attacker's
connection count.

    .venv/bin/python bench/sidechannel_flood.py [--duration 30] [--warmup 5] \\
        [--floods none,idle,slowloris,hello_idle,many_idle,renew_garbage,insider_idle,insider_slowloris] \\
        [--secret both] [--sources 8,32] [--max-connections 256] [--out FILE.json]

Only the server's public constructor is used, so the same script measures an
older tree: ``PYTHONPATH=<old>/src .venv/bin/python bench/sidechannel_flood.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from collections.abc import Iterable
from typing import Any, cast

from rdma_kv.connector.rdma import auth, wire, wiregeom
from rdma_kv.connector.rdma.sidechannel import ConnectionLimits, SideChannelServer

try:
    from rdma_kv.connector.rdma.sideclient import SideChannelClient
except ImportError:  # a tree before the client had its own module
    from rdma_kv.connector.rdma.sidechannel import SideChannelClient  # type: ignore[attr-defined,no-redef]

SECRET = b"flood-benchmark-secret-0123456789abcdef"
ATTACKER, CONSUMER = "127.0.0.2", "127.0.0.1"
SUCCESS_WITHIN_S = 2.0
COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])


class CannedHandler:
    def on_handshake(self, request: wire.Handshake) -> wire.HandshakeReply:
        geometry = wire.GeometryWire([wiregeom.RegionWire(4096, 4096)], [])
        return wire.HandshakeReply(wire.PROTOCOL_VERSION, "P", wire.RankInfo(0, 1, 8), COMPAT, COMPAT.compat_hash(),
                                   b"agent-metadata", geometry)

    def on_renew(self, request: wire.Renew) -> wire.LeaseReply:
        return self._answer(request.leases)

    def on_confirm(self, request: wire.Confirm) -> wire.LeaseReply:
        return self._answer(request.leases)

    def on_release(self, request: wire.Release) -> wire.LeaseReply:
        return self._answer(request.leases)

    @staticmethod
    def _answer(leases: list[wire.LeaseWire]) -> wire.LeaseReply:
        # A lease "never granted" is PENDING: what a worker answers before its first step.
        return wire.LeaseReply([wire.LeaseStatus.PENDING if lease.request_id == "garbage" else wire.LeaseStatus.HELD
                                for lease in leases], 30.0)

    def live(self, leases: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
        return set(leases)  # every lease it answered HELD lives


class CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = self.nbytes = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1
        self.nbytes += len(f"{record.levelname} {record.name}: {record.getMessage()}\n")


def serve(conn, with_secret: bool, max_connections: int) -> None:
    """Child: run the server until told to stop, then report."""
    counter = CountingHandler()
    logging.getLogger("rdma_kv").addHandler(counter)
    logging.getLogger("rdma_kv").setLevel(logging.INFO)
    logging.getLogger("rdma_kv").propagate = False
    secret = auth.Secret(SECRET, "bench") if with_secret else None
    limits = ConnectionLimits(max_connections=max_connections) if max_connections else None
    with SideChannelServer(CannedHandler(), CONSUMER, 0, secret=secret, limits=limits) as server:
        conn.send(server.port)
        conn.recv()  # stop
        stats = dataclasses.asdict(server.stats)
    conn.send({"warning_lines": counter.lines, "warning_bytes": counter.nbytes, "server_stats": stats})


def garbage_renew() -> bytes:
    values: dict[str, Any] = {"epoch": 1, "generation": 1, "request_id": "garbage", "token": os.urandom(16),
              "binding": os.urandom(16), "claim": os.urandom(16)}
    lease = wire.LeaseWire(**{k: values[k] for k in wire.LeaseWire.__struct_fields__ if k in values})
    body = wire.encode(wire.Renew(wire.PROTOCOL_VERSION, [lease]))
    return struct.pack(">I", len(body)) + body


def attack(port: int, kind: str, count: int, sources: list[str], stop) -> None:
    """Child: keep ``count`` connections of ``kind`` open from ``sources``
    (spread evenly), reopening what the server closes."""
    sel = selectors.DefaultSelector()
    drip = struct.pack(">I", 1000) + bytes(1000)
    connects = 0
    hello_nonce = os.urandom(32)
    body = wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "consumer", hello_nonce))
    hello = struct.pack(">I", len(body)) + body
    renew = garbage_renew()
    pace = 8 if kind.startswith("insider") else None  # at most this many opening at once
    want = {src: count // len(sources) + (i < count % len(sources)) for i, src in enumerate(sources)}

    def open_one(src: str) -> None:
        nonlocal connects
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((src, 0))
            err = s.connect_ex((CONSUMER, port))
        except OSError:
            s.close()
            return
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return
        connects += 1
        # state: [source, replies, next drip time, drip offset, next renew time]
        sel.register(s, selectors.EVENT_WRITE, ["connecting", src, 0, 0.0, 0, 0.0])

    def close(s: socket.socket) -> None:
        sel.unregister(s)
        s.close()

    def send(s: socket.socket, data: bytes) -> bool:
        try:
            s.send(data)
            return True
        except OSError:
            close(s)
            return False

    while not stop.is_set():
        for key, events in sel.select(0.05):
            s, st = cast(socket.socket, key.fileobj), key.data
            if st[0] == "connecting":
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    close(s)
                    continue
                st[0] = "open"
                sel.modify(s, selectors.EVENT_READ, st)
                if kind == "slowloris":
                    send(s, drip[:1])
                    st[3], st[4] = time.monotonic() + 1.0, 1
                elif kind not in ("idle", "many_idle"):
                    send(s, hello)
                continue
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:
                close(s)
                continue
            st[2] += 1
            if st[2] == 1 and kind == "renew_garbage":
                if send(s, renew):
                    st[5] = time.monotonic() + 1.0
            elif st[2] == 1 and kind.startswith("insider"):
                challenge = wire.decode_reply(data[4:])
                if not isinstance(challenge, wire.Challenge):
                    close(s)  # refused: the server's answer to a full budget
                    continue
                secret = auth.Secret(SECRET, "bench")
                proof = auth.client_proof(secret, challenge.nonce, hello_nonce, wire.PROTOCOL_VERSION, "consumer")
                answer = wire.encode(wire.Auth(wire.PROTOCOL_VERSION, proof))
                if send(s, struct.pack(">I", len(answer)) + answer) and kind == "insider_slowloris":
                    st[3], st[4] = time.monotonic() + 1.0, 0  # then dribble a frame after AUTH
        now = time.monotonic()
        opening = 0
        per_source: dict[str, int] = {}
        for key in list(sel.get_map().values()):
            s, st = cast(socket.socket, key.fileobj), key.data
            per_source[st[1]] = per_source.get(st[1], 0) + 1
            opening += st[2] < 2
            if st[0] != "open":
                continue
            dribbling = kind == "slowloris" or (kind == "insider_slowloris" and st[2] >= 2)
            if dribbling and st[3] and now >= st[3]:
                if send(s, drip[st[4]:st[4] + 1]):  # header, then body, a byte a second
                    st[3] += 1.0
                    st[4] = min(st[4] + 1, len(drip) - 1)
            elif kind == "renew_garbage" and st[5] and now >= st[5]:
                if send(s, renew):
                    st[5] = now + 1.0
        for src, n in want.items():
            for _ in range(n - per_source.get(src, 0)):
                if pace is not None and opening >= pace:
                    break
                open_one(src)
                opening += 1
    for key in list(sel.get_map().values()):
        cast(socket.socket, key.fileobj).close()
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


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (not empty), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(kind: str, count: int, sources: list[str], with_secret: bool, duration_s: float, warmup_s: float,
        gap_s: float, max_connections: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve, args=(child, with_secret, max_connections), daemon=True)
    server.start()
    if not parent.poll(30):
        raise RuntimeError("the server process did not report its port within 30 s")
    port = parent.recv()
    stop = ctx.Event()
    attacker = None
    if kind != "none":
        attacker = ctx.Process(target=attack, args=(port, kind, count, sources, stop), daemon=True)
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
        "flood": kind, "connections": count if kind != "none" else 0, "sources": len(sources),
        "secret": with_secret, "max_connections": max_connections or "default",
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
    ap.add_argument("--sources", default="8", help="attacker addresses for many_idle, renew_garbage and insider_* "
                                                   "(comma-separated: one run each)")
    ap.add_argument("--per-source", type=int, default=16, help="connections per address for those floods")
    ap.add_argument("--max-connections", type=int, default=0, help="the server's max_connections (0: its default)")
    ap.add_argument("--label", default="", help="e.g. before / after, stored in the result")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    sizes = {"none": 0, "idle": args.idle, "slowloris": args.slowloris, "hello_idle": args.hello}
    secrets = {"on": (True,), "off": (False,), "both": (False, True)}[args.secret]
    rows = []
    for kind in args.floods.split(","):
        for with_secret in secrets:
            if kind == "renew_garbage" and with_secret or kind.startswith("insider") and not with_secret:
                continue  # garbage earns nothing past AUTH; an insider has the secret
            if kind in sizes:
                plans = [(sizes[kind], [ATTACKER])]
            else:
                plans = [(n * args.per_source, [f"127.0.{100 + i // 250}.{1 + i % 250}" for i in range(n)])
                         for n in map(int, args.sources.split(","))]
            for count, addresses in plans:
                rows.append(run(kind, count, addresses, with_secret, args.duration, args.warmup, args.gap,
                                args.max_connections))
    print(f"{'flood':<17} {'conns':>5} {'addrs':>5} {'secret':>6} {'ok/attempts':>12} {'rate':>6} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'WARNING lines':>14}")
    for r in rows:
        print(f"{r['flood']:<17} {r['connections']:>5} {r['sources']:>5} {'on' if r['secret'] else 'off':>6} "
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
