"""The side channel under floods: per-source and untrusted limits decided at
accept, the opening deadline, trust (AUTH with a secret, a live lease
without), bounded logging and the refusal messages. Sockets on loopback;
attacker sockets bound to 127.0.0.2 / 127.0.0.3 (loopback routes all of
127/8). No assertion on time: deadlines are small, waits are bounded."""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time

import pytest
from rdma_testutil import frame, wait_until

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma import auth, framing, wire, wiregeom
from rdma_kv.connector.rdma.admission import FD_RESERVE, Admission, ConnectionLimits
from rdma_kv.connector.rdma.lograte import EventSummary
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

SECRET = b"flood-test-secret-0123456789abcdef"
COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])
SERVER_LOGGER = "rdma_kv.connector.rdma.sidechannel"
LONG = 3600.0  # a deadline that never passes during a test
SHORT = 1.0
"""A deadline a test waits to see pass. Not shorter: the test's own exchanges
(client and server share this process and its GIL) must finish before it,
and 0.3 s was within reach of one stall on a loaded host."""


class Handler:
    """HANDSHAKE answered; a lease whose request id starts with "gone" is GONE, others HELD."""

    def on_handshake(self, request):
        geometry = wire.GeometryWire([wiregeom.RegionWire(4096, 4096)], [])
        return wire.HandshakeReply(wire.PROTOCOL_VERSION, "P", wire.RankInfo(0, 1, 8), COMPAT, COMPAT.compat_hash(), b"md", geometry)

    def on_renew(self, request):
        return wire.LeaseReply([wire.LeaseStatus.GONE if lease.request_id.startswith("gone")
                                else wire.LeaseStatus.HELD for lease in request.leases], 5.0)

    on_confirm = on_release = on_renew

    def live(self, leases):
        return set(leases)  # every lease it answered HELD lives


def limits(**kw):
    base = dict(max_connections=16, max_per_source=8, max_untrusted=8, max_untrusted_per_source=2,
                opening_deadline_s=LONG)
    return ConnectionLimits(**{**base, **kw})


def server(secret=False, **kw):
    log = {k: kw.pop(k) for k in ("log_burst", "log_window_s", "io_timeout_s", "idle_timeout_s") if k in kw}
    return SideChannelServer(Handler(), "127.0.0.1", 0, limits=limits(**kw),
                             secret=auth.Secret(SECRET, "test") if secret else None, **log)


def connect(srv, source="127.0.0.2"):
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", srv.port))
    return sock


def exchange(sock, message):
    sock.sendall(frame(message))
    body = framing.recv_frame(sock, wire.MAX_REPLY_BYTES, "test", deadline=time.monotonic() + 10)
    assert body is not None, f"the server closed the connection instead of answering {message!r:.80}"
    return wire.decode_reply(body)


def hello(sock):
    reply = exchange(sock, wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32)))
    assert isinstance(reply, wire.Challenge), reply
    return reply


def renew(request_id="r"):
    return wire.Renew(wire.PROTOCOL_VERSION, [wire.LeaseWire(1, 1, request_id, b"t" * 16, b"b" * 16, b"c" * 16)])


def handshake():
    return wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 8), COMPAT)


