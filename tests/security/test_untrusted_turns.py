"""The side channel's loop under a flood of requests from untrusted
connections: a turn reads at most ``UNTRUSTED_READS_PER_TURN`` of them,
those read least recently first, so the trusted connections (read every
turn) do not wait behind 64 untrusted reads and the large lease calls they
complete, and no untrusted connection is starved. Counted per loop turn,
not timed."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from rdma_testutil import frame

from rdma_kv.connector.rdma import framing, sidechannel, wire
from rdma_kv.connector.rdma.admission import ConnectionLimits
from rdma_kv.connector.rdma.sidechannel import SideChannelServer

pytestmark = pytest.mark.timeout(60)

HELD = wire.LeaseStatus.HELD


def lease(gen, request_id="r"):
    return wire.LeaseWire(7, gen, request_id, os.urandom(16), os.urandom(16), b"A" * 16)


def _exchange(sock, message):
    sock.sendall(frame(message))
    body = framing.recv_frame(sock, wire.MAX_REPLY_BYTES, "test", deadline=time.monotonic() + 20)
    assert body is not None, "the server closed the connection instead of answering"
    return wire.decode_reply(body)


class StallingHandler:
    """Every lease HELD; a RENEW of request id "stall" holds the loop thread until ``go``."""

    def __init__(self):
        self.stalled, self.go = threading.Event(), threading.Event()

    def on_handshake(self, request):
        return wire.Refused("no handshake here")

    def on_renew(self, request):
        if request.leases[0].request_id == "stall":
            self.stalled.set()
            self.go.wait(30)
        return wire.LeaseReply([HELD] * len(request.leases), 30.0)

    on_confirm = on_release = on_renew

    def live(self, leases):
        return set(leases)


def test_a_loop_turn_reads_a_bounded_number_of_untrusted_connections_and_starves_none():
    """32 untrusted connections' requests all arrive while the loop is busy
    (a trusted connection's call holds it): the turns after read at most
    ``UNTRUSTED_READS_PER_TURN`` of them each (before: all 32 in one turn,
    4 MiB of 4,096-lease calls to decode ahead of the trusted connections'
    next requests), and every one is answered."""
    n = 32
    handler = StallingHandler()
    limits = ConnectionLimits(max_connections=64, max_per_source=64, max_untrusted=64, max_untrusted_per_source=64,
                              opening_deadline_s=3600.0)
    hello = wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32))
    with SideChannelServer(handler, "127.0.0.1", 0, limits=limits) as server:
        trusted = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        _exchange(trusted, hello)
        assert _exchange(trusted, wire.Renew(wire.PROTOCOL_VERSION, [lease(1)])).statuses == [HELD]
        assert server.stats.trusted == 1
        flood = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(n)]
        for sock in flood:
            _exchange(sock, hello)
        stall = lease(2, "stall")
        trusted.sendall(frame(wire.Renew(wire.PROTOCOL_VERSION, [stall])))
        assert handler.stalled.wait(20)
        for i, sock in enumerate(flood):
            sock.sendall(frame(wire.Renew(wire.PROTOCOL_VERSION, [lease(100 + i)])))
        reads: list[int] = [0]  # untrusted reads per loop turn
        select, on_readable = server._selector.select, server._on_readable

        def counted_select(timeout=None):
            reads.append(0)
            return select(timeout)

        def counted_read(conn):
            reads[-1] += not conn.trusted
            return on_readable(conn)

        server._selector.select, server._on_readable = counted_select, counted_read  # the loop is held
        handler.go.set()
        for sock in flood:
            body = framing.recv_frame(sock, wire.MAX_REPLY_BYTES, "test", deadline=time.monotonic() + 20)
            assert body is not None and wire.decode_reply(body).statuses == [HELD]
        assert sum(reads) >= n
        assert max(reads) <= getattr(sidechannel, "UNTRUSTED_READS_PER_TURN", 4), reads
        for sock in [trusted, *flood]:
            sock.close()
