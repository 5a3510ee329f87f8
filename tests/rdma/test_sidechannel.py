"""The side channel: framing, schema checks, bounded failures (sockets on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading
import time

import msgspec
import pytest

from netutil import free_port
from rdma_testutil import frame, wait_until

from rdma_kv.connector.rdma import framing, wire
from rdma_kv.connector.rdma.sidechannel import ACCEPT_PAUSE_S, SideChannelServer
from rdma_kv.connector.rdma.sideclient import URGENT_WAIT_S, SideChannelClient
from rdma_kv.errors import HandshakeError, MetadataError, PeerError, PeerTimeout

pytestmark = pytest.mark.timeout(30)


class Handler:
    def __init__(self):
        self.calls = []

    def on_handshake(self, request):
        return wire.Refused("not today")

    def on_renew(self, request):
        self.calls.append(request)
        return wire.LeaseReply([wire.LeaseStatus.HELD] * len(request.leases), 5.0)

    on_confirm = on_release = on_renew

    def live(self, leases):
        return set(leases)  # every lease it answered HELD lives


@pytest.fixture
def server():
    with SideChannelServer(Handler(), "127.0.0.1", 0) as srv:
        yield srv


def renew(n=1):
    return wire.Renew(wire.PROTOCOL_VERSION, [wire.LeaseWire(1, i + 1, f"r{i}", b"t" * 16, b"b" * 16, b"c" * 16) for i in range(n)])


def test_round_trip_and_refusal(server):
    client = SideChannelClient("127.0.0.1", server.port)
    try:
        assert client.lease_call(renew(3)).statuses == [wire.LeaseStatus.HELD] * 3
        compat = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])
        with pytest.raises(HandshakeError, match="refused the handshake: not today"):
            client.handshake(wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 8), compat))
        bad_version = wire.Renew(99, [])
        assert isinstance(client.call(bad_version), wire.Refused)
    finally:
        client.close()


def raw_exchange(port, payload):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        body = framing.recv_frame(sock, wire.MAX_REPLY_BYTES, "test", deadline=time.monotonic() + 5)
        return None if body is None else wire.reply_decoder.decode(body)


@pytest.mark.parametrize("payload", [
    struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # not msgpack
    struct.pack(">I", 3) + msgspec.msgpack.encode({"type": "renew"})[:3],
    struct.pack(">I", 12) + msgspec.msgpack.encode({"type": "nope", "x": 1}).ljust(12, b"\0"),
    struct.pack(">I", wire.MAX_REQUEST_BYTES + 1),  # refused before reading the body
])
def test_malformed_frames_get_an_error_and_the_server_keeps_serving(server, payload):
    reply = raw_exchange(server.port, payload)
    assert isinstance(reply, wire.ErrorReply)
    client = SideChannelClient("127.0.0.1", server.port)
    assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]
    client.close()
    assert server.stats.bad_frames >= 1


class OutOfDescriptors:
    """A server's listening socket whose accept() fails with EMFILE (the
    process's descriptors used up) while ``out`` is set; counts the tries."""

    def __init__(self, sock):
        self._sock, self.out, self.tries = sock, True, 0

    def fileno(self):
        return self._sock.fileno()

    def accept(self):
        self.tries += 1
        if self.out:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self._sock.accept()

    def close(self):
        self._sock.close()


def test_accepting_pauses_while_the_process_is_out_of_file_descriptors():
    """accept() failing with EMFILE leaves the connection queued and the
    listener readable: the loop stops watching the listener for
    ACCEPT_PAUSE_S at a time instead of trying again at once (it spun at
    100% CPU, holding the GIL against the engine thread, until a descriptor
    freed), and takes the connection once one is free. Counts only."""
    with SideChannelServer(Handler(), "127.0.0.1", 0) as srv:
        listener = srv._sock = OutOfDescriptors(srv._sock)
        start = time.monotonic()
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)  # queued: the kernel accepts it
        try:
            wait_until(lambda: listener.tries >= 3, timeout_s=20, what="accept() tried")
            time.sleep(0.5)
            tries, elapsed = listener.tries, time.monotonic() - start
            assert tries <= 2 + elapsed / ACCEPT_PAUSE_S, f"{tries} accept() calls in {elapsed:.2f} s: the loop spins"
            assert srv.stats.accept_paused >= tries - 1 and srv.stats.connections == 0
            listener.out = False  # a descriptor frees: the queued connection is taken and served
            sock.sendall(frame(wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32))))
            body = framing.recv_frame(sock, wire.MAX_REPLY_BYTES, "test", deadline=time.monotonic() + 10)
            assert isinstance(wire.decode_reply(body), wire.Challenge)
            assert srv.stats.connections == 1
        finally:
            sock.close()