def closed_by_server(sock, timeout_s=20.0):
    """True once the server has closed ``sock`` (EOF or reset), False if it
    is still open after ``timeout_s`` (a bound, not a measurement)."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def refused(srv, source="127.0.0.2"):
    """True when a new connection from ``source`` is reset or closed without
    a byte (the kernel completes the TCP handshake; the accept loop resets it,
    sometimes before ``connect`` returns)."""
    try:
        sock = connect(srv, source)
    except ConnectionResetError:
        return True
    with sock:
        return closed_by_server(sock)


def authenticate(sock):
    """HELLO, CHALLENGE, AUTH, AUTH_OK with the right secret."""
    client_nonce = os.urandom(32)
    challenge = exchange(sock, wire.Hello(wire.PROTOCOL_VERSION, "consumer", client_nonce))
    secret = auth.Secret(SECRET, "test")
    proof = auth.client_proof(secret, challenge.nonce, client_nonce, wire.PROTOCOL_VERSION, "consumer")
    assert isinstance(exchange(sock, wire.Auth(wire.PROTOCOL_VERSION, proof)), wire.AuthOk)


# --- admission at accept: the newcomer evicts, the door cannot be held -------------------------


def test_a_source_over_its_untrusted_budget_evicts_its_own_oldest_while_another_is_served():
    with server(max_untrusted_per_source=2) as srv:
        held = [connect(srv), connect(srv)]
        wait_until(lambda: srv.stats.connections == 2, what="both admitted")
        newest = connect(srv)
        try:
            assert closed_by_server(held[0]), "the source's oldest untrusted connection was not evicted"
            assert srv.stats.evicted_untrusted_per_source == 1
            for sock in (held[1], newest):  # the others were not touched
                assert isinstance(hello(sock), wire.Challenge)
            client = SideChannelClient("127.0.0.1", srv.port, retries=0)  # another source: served
            try:
                assert isinstance(client.handshake(handshake()), wire.HandshakeReply)
            finally:
                client.close()
        finally:
            for sock in (*held, newest):
                sock.close()


def test_a_full_untrusted_budget_evicts_the_flooders_connection_not_the_lone_consumers():
    with server(max_untrusted=3, max_untrusted_per_source=2) as srv:
        lone = connect(srv, "127.0.0.3")  # the oldest, but its source holds one
        flood = [connect(srv), connect(srv)]  # 127.0.0.2 holds two
        wait_until(lambda: srv.stats.connections == 3, what="three admitted")
        late = connect(srv, "127.0.0.4")
        try:
            assert closed_by_server(flood[0]), "the flooder's oldest connection was not evicted"
            assert srv.stats.evicted_untrusted_total == 1
            for sock in (lone, flood[1], late):
                assert isinstance(hello(sock), wire.Challenge)
        finally:
            for sock in (lone, *flood, late):
                sock.close()


def test_per_source_budget_counts_trusted_connections_and_refuses_only_when_all_are_active():
    with server(max_per_source=2, max_untrusted_per_source=2, evict_idle_s=LONG) as srv:
        a, b = connect(srv), connect(srv)
        for sock in (a, b):
            hello(sock)
            exchange(sock, renew())  # trusted by a live lease
        try:
            assert srv.stats.trusted == 2
            assert refused(srv)  # both active within evict_idle_s: the source is at its budget
            assert srv.stats.refused_per_source == 1
            assert isinstance(exchange(a, handshake()), wire.HandshakeReply)
        finally:
            for sock in (a, b):
                sock.close()


@pytest.mark.parametrize("kind", ["idle", "slowloris"])
def test_an_insiders_trusted_connections_cannot_hold_the_door(kind):
    # An authenticated peer fills the server with trusted connections that
    # sit idle, or dribble a frame that never completes (slowloris after AUTH:
    # evictable as stalled however recently it connected).
    bounds = dict(evict_idle_s=0.2, evict_stalled_s=LONG) if kind == "idle" else dict(evict_idle_s=LONG,
                                                                                       evict_stalled_s=0.2)
    with server(secret=True, max_connections=4, max_untrusted=4, max_per_source=4, max_untrusted_per_source=4,
                **bounds) as srv:
        hog = [connect(srv, "127.0.0.2") for _ in range(4)]
        for sock in hog:
            authenticate(sock)
            if kind == "slowloris":
                sock.sendall(frame(renew())[:3])
        wait_until(lambda: srv.stats.authenticated == 4, what="the insider's connections")
        time.sleep(0.4)  # idle (or stalled) past its bound (the outcome does not depend on how far)
        legit = connect(srv, "127.0.0.1")
        try:
            authenticate(legit)
            assert isinstance(exchange(legit, handshake()), wire.HandshakeReply)
            assert srv.stats.evicted_full == 1 and closed_by_server(hog[0])
        finally:
            for sock in (*hog, legit):
                sock.close()


def test_a_frame_started_after_auth_must_arrive_whole_in_time():
    with server(secret=True, io_timeout_s=0.3) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            authenticate(sock)
            sock.sendall(frame(renew())[:5])
            assert closed_by_server(sock), "a trusted connection held a half frame open"
            wait_until(lambda: srv.stats.closed_slow == 1, what="counted as slow")
        finally:
            sock.close()


def test_an_idle_trusted_connection_is_closed_at_the_idle_timeout():
    with server(secret=True, idle_timeout_s=SHORT) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            authenticate(sock)
            assert isinstance(exchange(sock, handshake()), wire.HandshakeReply)
            assert closed_by_server(sock)
            wait_until(lambda: srv.stats.closed_idle == 1, what="counted as idle")
        finally:
            sock.close()


# --- trust without a secret: earned by a live lease only -----------------------------------


class LeaseHandler(Handler):
    """Answers HELD for request ids starting "held", PENDING for "pending";
    ``table`` is what the lease table holds. ``looks`` counts the looks at
    it (each takes a real table's lock once), ``lock`` makes a change of
    the table and a reset of the count one step for the server's loop."""

    def __init__(self):
        self.table = set()
        self.looks = 0
        self.lock = threading.Lock()

    def on_renew(self, request):
        out = []
        for lease in request.leases:
            status = (wire.LeaseStatus.HELD if lease.request_id.startswith("held")
                      else wire.LeaseStatus.PENDING if lease.request_id.startswith("pending")
                      else wire.LeaseStatus.GONE)
            out.append(status)
        return wire.LeaseReply(out, 5.0)

    on_confirm = on_release = on_renew

    def live(self, leases):
        with self.lock:
            self.looks += 1
            return {lease for lease in leases if lease in self.table}


def lease_server(handler, **kw):
    return SideChannelServer(handler, "127.0.0.1", 0, limits=limits(**kw))


@pytest.mark.parametrize("answer", ["pending", "held but not live"])
def test_no_trust_from_pending_or_from_a_lease_the_table_does_not_hold(answer):
    handler = LeaseHandler()
    with lease_server(handler, opening_deadline_s=SHORT) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            hello(sock)
            rid = "pending-1" if answer == "pending" else "held-1"  # (1, 1) is not in handler.table
            exchange(sock, renew(rid))
            assert srv.stats.trusted == 0
            assert closed_by_server(sock), "an unproven connection outlived its opening deadline"
        finally:
            sock.close()


def test_trust_from_a_live_lease_ends_with_the_lease():
    handler = LeaseHandler()
    handler.table.add((1, 1))
    with lease_server(handler, opening_deadline_s=SHORT) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            hello(sock)
            assert exchange(sock, renew("held-1")).statuses == [wire.LeaseStatus.HELD]
            assert srv.stats.trusted == 1
            handler.table.clear()  # the lease ended (released, expired)
            wait_until(lambda: srv.stats.untrusted_again == 1, what="trust withdrawn")
            assert closed_by_server(sock), "trust outlived the lease that proved it"
            assert srv.stats.closed_at_deadline == 1
        finally:
            sock.close()


def held_leases(generations):
    return wire.Renew(wire.PROTOCOL_VERSION, [wire.LeaseWire(1, g, f"held-{g}", b"t" * 16, b"b" * 16, b"c" * 16)
                                              for g in generations])


def test_when_proven_leases_end_the_trust_check_looks_at_the_table_once_per_connection():
    """Connections that proved many leases (a busy consumer rank proves one or
    more a load, for minutes): when the leases end, the trust check takes the
    lease table's lock once for the vouchers and once per connection, not
    once per lease each proved (150 such connections stalled the loop for a
    second, every time a voucher ended), and a proof it found dead is never
    looked at again. Counts only."""
    handler = LeaseHandler()
    conns, shared = 3, range(1, 200)
    stays = 500  # proven last by every connection: it outlives the rest
    handler.table |= {(1, g) for g in [*shared, stays]}
    with lease_server(handler) as srv:
        socks = []
        try:
            for _ in range(conns):  # one at a time: two untrusted per source at most
                sock = connect(srv, "127.0.0.1")
                socks.append(sock)
                hello(sock)
                assert set(exchange(sock, held_leases(shared)).statuses) == {wire.LeaseStatus.HELD}
                exchange(sock, held_leases([stays]))
            assert srv.stats.trusted == conns
            with handler.lock:  # every lease but one ends
                handler.table = {(1, stays)}
                handler.looks = 0
            # the check after it: the vouchers (one look), then each connection's proofs (one each)
            wait_until(lambda: handler.looks >= 1 + conns, what="the trust check")
            time.sleep(0.2)  # what a check that took more would have taken
            assert srv.stats.untrusted_again == 0, "the lease proven last did not take over"
            assert handler.looks <= 2 * (1 + conns) + 5, (
                f"{handler.looks} looks at the lease table: one per lease the {conns} connections proved")
            with handler.lock:  # the last one ends
                handler.table = set()
                handler.looks = 0
            wait_until(lambda: srv.stats.untrusted_again == conns, what="trust withdrawn")
            assert handler.looks == 1, (f"{handler.looks} looks at the lease table: the proofs found dead "
                                        "at the last check were looked at again")
        finally:
            for sock in socks:
                sock.close()


# --- the opening deadline ------------------------------------------------------------------


@pytest.mark.parametrize("opening", ["nothing", "half a header", "hello", "hello+renew of a gone lease"])
def test_an_untrusted_connection_is_closed_at_the_opening_deadline(opening):
    with server(opening_deadline_s=SHORT) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            if opening == "half a header":
                sock.sendall(frame(renew())[:2])
            elif opening != "nothing":
                hello(sock)
            if opening == "hello+renew of a gone lease":
                assert exchange(sock, renew("gone-1")).statuses == [wire.LeaseStatus.GONE]
            assert closed_by_server(sock), f"an untrusted connection ({opening}) outlived the deadline"
            wait_until(lambda: srv.stats.closed_at_deadline == 1, what="the deadline counted")
            assert srv.stats.trusted == 0
        finally:
            sock.close()


@pytest.mark.parametrize("secret", [False, True])
def test_a_trusted_connection_survives_the_opening_deadline(secret):
    deadline_s = SHORT
    with server(secret=secret, opening_deadline_s=deadline_s) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            if secret:
                authenticate(sock)  # trusted by AUTH
            else:
                hello(sock)
                assert exchange(sock, renew()).statuses == [wire.LeaseStatus.HELD]  # trusted by a lease
            time.sleep(2 * deadline_s)  # well past the deadline (the assertion does not depend on how far)
            assert isinstance(exchange(sock, handshake()), wire.HandshakeReply)
            assert srv.stats.closed_at_deadline == 0 and srv.stats.trusted == 1
        finally:
            sock.close()


def test_a_client_reconnects_after_its_untrusted_connection_was_closed():
    with server(opening_deadline_s=SHORT) as srv:
        client = SideChannelClient("127.0.0.1", srv.port, retries=2)
        try:
            assert client.lease_call(renew("gone-1")).statuses == [wire.LeaseStatus.GONE]  # proves nothing
            wait_until(lambda: srv.stats.closed_at_deadline == 1, what="the deadline closing it")
            assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]  # on a new connection
            assert srv.stats.connections == 2
        finally:
            client.close()


