"""A producer address that accepts connections and never answers (a
stopped prefill, a side channel starved of CPU, or a port a client named
in its ``kv_transfer_params``) must not delay the consumer's calls to
healthy producers (``consumer.clients``: one call per address at a time,
calls to addresses not answering capped; ``sideclient``: an attempt that
times out marks the client not answering).

Before, the pool's four RPC threads were shared by every call: the first
call to a stalled rank held a thread for ``rpc_timeout_s`` x 3, and every
other call to it waited for that client's connection on a thread of its
own. A CONFIRM to a healthy producer took 6.0 s behind four RELEASEs to a
stalled rank, 15.0 s behind four handshakes to ports that never answer
(found by an adversarial review). Asserted on order, not time: the
healthy call completes while the calls to the stalled address are still
blocked."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from rdma_testutil import wait_until

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool, strangers
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.errors import HandshakeError, PeerError

pytestmark = pytest.mark.timeout(120)

STALL_S = 20.0
"""Every timeout of the calls to the stalled address: it outlives the test's wait for the healthy call."""
THREADS = 4  # the worker's default rpc_threads
COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])
HANDSHAKE = wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 8), COMPAT)


class Handler:
    """A healthy producer rank: every lease HELD; handshakes refused (an answer all the same)."""

    def on_handshake(self, request):
        return wire.Refused("not in this test")

    def on_renew(self, request):
        return wire.LeaseReply([wire.LeaseStatus.HELD] * len(request.leases), 5.0)

    on_confirm = on_release = on_renew

    def live(self, leases):
        return set(leases)


def lease(i: int) -> wire.LeaseWire:
    return wire.LeaseWire(1, i + 1, f"r{i}", b"t" * 16, b"b" * 16, b"c" * 16)