def test_unreachable_peer_fails_within_bounds():
    port = free_port()  # nothing listens there (outside the ephemeral range: no client's port either)
    client = SideChannelClient("127.0.0.1", port, connect_timeout_s=30.0, rpc_timeout_s=30.0, retries=1)
    client.down_s = 30.0  # (the second call below comes within it, however late this thread runs)
    t0 = time.monotonic()
    # Refused: nobody listens, so no waiting out connect_timeout_s (the
    # producer died; a consumer must learn it at once). Long timeouts, so
    # that waiting either out could not pass for "at once" on a slow host.
    with pytest.raises(PeerError, match=r"unreachable after 2 attempts in .*Connection refused"):
        client.lease_call(renew())
    assert time.monotonic() - t0 < 10
    with pytest.raises(PeerError, match="is down"):  # fails fast while marked down
        client.lease_call(renew())
    assert time.monotonic() - t0 < 5
    client.close()


class DownLink:
    """``socket.create_connection`` on a host whose own link is down for
    ``down_s`` ("Network is unreachable", at once, as a veth that is down
    answers), then up again."""

    def __init__(self, down_s):
        self.until = time.monotonic() + down_s
        self.refused = 0
        self.real = socket.create_connection

    def __call__(self, address, *args, **kwargs):
        if time.monotonic() < self.until:
            self.refused += 1
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        return self.real(address, *args, **kwargs)


def test_a_link_that_comes_back_within_the_connect_timeout_costs_the_call_nothing(server, monkeypatch):
    """This host's link flaps for 0.3 s: each connect meets "Network is
    unreachable" at once. The call keeps trying until ``connect_timeout_s``
    (before: its three attempts were over in 0.15 s, and the CONFIRM it
    carried failed its load; ``tests/faults/test_netns.py`` flaps a real
    link)."""
    # Down for 1 s: the three attempts of before (0.15 s) meet it even when
    # this thread starts late on a loaded host (with 0.3 s, 0.16 s late left
    # two refusals).
    link = DownLink(1.0)
    monkeypatch.setattr(socket, "create_connection", link)
    client = SideChannelClient("127.0.0.1", server.port, connect_timeout_s=3.0, rpc_timeout_s=2.0, retries=2)
    t0 = time.monotonic()
    assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]
    assert time.monotonic() - t0 >= 0.3 and link.refused >= 3
    client.close()
    link = DownLink(30.0)  # down for longer: the call gives up once connect_timeout_s has passed
    monkeypatch.setattr(socket, "create_connection", link)
    client = SideChannelClient("127.0.0.1", server.port, connect_timeout_s=0.5, rpc_timeout_s=0.5, retries=2)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"unreachable after \d+ attempts in .*Network is unreachable"):
        client.lease_call(renew())
    assert 0.5 <= time.monotonic() - t0 < 2.0
    client.close()
    once = SideChannelClient("127.0.0.1", server.port, connect_timeout_s=5.0, rpc_timeout_s=0.5, retries=0)
    with pytest.raises(PeerError, match="unreachable after 1 attempts"):  # retries=0: one attempt, no window
        once.lease_call(renew())
    once.close()


class FlakyResolver:
    """``socket.getaddrinfo`` for ``name`` failing with ``code`` for
    ``down_s`` (``EAI_AGAIN`` at once: what glibc answers while no DNS
    server can be reached, as during a flap of this host's link), then
    answering 127.0.0.1."""

    def __init__(self, monkeypatch, name, down_s, code):
        self.name, self.until, self.code, self.failed = name, time.monotonic() + down_s, code, 0
        self._real = socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", self)

    def __call__(self, host, *args, **kwargs):
        if host == self.name:
            if time.monotonic() < self.until:
                self.failed += 1
                raise socket.gaierror(self.code, "name resolution failed (test)")
            host = "127.0.0.1"
        return self._real(host, *args, **kwargs)