# --- a HANDSHAKE ends the opening; an idle bound follows -------------------------------------


def test_a_consumer_that_handshook_is_served_past_the_opening_deadline_on_the_same_connection(caplog):
    """Without a secret, a consumer connects ahead of its first load (the
    scheduler's ``connects``): its HANDSHAKE ends the opening, so the
    connection is neither closed at the opening deadline nor logged."""
    caplog.set_level(logging.DEBUG, logger=SERVER_LOGGER)
    with server(opening_deadline_s=SHORT, handshake_idle_s=LONG) as srv:
        client = SideChannelClient("127.0.0.1", srv.port, retries=2)
        try:
            assert isinstance(client.handshake(handshake()), wire.HandshakeReply)
            assert srv.counts() == (1, 1)  # still untrusted: within the untrusted budgets
            # A HELLO-only connection opened after it has a later opening
            # deadline: once the server closed that one, the consumer's
            # deadline has passed too (no sleep to guess).
            control = connect(srv, "127.0.0.1")
            with control:
                hello(control)
                assert closed_by_server(control), "a HELLO-only connection outlived its opening deadline"
            wait_until(lambda: srv.stats.closed_at_deadline >= 1, what="the control's closure counted")
            assert srv.stats.closed_at_deadline == 1, "the consumer's connection was closed at the opening deadline"
            assert client.lease_call(renew()).statuses == [wire.LeaseStatus.HELD]
            stats = srv.stats
            assert stats.connections == 2, "the consumer had to reconnect: its connection was closed"
            assert stats.closed_at_deadline == 1 and stats.closed_idle == 0 and stats.trusted == 1
        finally:
            client.close()
    assert not [r for r in caplog.records if r.levelno >= logging.DEBUG and "127.0.0.1" in r.getMessage()
                and "handshook" in r.getMessage()]


