"""A RENEW must reach the producer while another call to the same producer
rank is stuck, or the lease it renews lapses (its load is recomputed).

A consumer rank calls one producer rank through one ``SideChannelClient``,
and every call used to wait for the one before it: a call stuck on a
stalled connection (lost packets, a half-dead TCP connection) holds the
client for ``rpc_timeout_s`` x (``rpc_retries`` + 1), 30 s with the soak
test's settings, longer than a lease's margin past its renewal (two thirds
of its TTL). Here a proxy between the consumer and a real side channel
holds the replies of the connection in use; the producer's lease table runs
on a settable clock, so "the lease nears its TTL" needs no waiting. No
assertion on time: the bound on the RENEW's arrival is generous, and the
stalled call stays stalled until the test ends it."""

from __future__ import annotations

import socket
import threading

import pytest
from leaseutil import EPOCH, HELD, Clock, ref, table_with
from rdma_testutil import wait_until

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.lease_rpc import LeaseCalls
from rdma_kv.connector.rdma.consumer.records import LoadBook
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.producer import ProducerHandler
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.connector.types import EngineId

pytestmark = pytest.mark.timeout(120)

TTL_S = 30.0
STALL_S = 90.0
"""The stalled call's own deadline: it outlives every bound of the test."""
COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])


class StallingProxy:
    """TCP proxy to ``port``. :meth:`hold_replies` holds what the server
    sends on the connections open at that moment until :meth:`release`;
    connections opened later are forwarded as they go."""

    def __init__(self, port: int) -> None:
        self._target = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._released = threading.Event()
        self._held: list[threading.Event] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            hold = threading.Event()
            with self._lock:
                self.accepted += 1
                self._held.append(hold)
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, hold), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, hold: threading.Event | None) -> None:
        try:
            while chunk := src.recv(65536):
                if hold is not None and hold.is_set():
                    self._released.wait()
                dst.sendall(chunk)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def hold_replies(self) -> None:
        with self._lock:
            for hold in self._held:
                hold.set()

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self.release()
        self._listener.close()
        with self._lock:
            for sock in self._socks:
                sock.close()


class WatchedHandler(ProducerHandler):
    """The producer's handler over a real lease table, counting what reached it."""

    def __init__(self, table):
        super().__init__(EngineId("P"), wire.RankInfo(0, 1, 8), TTL_S, table, COMPAT, lambda: b"md", None)
        self.renews = 0
        self.confirmed = threading.Event()

    def on_renew(self, request):
        reply = super().on_renew(request)
        self.renews += 1
        return reply

    def on_confirm(self, request):
        reply = super().on_confirm(request)
        self.confirmed.set()
        return reply


@pytest.fixture
def rig():
    clock = Clock()
    table = table_with(1, 2, ttl_s=TTL_S, clock=clock)  # granted at clock.t
    handler = WatchedHandler(table)
    server = SideChannelServer(handler, "127.0.0.1", 0)
    proxy = StallingProxy(server.port)
    pool = ClientPool(lambda host, port: SideChannelClient(host, port, rpc_timeout_s=STALL_S, retries=0),
                      threads=1)  # one RPC thread: the stalled call can hold it
    settings = RdmaSettings(side_channel_host="127.0.0.1", advertise_host="127.0.0.1", side_channel_port=0)
    calls = LeaseCalls(settings, lambda address: None, pool, LoadBook(), lambda load, why: None)
    yield clock, table, handler, proxy, pool, calls
    proxy.close()
    pool.close()
    server.close()