def test_a_lookup_that_fails_for_now_is_waited_out_like_a_link_down(server, monkeypatch):
    """A producer advertised by name, during a 0.3 s flap of this host's
    link: the lookup fails at once with EAI_AGAIN, as a connect fails with
    "Network is unreachable". The call keeps trying until
    ``connect_timeout_s`` (before: its three attempts were over in 0.15 s).
    A name that does not exist is not waited out."""
    resolver = FlakyResolver(monkeypatch, "kv-prefill-0.flap.example", 1.0, socket.EAI_AGAIN)  # (as above: 1 s)
    client = SideChannelClient(resolver.name, server.port, connect_timeout_s=3.0, rpc_timeout_s=2.0, retries=2)
    assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]
    assert resolver.failed >= 3
    client.close()
    resolver = FlakyResolver(monkeypatch, "kv-prefill-0.gone.example", 30.0, socket.EAI_NONAME)
    client = SideChannelClient(resolver.name, server.port, connect_timeout_s=5.0, rpc_timeout_s=2.0, retries=2)
    with pytest.raises(PeerError, match="unreachable after 3 attempts"):
        client.lease_call(renew())
    assert resolver.failed == 3
    client.close()


class SlowProducer:
    """A producer that answers each message of a connection -- the HELLO,
    then every request -- ``delay_s`` after it came: each answer within an
    ``rpc_timeout_s`` of 2 x ``delay_s``, the opening and the call's reply
    together not."""

    def __init__(self, delay_s):
        self.delay_s, self.answered = delay_s, 0
        self.sent: list[float] = []  # when each answer went out (time.monotonic)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            for _ in range(2):
                body = framing.recv_frame(conn, 1 << 20, "slow", deadline=time.monotonic() + 10)
                if body is None:
                    return
                request = wire.decode_request(body)
                time.sleep(self.delay_s)
                if isinstance(request, wire.Hello):
                    reply = wire.Challenge(wire.PROTOCOL_VERSION, request.nonce, False)
                else:
                    reply = wire.LeaseReply([wire.LeaseStatus.HELD] * len(request.leases), 5.0)
                try:
                    framing.send_frame(conn, wire.encode(reply), deadline=time.monotonic() + 10)
                except OSError:
                    return
                self.answered += 1
                self.sent.append(time.monotonic())

    def close(self):
        self.listener.close()
        self.thread.join(10)


def test_an_attempt_is_bounded_by_connect_and_rpc_timeouts_together():
    """The opening (HELLO -> CHALLENGE) and the call's request and reply
    share the call's ``rpc_timeout_s``: an attempt ends within
    ``connect_timeout_s`` + ``rpc_timeout_s``, the bound a RENEW's worst case
    (``urgent_worst_case_s``) counts. Before, each send and each reply had
    the whole timeout, so a producer answering each message in 0.6 x the
    timeout held an attempt for 1.2 x it (and one with a shared secret, for
    up to six timeouts), and the call here succeeded."""
    producer = SlowProducer(delay_s=0.6)
    client = SideChannelClient("127.0.0.1", producer.port, connect_timeout_s=1.0, rpc_timeout_s=1.0, retries=0)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="unreachable after 1 attempts in .*timed out"):
            client.lease_call(renew())
        # The CHALLENGE went out in time; the reply could not. Counted by when
        # they went out: the reply is sent (into the closed socket) 0.2 s
        # after the call's deadline, and a loaded host may look later.
        assert len([t for t in producer.sent if t - t0 < 1.0]) == 1
    finally:
        client.close()
        producer.close()


class StallingProducer:
    """A producer that opens every connection (HELLO -> CHALLENGE) and
    answers lease calls HELD, except the ones numbered in ``stall``
    (counted from 1 over all connections): those it reads and never
    answers, as a producer starved of CPU for a while does."""

    def __init__(self, stall):
        self.stall, self.calls = set(stall), 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        while True:
            try:
                body = framing.recv_frame(conn, 1 << 20, "stalling", deadline=time.monotonic() + 30)
            except (OSError, PeerError):
                return
            if body is None:
                return
            request = wire.decode_request(body)
            if isinstance(request, wire.Hello):
                reply = wire.Challenge(wire.PROTOCOL_VERSION, request.nonce, False)
            else:
                self.calls += 1
                if self.calls in self.stall:
                    continue  # read, never answered
                reply = wire.LeaseReply([wire.LeaseStatus.HELD] * len(request.leases), 5.0)
            try:
                framing.send_frame(conn, wire.encode(reply), deadline=time.monotonic() + 10)
            except OSError:
                return

    def close(self):
        for sock in (self.listener, *self.conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (wakes the threads in accept and recv; close does not)
            sock.close()
        self.thread.join(10)


def test_a_producer_that_answered_gets_every_retry_when_it_stalls():
    """A producer that answered before and then stalls (a loaded host can
    leave its side channel unscheduled for seconds) gets the call's
    ``retries`` + 1 attempts; only a peer that never answered gets one
    retry. Before, the first timed-out attempt marked the client not
    answering and the second ended the call as if the producer had never
    answered: a CONFIRM was given up after 2 of its 3 attempts and the
    data read discarded (CI: two loaded prefills, 4.1 s)."""
    producer = StallingProducer(stall={2, 3})
    # 1 s per attempt: calls 1 and 4 must be answered within it, or the
    # producer's numbering shifts onto the calls it stalls.
    client = SideChannelClient("127.0.0.1", producer.port, connect_timeout_s=2.0, rpc_timeout_s=1.0, retries=2)
    try:
        assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]  # call 1: answered
        assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]  # attempts 2, 3 stall; 4 answers
        assert producer.calls == 4 and client.answering
    finally:
        client.close()
        producer.close()
    stranger = StallingProducer(stall={1, 2, 3})
    client = SideChannelClient("127.0.0.1", stranger.port, connect_timeout_s=2.0, rpc_timeout_s=0.3, retries=2)
    try:
        with pytest.raises(PeerError, match="unreachable after 2 attempts in .*timed out"):  # never answered
            client.lease_call(renew())
        assert stranger.calls == 2
    finally:
        client.close()
        stranger.close()