class RefusingHandshakes(Handler):
    def on_handshake(self, request):
        return wire.Refused("compat mismatch")


@pytest.mark.parametrize("answered", [True, False], ids=["answered", "refused"])
def test_a_connection_that_handshook_is_closed_once_idle_and_one_refused_at_the_opening_deadline(answered, caplog):
    """An answered HANDSHAKE ends the opening; the idle bound then closes the
    connection (counted, logged at DEBUG). A refused one does not end it."""
    caplog.set_level(logging.DEBUG, logger=SERVER_LOGGER)
    short, counter = SHORT, "closed_idle" if answered else "closed_at_deadline"
    bounds = dict(opening_deadline_s=LONG, handshake_idle_s=short) if answered else \
        dict(opening_deadline_s=short, handshake_idle_s=LONG)
    with SideChannelServer(Handler() if answered else RefusingHandshakes(), "127.0.0.1", 0,
                           limits=limits(**bounds)) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            hello(sock)
            reply = exchange(sock, handshake())
            assert isinstance(reply, wire.HandshakeReply if answered else wire.Refused), reply
            assert closed_by_server(sock), f"a connection whose HANDSHAKE was {reply!r:.40}, then idled, stayed open"
            wait_until(lambda: getattr(srv.stats, counter) == 1, what=f"the closure counted as {counter}")
            assert srv.stats.closed_idle + srv.stats.closed_at_deadline == 1 and srv.stats.trusted == 0
            assert srv.counts() == (0, 0)
        finally:
            sock.close()
    closures = [r for r in caplog.records if r.name == SERVER_LOGGER and "handshook" in r.getMessage()]
    if answered:
        assert len(closures) == 1 and closures[0].levelno == logging.DEBUG, closures
        assert "handshake_idle_s" in closures[0].getMessage()
    else:
        assert not closures