class Tarpit:
    """A port that accepts (the kernel completes the connect) and never answers; counts what connected."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        """Connects completed and not yet accepted: the calls blocked on it."""
        return _backlog(self.port)

    def close(self) -> None:
        self.sock.close()


def _backlog(port: int) -> int:
    """The accept queue length of the listener on ``port`` (Linux: /proc/net/tcp's rx_queue of a LISTEN socket)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
                return int(fields[4].split(":")[1], 16)
    return 0


@pytest.fixture
def rig():
    healthy = SideChannelServer(Handler(), "127.0.0.1", 0)
    pool = ClientPool(lambda h, p: SideChannelClient(h, p, connect_timeout_s=STALL_S, rpc_timeout_s=STALL_S,
                                                     retries=2), threads=THREADS)
    tarpits: list[Tarpit] = []
    yield pool, healthy, tarpits
    for t in tarpits:
        t.close()  # resets the connects it held: the calls blocked on it end
    pool.close()
    healthy.close()


def confirm_healthy(pool: ClientPool, healthy: SideChannelServer, done: threading.Event) -> None:
    pool.submit(lambda: pool.get("127.0.0.1", healthy.port).lease_call(
        wire.Confirm(wire.PROTOCOL_VERSION, [lease(9)], release=True)) and done.set(),
        to=("127.0.0.1", healthy.port))


def test_calls_queued_for_a_stalled_rank_hold_one_rpc_thread_not_all(rig):
    pool, healthy, tarpits = rig
    stalled = Tarpit()
    tarpits.append(stalled)
    address = ("127.0.0.1", stalled.port)
    failed = []

    def release(i: int) -> None:
        try:
            pool.get(*address).lease_call(wire.Release(wire.PROTOCOL_VERSION, [lease(i)]))
        except PeerError as exc:
            failed.append(exc)

    for i in range(THREADS * 2):  # loads that read the stalled rank ended: one RELEASE each
        assert pool.submit(release, i, to=address)
    wait_until(lambda: stalled.connections() == 1, what="the first RELEASE to reach the stalled rank")
    done = threading.Event()
    confirm_healthy(pool, healthy, done)
    assert done.wait(30), "a CONFIRM to a healthy producer waited behind RELEASEs to a stalled rank"
    assert not failed and stalled.connections() == 1, "the stalled rank's first RELEASE is still in flight"


def test_handshakes_to_ports_that_never_answer_leave_threads_for_known_producers(rig):
    """Any client of the decode server chooses the producer address in its
    ``kv_transfer_params``: handshakes to ports that accept and never answer
    run at most ``strangers(THREADS)`` at once."""
    pool, healthy, tarpits = rig
    known = pool.get("127.0.0.1", healthy.port)
    with pytest.raises(HandshakeError, match="refused the handshake"):
        known.handshake(HANDSHAKE)  # this producer answers: no stranger
    tarpits.extend(Tarpit() for _ in range(THREADS))

    def handshake(port: int) -> None:
        try:
            pool.get("127.0.0.1", port).handshake(HANDSHAKE)
        except PeerError:
            pass

    for t in tarpits:
        assert pool.submit(handshake, t.port, to=("127.0.0.1", t.port))
    limit = strangers(THREADS)
    assert limit < THREADS
    wait_until(lambda: sum(t.connections() for t in tarpits) >= limit, what="the strangers' handshakes")
    done = threading.Event()
    confirm_healthy(pool, healthy, done)
    assert done.wait(30), "a CONFIRM to a known producer waited behind handshakes to ports that never answer"
    time.sleep(0.2)  # a parked handshake would have connected by now
    assert sum(t.connections() for t in tarpits) == limit  # the others wait for one of those to end


def test_a_call_that_timed_out_leaves_the_client_down_and_not_answering():
    """A call whose attempts all timed out leaves the client down (the next
    call fails fast, without a connect) and not ``answering`` (the pool
    caps the calls to it)."""
    stalled = Tarpit()
    client = SideChannelClient("127.0.0.1", stalled.port, connect_timeout_s=2.0, rpc_timeout_s=0.2, retries=2)
    try:
        with pytest.raises(PeerError, match="unreachable after 2 attempts in .*timed out"):  # (never answered: one retry)
            client.lease_call(wire.Release(wire.PROTOCOL_VERSION, [lease(1)]))
        seen = stalled.connections()
        with pytest.raises(PeerError, match="is down"):
            client.lease_call(wire.Release(wire.PROTOCOL_VERSION, [lease(2)]))
        assert stalled.connections() == seen and not client.answering
    finally:
        client.close()
        stalled.close()


class Gate:
    """A fake client whose calls block until released; ``answering`` as set."""

    def __init__(self, answering: bool) -> None:
        self.answering = answering

    def close(self) -> None:
        pass


def test_a_producer_whose_last_attempt_timed_out_is_capped_like_a_stranger():
    """Every rank of a stopped TP engine answered before: once their
    attempts time out, their calls run ``strangers(THREADS)`` at once, not
    one per thread."""
    clients: dict[tuple[str, int], Gate] = {}
    pool = ClientPool(lambda h, p: clients.setdefault((h, p), Gate(answering=True)), threads=THREADS)
    release = threading.Event()
    running: list[int] = []
    lock = threading.Lock()

    def stalled_call(port: int) -> None:
        with lock:
            running.append(port)
        release.wait(60)

    try:
        ranks = [("10.0.0.1", 5000 + r) for r in range(THREADS)]
        for address in ranks:
            pool.get(*address).answering = False  # its last attempt timed out
            assert pool.submit(stalled_call, address[1], to=address)
        wait_until(lambda: len(running) >= strangers(THREADS), what="the capped calls")
        healthy = ("10.0.0.2", 5000)
        pool.get(*healthy)  # answering
        done = threading.Event()
        assert pool.submit(done.set, to=healthy)
        assert done.wait(30), "a call to an answering producer waited behind a stopped engine's ranks"
        assert len(running) == strangers(THREADS)
        release.set()
        wait_until(lambda: len(running) == THREADS, what="the parked calls, once places freed")
    finally:
        release.set()
        pool.close()


class Hiccup(Handler):
    """Healthy; its first RENEW is answered late (its side channel starved of CPU once)."""

    def __init__(self, late_s: float) -> None:
        self.late_s, self.renews = late_s, 0

    def on_renew(self, request):
        self.renews += 1
        if self.renews == 1:
            time.sleep(self.late_s)
        return super().on_renew(request)


def test_a_producer_slow_once_on_its_first_call_is_tried_again_and_a_tarpit_is_capped():
    """An attempt that times out is retried as any failure is: a producer
    slow once on the very first call a client makes (a load's first RENEW,
    sent beside its handshake, on a loaded host) answers the next attempt.
    A version of the pool change gave up at once on a peer that had never
    answered, and the load then failed (found by an adversarial review).
    What the timeout changes: the client is not ``answering``, so the pool
    caps the calls to it."""
    renew = wire.Renew(wire.PROTOCOL_VERSION, [lease(0)])
    # Late past the first attempt's 1 s, free 0.85 s before the second
    # attempt's deadline (a 0.3 s timeout with a 0.6 s lateness left 48 ms,
    # which a loaded host takes).
    hiccup = Hiccup(late_s=1.2)
    server = SideChannelServer(hiccup, "127.0.0.1", 0)
    tarpit = Tarpit()
    try:
        client = SideChannelClient("127.0.0.1", server.port, connect_timeout_s=5.0, rpc_timeout_s=1.0, retries=2)
        assert client.lease_call(renew).statuses == [wire.LeaseStatus.HELD] and client.answering
        stranger = SideChannelClient("127.0.0.1", tarpit.port, connect_timeout_s=5.0, rpc_timeout_s=0.2,
                                     retries=2)
        with pytest.raises(PeerError, match="unreachable after 2 attempts"):  # never answered: one retry
            stranger.lease_call(renew)
        assert not stranger.answering
        client.close()
        stranger.close()
    finally:
        tarpit.close()
        server.close()


class _Client:
    def __init__(self) -> None:
        self.answering = False

    def close(self) -> None:
        pass


def test_a_call_parked_while_its_producer_had_not_answered_starts_once_it_does():
    """A load's first RENEW, sent on the renewal threads beside its
    handshake, is a call to a stranger; parked while two calls to ports a
    client named (that never answer) hold the strangers' places, it held
    every later call to its producer behind it, the load's read pin too,
    after the handshake had answered: the load waited out its deadline
    (found by an adversarial review). A parked call now starts as soon as
    its address answers."""
    clients: dict = {}
    pool = ClientPool(lambda h, p: clients.setdefault((h, p), _Client()), threads=THREADS)
    stall = threading.Event()
    try:
        for port in (7001, 7002):  # ports a client named, that accept and never answer
            pool.get("10.9.9.9", port)
            assert pool.submit_renewal(stall.wait, 30, to=("10.9.9.9", port))
        producer = ("10.0.0.1", 5600)
        first, pin = threading.Event(), threading.Event()
        assert pool.submit_renewal(first.set, to=producer)  # the load's first RENEW: parked
        assert pool._renewals.nparked == 1

        def handshake() -> None:  # on the other set of threads: its producer answers
            pool.get(*producer).answering = True

        assert pool.submit(handshake, to=producer)
        # (a review of the first version: only a call on the RENEW's own threads unparked it)
        assert first.wait(10), "the parked RENEW did not start once its producer answered on the other threads"
        assert pool.submit_renewal(pin.set, to=producer)  # the read pin
        assert pin.wait(10), "a call to a producer that answers waited"
        assert stall.is_set() is False and pool._renewals.strangers == 2  # the strangers still hold their places
    finally:
        stall.set()
        pool.close()