def test_a_timeout_says_whether_the_producer_answered_this_client_before():
    """``PeerTimeout.answered_before``: a producer that answered a call of
    this client, then stalls past a call's attempts, is a live producer (the
    consumer waits out its HANDSHAKE: ``peers``); so says the fast failure
    after it. A port that never answered is not."""
    producer = StallingProducer(stall={2, 3})
    client = SideChannelClient("127.0.0.1", producer.port, connect_timeout_s=2.0, rpc_timeout_s=1.0, retries=1)  # (as above)
    client.down_s = 30.0  # (the fast failure looked at below comes within it, however late this thread runs)
    try:
        assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]
        with pytest.raises(PeerTimeout, match="unreachable after 2 attempts") as stalled:
            client.lease_call(renew())
        assert stalled.value.answered_before and not client.answering
        with pytest.raises(PeerTimeout, match="is down") as down:
            client.lease_call(renew())
        assert down.value.answered_before
    finally:
        client.close()
        producer.close()
    stranger = StallingProducer(stall={1, 2})
    client = SideChannelClient("127.0.0.1", stranger.port, connect_timeout_s=2.0, rpc_timeout_s=0.3, retries=1)
    try:
        with pytest.raises(PeerTimeout) as never:
            client.lease_call(renew())
        assert not never.value.answered_before
    finally:
        client.close()
        stranger.close()


def test_an_urgent_call_waits_for_a_busy_second_connection_within_a_bound():
    """Both connections busy (a call on each, stuck): an urgent call waits
    ``URGENT_WAIT_S`` for each, then says so; ``urgent_worst_case_s`` counts
    both waits (a review found the first bound, one call's worst case,
    uncounted: 2.2 s against a figure of 1.7)."""
    client = SideChannelClient("127.0.0.1", free_port(), connect_timeout_s=0.1, rpc_timeout_s=0.1, retries=0)
    assert SideChannelClient.urgent_worst_case_s(0.1, 0.1, 0) == pytest.approx(2 * URGENT_WAIT_S + 0.2)
    assert client._first.lock.acquire() and client._spare.lock.acquire()  # two calls in flight
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="both connections stayed busy"):
            client.lease_call(renew(), urgent=True)
        assert time.monotonic() - t0 >= 2 * URGENT_WAIT_S
    finally:
        client._first.lock.release()
        client._spare.lock.release()
        client.close()


class HungResolver:
    """``socket.getaddrinfo`` for a name whose DNS server never answers (it
    returns once the test ends); other names resolve as before."""

    def __init__(self, monkeypatch, name):
        self.name, self.release, self.started = name, threading.Event(), 0
        self._real = socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", self)

    def __call__(self, host, *args, **kwargs):
        if host == self.name:
            self.started += 1
            self.release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return self._real(host, *args, **kwargs)


@pytest.fixture
def hung_resolver(monkeypatch):
    resolver = HungResolver(monkeypatch, "kv-prefill-0.hung.example")
    yield resolver
    resolver.release.set()