@pytest.mark.parametrize("on", ["an RPC thread", "another thread"])
def test_a_renew_reaches_the_producer_while_another_call_to_it_is_stalled(rig, on):
    """The stalled call holds the client's connection and, ``on`` an RPC
    thread, the pool's only RPC thread too."""
    clock, table, handler, proxy, pool, calls = rig
    address = PeerAddress(EngineId("P"), "127.0.0.1", proxy.port, 1)
    lease, other = RemoteLease(address, ref(1), b"A" * 16), RemoteLease(address, ref(2), b"B" * 16)
    client = pool.get("127.0.0.1", proxy.port)
    # The first RENEW claims the lease, on the connection every call then uses.
    assert client.lease_call(wire.Renew(wire.PROTOCOL_VERSION, [lease.to_wire()])).statuses == [HELD]

    proxy.hold_replies()  # that connection stalls: no reply on it comes back
    answers = []  # another load's CONFIRM: it holds the connection
    confirm = wire.Confirm(wire.PROTOCOL_VERSION, [other.to_wire()], release=True)
    done = threading.Event()

    def stalled_call():
        answers.append(client.lease_call(confirm).statuses)
        done.set()

    if on == "an RPC thread":
        assert pool.submit(stalled_call)
    else:
        threading.Thread(target=stalled_call, daemon=True).start()
    assert handler.confirmed.wait(30), "the CONFIRM never reached the producer"

    clock.t += TTL_S * 5 / 6  # the lease nears its TTL: a renewal is overdue
    calls.renew([(0, lease)])
    try:
        wait_until(lambda: handler.renews == 2, timeout_s=30, what="the RENEW")
        reached = True
    except AssertionError:
        reached = False
    clock.t += TTL_S / 3  # past the TTL counted from the claim
    table.expire()
    held = (EPOCH, 1) in table.live([(EPOCH, 1)])
    proxy.release()
    assert done.wait(30) and answers == [[HELD]], "the stalled CONFIRM did not complete once released"
    assert reached and held, (f"the RENEW waited behind the CONFIRM stalled on {on} (one connection per "
                              "producer rank, one call at a time on it), and its lease expired")
    assert proxy.accepted == 2  # it took a second connection
    renew = wire.Renew(wire.PROTOCOL_VERSION, [lease.to_wire()])
    assert client.lease_call(renew, urgent=True).statuses == [HELD]
    assert proxy.accepted == 2  # an urgent call takes the first connection when it is free


@pytest.mark.parametrize("ttl_s, rpc_timeout_s, warned", [(30.0, 2.0, False), (2.0, 1.0, True), (6.0, 0.3, False)])
def test_a_ttl_too_short_for_a_stalled_renew_is_named_once(caplog, ttl_s, rpc_timeout_s, warned):
    """The RENEW's worst case against the margin the producer's TTL leaves
    past the renewal: a warning naming both and what to change, once per
    producer engine (the consumer learns the TTL from the params)."""
    from rdma_kv.connector.rdma.consumer.records import LoadState
    from rdma_kv.connector.rdma.meta import LoadSpec

    settings = RdmaSettings(side_channel_host="127.0.0.1", advertise_host="127.0.0.1", side_channel_port=0,
                            rpc_timeout_s=rpc_timeout_s, connect_timeout_s=rpc_timeout_s)
    calls = LeaseCalls(settings, plan=None, pool=None, book=LoadBook(), fail=None)
    peer = PeerAddress(EngineId("P"), "127.0.0.1", 1, 1)
    spec = LoadSpec("r1", ((1,),), ((1,),), peer, ref(1), ttl_s, b"c" * 16)
    worst = SideChannelClient.urgent_worst_case_s(rpc_timeout_s, rpc_timeout_s, settings.rpc_retries)
    assert (worst > ttl_s - settings.renew_interval_for(ttl_s)) is warned  # the rule, restated
    with caplog.at_level("WARNING", logger="rdma_kv.connector.rdma.consumer"):
        for _ in range(3):
            calls.check_ttl(LoadState(spec, 0.0, 0.0))
    lines = [r.getMessage() for r in caplog.records if "RENEW to a stalled producer" in r.getMessage()]
    assert len(lines) == int(warned)
    if warned:
        assert "'P'" in lines[0] and "lease_ttl_s" in lines[0] and "rpc_timeout_s=1" in lines[0]


def test_the_ttl_warnings_are_bounded_whatever_engines_the_params_name(caplog):
    """The engine id and the TTL come from a request's params, which any
    client of the decode server writes, before any handshake: a client
    naming a new engine per request grew the warned set and the log by one
    each (argued by the review of the decode's load state machine)."""
    from rdma_kv.connector.rdma.consumer import lease_rpc
    from rdma_kv.connector.rdma.consumer.records import LoadState
    from rdma_kv.connector.rdma.meta import LoadSpec

    settings = RdmaSettings(side_channel_host="127.0.0.1", advertise_host="127.0.0.1", side_channel_port=0,
                            rpc_timeout_s=1.0, connect_timeout_s=1.0)
    calls = LeaseCalls(settings, plan=None, pool=None, book=LoadBook(), fail=None)
    engines = 600
    with caplog.at_level("WARNING", logger="rdma_kv.connector.rdma.consumer"):
        for i in range(engines):
            spec = LoadSpec(f"r{i}", ((1,),), ((1,),), PeerAddress(EngineId(f"P{i}"), "127.0.0.1", 1, 1), ref(1),
                            2.0, b"c" * 16)
            calls.check_ttl(LoadState(spec, 0.0, 0.0))
    lines = [r for r in caplog.records if "RENEW to a stalled producer" in r.getMessage()]
    assert len(lines) < engines, "one warning (and one entry kept) per engine the params named"
    assert len(lines) == lease_rpc.TTL_WARNINGS == len(calls._ttl_warned)

