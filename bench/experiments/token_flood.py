"""A legitimate decode's RENEW / CONFIRM round trips while peers that proved
nothing flood the producer's side channel with lease calls of wrong tokens.

Three processes on loopback, no secret (the case at issue): a producer
``SideChannelServer`` over the real ``ProducerHandler`` and ``LeaseTable``
(one lease granted for the decode); an attacker holding ``--conns``
connections (64: the default ``max_untrusted``, 16 from each of 4
addresses, the per-source budget) that each HELLO, HANDSHAKE (so the
opening deadline does not close them) and then send RENEWs of
``--leases`` (4,096: ``wire.MAX_LEASES_PER_MESSAGE``) leases of the
producer's epoch with made-up tokens, the next as soon as the answer
arrives, reopening what the server closes; and the decode (this process)
that times RENEW and CONFIRM of its one lease through the real
``SideChannelClient`` every ``--gap`` s (its connection trusted after the
first HELD), and every tenth time a fresh client's first RENEW ("fresh":
connect, HELLO, RENEW on a connection not yet trusted).

    .venv/bin/python bench/experiments/token_flood.py [--duration 20] [--conns 64] [--leases 4096]

Reports p50 / p99 / max of the decode's round trips with no flood and under
it, and how many flood calls the server answered per second. A measurement,
not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import selectors
import socket
import statistics
import struct
import time
from typing import Any

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.leases import LeaseTable
from rdma_kv.connector.rdma.params import LeaseRef, lease_binding, lease_token
from rdma_kv.connector.rdma.producer import ProducerHandler
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.connector.types import EngineId, RequestId

EPOCH, KEY = 7, b"k" * 32
COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])
HOST = "127.0.0.1"
ATTACKERS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]


def good_ref() -> LeaseRef:
    bound = lease_binding("P", 1, 32, ((10, 11),))
    return LeaseRef(EPOCH, 1, RequestId("r1"), lease_token(KEY, EPOCH, 1, "r1", bound), bound)


def serve(conn: Any) -> None:
    table = LeaseTable(max_s=3600.0)
    table.set_epoch(EPOCH, KEY)
    table.grant(good_ref(), [10, 11], 3600.0)
    handler = ProducerHandler(EngineId("P"), wire.RankInfo(0, 1, 8), 3600.0, table, COMPAT, lambda: b"md", None)
    with SideChannelServer(handler, HOST, 0) as server:
        conn.send(server.port)
        conn.recv()
        conn.send({k: v for k, v in vars(server.stats).items() if v} if hasattr(server.stats, "__dict__")
                  else {f: getattr(server.stats, f) for f in server.stats.__dataclass_fields__
                        if getattr(server.stats, f)})


def framed(message: Any) -> bytes:
    body = wire.encode(message)
    return struct.pack(">I", len(body)) + body


def attack(port: int, conns: int, leases: int, stop: Any, out: Any) -> None:
    """Keep ``conns`` connections sending flood RENEWs, one outstanding each."""
    flood = framed(wire.Renew(wire.PROTOCOL_VERSION, [
        wire.LeaseWire(EPOCH, 1000 + i, f"x{i:07d}", os.urandom(16), os.urandom(16), os.urandom(16))
        for i in range(leases)]))
    hello = framed(wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32)))
    shake = framed(wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 8), COMPAT))
    sel = selectors.DefaultSelector()
    answered = closed = 0
    state: dict[socket.socket, list[Any]] = {}

    def open_one(src: str) -> None:
        s = socket.create_connection((HOST, port), source_address=(src, 0))
        s.sendall(hello + shake)
        state[s] = [src, 0, bytearray()]  # source, replies seen, buffer
        sel.register(s, selectors.EVENT_READ)

    per = conns // len(ATTACKERS)
    for i in range(conns):
        open_one(ATTACKERS[min(i // max(per, 1), len(ATTACKERS) - 1)])
    while not stop.is_set():
        for key, _ in sel.select(0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            st = state[s]
            try:
                data = s.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                del state[s]
                closed += 1
                open_one(st[0])
                continue
            st[2] += data
            while len(st[2]) >= 4 and len(st[2]) >= 4 + struct.unpack_from(">I", st[2])[0]:
                n = struct.unpack_from(">I", st[2])[0]
                del st[2][:4 + n]
                st[1] += 1
                if st[1] >= 2:  # CHALLENGE, HANDSHAKE reply, then each flood answer
                    answered += st[1] > 2
                    try:
                        s.sendall(flood)
                    except OSError:
                        pass
    out.send({"flood_answers": answered, "closed_by_server": closed})


def decode_round_trips(port: int, duration_s: float, gap_s: float) -> dict[str, Any]:
    client = SideChannelClient(HOST, port, rpc_timeout_s=30.0)
    lease = [wire.LeaseWire.of(good_ref(), b"A" * 16)]
    times: dict[str, list[float]] = {"renew": [], "confirm": [], "fresh": []}
    statuses = set()
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        if len(times["renew"]) % 10 == 0:  # a decode rank's first call: connect, HELLO, RENEW (untrusted)
            start = time.perf_counter()
            fresh = SideChannelClient(HOST, port, rpc_timeout_s=30.0)
            reply = fresh.lease_call(wire.Renew(wire.PROTOCOL_VERSION, lease))
            times["fresh"].append(time.perf_counter() - start)
            statuses.update(s.name for s in reply.statuses)
            fresh.close()
        for kind, request in (("renew", wire.Renew(wire.PROTOCOL_VERSION, lease)),
                              ("confirm", wire.Confirm(wire.PROTOCOL_VERSION, lease))):
            start = time.perf_counter()
            reply = client.lease_call(request)
            times[kind].append(time.perf_counter() - start)
            statuses.update(s.name for s in reply.statuses)
        time.sleep(gap_s)
    client.close()
    row: dict[str, Any] = {"statuses": sorted(statuses)}
    for kind, values in times.items():
        ordered = sorted(values)
        row[kind] = {"n": len(values), "p50_ms": round(1e3 * statistics.median(values), 2),
                     "p99_ms": round(1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
                     "max_ms": round(1e3 * ordered[-1], 2)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--gap", type=float, default=0.02)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--leases", type=int, default=4096)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve, args=(child,), daemon=True)
    server.start()
    port = parent.recv()
    quiet = decode_round_trips(port, min(5.0, args.duration), args.gap)
    print("no flood:", json.dumps(quiet), flush=True)
    stop = ctx.Event()
    a_parent, a_child = ctx.Pipe()
    attacker = ctx.Process(target=attack, args=(port, args.conns, args.leases, stop, a_child), daemon=True)
    attacker.start()
    time.sleep(args.warmup)
    flooded = decode_round_trips(port, args.duration, args.gap)
    stop.set()
    flood = a_parent.recv() if a_parent.poll(30) else {}
    attacker.join(10)
    parent.send("stop")
    stats = parent.recv() if parent.poll(30) else {}
    server.join(10)
    flood["flood_answers_per_s"] = round(flood.get("flood_answers", 0) / (args.duration + args.warmup), 1)
    print(f"flood of {args.conns} x {args.leases}-lease RENEWs:", json.dumps(flooded), flush=True)
    print("attacker:", json.dumps(flood), flush=True)
    print("server stats:", json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