# --- logging and messages ------------------------------------------------------------------


def test_a_burst_of_evictions_logs_a_bounded_number_of_lines(caplog):
    caplog.set_level(logging.WARNING, logger=SERVER_LOGGER)
    with server(max_untrusted_per_source=1, log_burst=2, log_window_s=LONG) as srv:
        socks = [connect(srv) for _ in range(61)]  # each newcomer evicts the one before it
        try:
            wait_until(lambda: srv.stats.evicted_untrusted_per_source == 60, what="the evictions")
        finally:
            for sock in socks:
                sock.close()
    lines = [r.getMessage() for r in caplog.records if r.name == SERVER_LOGGER]
    assert len(lines) == 2, lines
    assert all("evicted ('127.0.0.2'" in line and "untrusted per source budget was full" in line
               for line in lines)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_event_summary_logs_a_burst_per_reason_then_one_line_with_counts_and_top_sources(caplog):
    log = logging.getLogger("test.event_summary")
    clock = Clock()
    events = EventSummary(log, "side channel x", "connections refused or closed", burst=2, window_s=10.0,
                          top=2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.event_summary"):
        for i in range(1000):
            events.event("untrusted_per_source", "10.0.0.9", "refused %d", i)
        for i in range(30):
            events.event("opening_deadline", f"10.0.1.{i % 3}", "closed %d", i)
        assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1", "closed 0", "closed 1"]
        events.flush()
        assert len(caplog.records) == 4  # the window has not ended
        clock.t += 10.0
        events.flush()
        events.flush()  # reported once
        lines = [r.getMessage() for r in caplog.records]
        assert lines[4:] == ["side channel x: 1030 connections refused or closed in the last 10 s (1026 not "
                             "logged one by one): untrusted_per_source 1000, opening_deadline 30; top sources: "
                             "10.0.0.9 (1000), 10.0.1.0 (10)"]
        for minute in range(6):  # the flood goes on: one line per window, nothing in full
            clock.t += 1.0
            for i in range(500):
                events.event("untrusted_per_source", "10.0.0.9", "refused %d", i)
            clock.t += 10.0
            events.flush()
        assert len(caplog.records) == 5 + 6
        assert all(r.getMessage().startswith("side channel x: 500 connections") for r in caplog.records[5:])
        clock.t += 60.0  # quiet for longer than a window: the next incident is logged in full again
        events.event("auth_failed", "10.0.0.5", "wrong proof")
        assert caplog.records[-1].getMessage() == "wrong proof"


def test_event_summary_is_silent_when_nothing_was_held_back(caplog):
    clock = Clock()
    events = EventSummary(logging.getLogger("test.event_summary2"), "x", "events", burst=2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.event_summary2"):
        events.event("a", "s", "one")
        clock.t += 60
        events.flush()
    assert [r.getMessage() for r in caplog.records] == ["one"]


@pytest.mark.parametrize("answer, says", [
    (wire.Auth(99, b"x" * 32), f"sent AUTH for side-channel protocol version 99; this producer expects "
                               f"version {wire.PROTOCOL_VERSION}"),
    (renew(), "sent RENEW instead of AUTH"),
])
def test_a_wrong_auth_is_refused_naming_what_was_wrong(answer, says):
    with server(secret=True) as srv:
        sock = connect(srv, "127.0.0.1")
        try:
            hello(sock)
            reply = exchange(sock, answer)
            assert isinstance(reply, wire.Refused) and says in reply.reason, reply
            assert srv.stats.auth_failures == 1
        finally:
            sock.close()


# --- the limits themselves -----------------------------------------------------------------


@pytest.mark.parametrize("kw, says", [
    ({"max_untrusted": 0}, "max_untrusted must be >= 1"),
    ({"max_untrusted": 20}, "exceeds max_connections"),
    ({"max_untrusted_per_source": 9}, "exceeds max_per_source"),
    ({"opening_deadline_s": 0}, "opening_deadline_s must be > 0"),
    ({"handshake_idle_s": 0}, "handshake_idle_s must be > 0"),
])
def test_inconsistent_limits_are_refused(kw, says):
    with pytest.raises(ConfigError, match=says):
        limits(**kw)


@pytest.mark.parametrize("hard, most", [(4096, 4096 - FD_RESERVE), (1024, 256), (resource.RLIM_INFINITY, None)])
def test_side_channel_max_connections_past_the_file_descriptor_limit_is_refused(monkeypatch, hard, most):
    """More connections than the hard file-descriptor limit leaves after the
    reserve (or than the default's floor, 256, if that is more) would run
    the process out of descriptors: refused when a producer's settings are
    read. The soft limit (a shell's ulimit -n of 1,024 here) is the
    server's to raise, and a consumer serves no side channel: neither
    refuses anything (a review of the first version, which refused both)."""
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, hard))

    def settings(n, role="kv_producer"):
        return RdmaSettings.from_config(KVTransferConfig(
            kv_connector="RdmaKVConnector", kv_role=role, engine_id="p", kv_port=0,
            kv_connector_extra_config={"side_channel_max_connections": n}))

    assert settings(0).side_channel_max_connections == 0  # sized from the limit
    assert settings(1 << 20, "kv_consumer").side_channel_max_connections == 1 << 20
    if most is None:
        assert settings(1 << 20).side_channel_max_connections == 1 << 20
        return
    assert settings(most).side_channel_max_connections == most
    with pytest.raises(ConfigError, match=f"side_channel_max_connections={most + 1} exceeds what this "
                                          f"process's file-descriptor limit allows: the hard RLIMIT_NOFILE "
                                          f"\\(ulimit -Hn\\) is {hard} .* so at most {most}; raise the limit"):
        settings(most + 1)