def test_a_name_its_dns_does_not_answer_fails_within_the_connect_bound(hung_resolver):
    """The host comes from a request's params: a name nobody answers for
    must not hold the caller (and the lease calls it owes) past
    ``connect_timeout_s`` per attempt; the lookups are capped."""
    client = SideChannelClient(hung_resolver.name, 5000, connect_timeout_s=0.3, rpc_timeout_s=0.3, retries=1)
    with pytest.raises(PeerError, match=r"was not resolved within connect_timeout_s=0.3 s .*DNS"):
        client.lease_call(renew())
    assert hung_resolver.started == 2  # both attempts looked it up, each within its bound
    client.close()
    others = [SideChannelClient(hung_resolver.name, 5000 + k, connect_timeout_s=0.2, retries=0) for k in range(3)]
    for other in others:
        with pytest.raises(PeerError):
            other.lease_call(renew())
    # RESOLVER_THREADS (4) lookups are outstanding now: the next waits for a
    # free one within its bound, and says why it got none.
    with pytest.raises(PeerError, match="4 earlier lookups of this process are still unanswered"):
        SideChannelClient("kv-prefill-1.hung.example", 5000, connect_timeout_s=0.2, retries=0).lease_call(renew())
    assert hung_resolver.started == 4


def test_a_name_is_resolved_and_its_addresses_tried(server):
    client = SideChannelClient("localhost", server.port)
    try:
        assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]
    finally:
        client.close()


def test_server_that_never_answers_times_out():
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)
        client = SideChannelClient("127.0.0.1", lst.getsockname()[1], rpc_timeout_s=0.3, retries=0)
        with pytest.raises(PeerError):
            client.lease_call(renew())
        client.close()


class _Descheduled:
    """``wire``'s clock for a reader that stops running right after its first
    ``recv`` (a process left unscheduled on a loaded host): from the second
    reading on, every reading is ``late_s`` later."""

    def __init__(self, late_s: float) -> None:
        self.late_s, self.calls = late_s, 0

    def monotonic(self) -> float:
        self.calls += 1
        return time.monotonic() + (self.late_s if self.calls > 1 else 0.0)


def test_reply_received_in_time_survives_a_reader_descheduled_past_its_deadline(monkeypatch):
    """The whole reply was in the socket before the deadline; its reader ran
    again only after it. Seen in real vLLM under load (a decode rank
    unscheduled for ~30 s): 'timed out with 0 of 118 bytes received', the
    answered PUSH then retried on a new connection. What arrived counts; only
    a reply still missing past the deadline is a timeout."""
    a, b = socket.socketpair()
    with a, b:
        body = wire.encode(wire.PushReply(wire.PushState.RUNNING, ""))
        b.sendall(struct.pack(">I", len(body)) + body)
        monkeypatch.setattr(framing, "time", _Descheduled(late_s=60.0))
        assert framing.recv_frame(a, wire.MAX_REPLY_BYTES, "reply", deadline=time.monotonic() + 10.0) == body
        # A frame that has not fully arrived by then is still a timeout, at once.
        b.sendall(struct.pack(">I", 100) + b"x" * 10)
        monkeypatch.setattr(framing, "time", _Descheduled(late_s=60.0))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="10 of 100"):
            framing.recv_frame(a, wire.MAX_REPLY_BYTES, "reply", deadline=time.monotonic() + 10.0)
        assert time.monotonic() - t0 < 5.0  # "at once": well under the 10 s deadline it must not wait out
        b.sendall(struct.pack(">I", 100) + b"x" * 10)
        b.close()
        monkeypatch.setattr(framing, "time", _Descheduled(late_s=60.0))
        with pytest.raises(PeerError):  # closed mid-frame: not a timeout
            framing.recv_frame(a, wire.MAX_REPLY_BYTES, "reply", deadline=time.monotonic() + 1.0)


def test_oversized_reply_is_refused():
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        client = SideChannelClient("127.0.0.1", lst.getsockname()[1], rpc_timeout_s=2, retries=0)
        import threading

        def evil():
            conn, _ = lst.accept()
            framing.recv_frame(conn, 1 << 20, "evil", deadline=time.monotonic() + 2)
            conn.sendall(struct.pack(">I", wire.MAX_REPLY_BYTES + 1))
            time.sleep(0.5)
            conn.close()

        t = threading.Thread(target=evil)
        t.start()
        with pytest.raises((MetadataError, PeerError)):
            client.lease_call(renew())
        t.join(5)
        client.close()


def test_compat_mismatch_names_both_sides():
    a = wire.CompatInfo(32, 16, 8, 128, "float16", "s", ["blocks_first:65536"] * 32)
    b = wire.CompatInfo(32, 32, 8, 128, "bfloat16", "s", ["blocks_first:65536"] * 32)
    diff = a.mismatches(b, mine="producer", theirs="consumer")
    (blocks,) = [line for line in diff if line.startswith("block_size: producer 16 vs consumer 32")]
    # A block-size mismatch says what happens to the request and what to set.
    assert "computed locally" in blocks and "same --block-size" in blocks
    assert "dtype: producer 'float16' vs consumer 'bfloat16'" in diff
    assert a.compat_hash() != b.compat_hash()