def test_a_producer_raises_its_soft_file_descriptor_limit_for_the_connections_it_serves(monkeypatch):
    from rdma_kv.connector.rdma import admission

    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1 << 20))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append(limits))
    admission.raise_fd_limit(4096)
    assert calls == [(4096 + FD_RESERVE, 1 << 20)]
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 2048))
    admission.raise_fd_limit(4096)
    assert calls == [(2048, 2048)]  # as far as the hard limit goes
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (65535, 1 << 20))
    admission.raise_fd_limit(4096)
    assert calls == []  # enough already


class Member:
    def __init__(self, source, now=0.0):
        self.source, self.trusted, self.last_active, self.frame_started = source, False, now, None


def test_admission_counts_return_to_zero():
    adm = Admission(limits(max_untrusted_per_source=1, max_per_source=2, evict_idle_s=LONG))
    first = Member("a")
    assert adm.plan("a", 0.0) == ([], None)
    adm.enter(first)
    victims, refusal = adm.plan("a", 0.0)
    assert refusal is None and victims == [(first, "untrusted_per_source")]
    adm.trust(first)
    assert adm.plan("a", 0.0) == ([], None)  # trusted ones do not count against the untrusted budget
    second = Member("a")
    adm.enter(second)
    assert adm.plan("a", 0.0) == ([(second, "per_source")], None)  # its own untrusted one goes first
    adm.trust(second)
    assert adm.plan("a", 0.0)[1][0] == "per_source"  # both trusted and active: refused
    assert adm.counts() == (2, 0) and first.trusted and second.trusted
    adm.leave(first)
    adm.leave(second)
    assert adm.counts() == (0, 0) and adm.sources() == 0
