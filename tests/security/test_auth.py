"""Side-channel peer authentication: challenge-response with a shared secret.

Real sockets on 127.0.0.1 with a stub handler whose agent metadata carries a
marker, so a test can prove that a refused peer received none of it; then
the connector end to end on the fake transport (tests/rdma/fakes.py)."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time

import pytest
from fakes import FakeFabric
from rdma_testutil import decode_replies, frame, wait_until

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma import auth, framing, wire, wiregeom
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.errors import AuthenticationError, ConfigError, HandshakeError
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(60)

SECRET = b"correct horse battery staple 0123456789"
WRONG = b"incorrect mule battery staple 9876543210"
MARKER = b"AGENT-METADATA-WITH-RKEYS\xde\xad\xbe\xef"
COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])


class Handler:
    """Answers a handshake with metadata carrying MARKER; counts every call."""

    def __init__(self):
        self.calls = 0

    def on_handshake(self, request):
        self.calls += 1
        geometry = wire.GeometryWire([wiregeom.RegionWire(4096, 4096)], [])
        return wire.HandshakeReply(wire.PROTOCOL_VERSION, "P", wire.RankInfo(0, 1, 8), COMPAT, COMPAT.compat_hash(), MARKER,
                                   geometry)

    def on_renew(self, request):
        self.calls += 1
        return wire.LeaseReply([wire.LeaseStatus.HELD] * len(request.leases), 5.0)

    on_confirm = on_release = on_renew

    def live(self, leases):
        return set(leases)  # every lease it answered HELD lives


def secret(value=SECRET):
    return auth.Secret(value, "test")


@pytest.fixture
def handler():
    return Handler()


@pytest.fixture
def server(handler):
    with SideChannelServer(handler, "127.0.0.1", 0, secret=secret(), io_timeout_s=2.0) as srv:
        yield srv


def client_for(srv, value=SECRET):
    return SideChannelClient("127.0.0.1", srv.port, rpc_timeout_s=2.0, retries=1,
                             secret=None if value is None else secret(value))


def handshake():
    return wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 8), COMPAT)


def assert_no_secret_in(text):
    for needle in (SECRET, WRONG):
        assert needle.decode() not in text
        assert needle.hex() not in text


# --- the secret -------------------------------------------------------------------------


def test_secret_never_shows_its_value(tmp_path):
    s = secret()
    assert SECRET.decode() not in repr(s) and SECRET.decode() not in str(s)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(s)


def test_secret_from_env_and_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    os.chmod(path, 0o600)
    monkeypatch.setenv("RDMA_KV_TEST_SECRET", WRONG.decode())
    assert auth.load_secret(None, None) is None
    from_file = auth.load_secret(None, str(path))
    from_env = auth.load_secret("RDMA_KV_TEST_SECRET", str(path))  # the variable wins when set
    assert from_file.mac(b"x") == secret(SECRET).mac(b"x")  # trailing newline stripped
    assert from_env.mac(b"x") == secret(WRONG).mac(b"x")
    monkeypatch.delenv("RDMA_KV_TEST_SECRET")
    assert auth.load_secret("RDMA_KV_TEST_SECRET", str(path)).mac(b"x") == from_file.mac(b"x")
    with pytest.raises(ConfigError, match="unset or empty"):
        auth.load_secret("RDMA_KV_TEST_SECRET", None)
    with pytest.raises(ConfigError, match="cannot read"):
        auth.load_secret(None, str(tmp_path / "missing"))
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    with pytest.raises(ConfigError, match="at least 16"):
        auth.load_secret(None, str(short))
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        auth.load_secret(None, str(path))
    assert "readable by other users" in caplog.text
    assert_no_secret_in(caplog.text)


def test_settings_carry_only_the_source_names(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", kv_port=0,
                              kv_connector_extra_config={"auth_secret_file": str(path),
                                                         "auth_secret_env": "RDMA_KV_X"})
    settings = RdmaSettings.from_config(config)
    assert settings.auth_secret_file == str(path) and settings.auth_secret_env == "RDMA_KV_X"
    assert_no_secret_in(repr(settings))
    with pytest.raises(ConfigError, match="is empty"):
        RdmaSettings.from_config(KVTransferConfig(
            kv_connector="RdmaKVConnector", kv_role="kv_producer", kv_port=0,
            kv_connector_extra_config={"auth_secret_file": " "}))


# --- the protocol over real sockets --------------------------------------------------------


def test_right_secret_authenticates_both_ways(server, handler, caplog):
    caplog.set_level(logging.DEBUG)
    client = client_for(server)
    try:
        reply = client.handshake(handshake())
        assert reply.agent_metadata == MARKER
        assert client.lease_call(wire.Renew(wire.PROTOCOL_VERSION, [wire.LeaseWire(1, 1, "r", b"t" * 16, b"b" * 16, b"c" * 16)])).statuses
    finally:
        client.close()
    assert server.stats.authenticated == 1 and server.stats.auth_failures == 0
    assert handler.calls == 2
    assert_no_secret_in(caplog.text)


@pytest.mark.parametrize("client_secret, client_says, server_says", [
    (WRONG, "refused this consumer: authentication failed: wrong proof", "wrong proof"),
    (None, "requires a shared secret and this consumer has none", "peer has no shared secret"),
])
def test_wrong_or_missing_secret_is_refused(server, handler, caplog, client_secret, client_says,
                                            server_says):
    caplog.set_level(logging.DEBUG)
    client = client_for(server, client_secret)
    try:
        with pytest.raises(AuthenticationError, match=client_says):
            client.handshake(handshake())
    finally:
        client.close()
    def auth_warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.WARNING and "authentication failed" in r.message]

    # The server counts the failure, then logs it (on its own thread): wait for both.
    wait_until(lambda: server.stats.auth_failures == 1 and bool(auth_warnings()), timeout_s=10,
               what="the server's refusal")
    assert server.stats.auth_failures == 1
    assert handler.calls == 0, "an unauthenticated peer reached the handler"
    warnings = auth_warnings()
    assert warnings and server_says in warnings[0].message
    assert "127.0.0.1" in warnings[0].message  # the peer address
    assert_no_secret_in(caplog.text)


def test_secret_on_the_client_only_is_refused_by_the_client(handler):
    with SideChannelServer(handler, "127.0.0.1", 0) as srv:
        client = client_for(srv, SECRET)
        try:
            with pytest.raises(AuthenticationError, match="does not authenticate"):
                client.handshake(handshake())
        finally:
            client.close()
    assert handler.calls == 0


def test_retry_after_refusal_fails_fast_without_new_attempts(server):
    client = client_for(server, WRONG)
    try:
        with pytest.raises(AuthenticationError):
            client.handshake(handshake())
        with pytest.raises(HandshakeError, match="is down: .*authentication failed"):
            client.handshake(handshake())
    finally:
        client.close()
    assert server.stats.auth_failures == 1  # not retried: one refusal, one log line


def impostor_server(proof_for):
    """A 'producer' that does not know the secret: it asks for AUTH and then
    answers with whatever ``proof_for(hello, challenge_nonce)`` returns."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)

    def serve():
        conn, _ = lst.accept()
        with conn:
            hello = wire.decode_request(framing.recv_frame(conn, 1 << 20, "impostor", deadline=time.monotonic() + 5))
            nonce = auth.new_nonce()
            challenge = wire.Challenge(wire.PROTOCOL_VERSION, nonce, True)
            framing.send_frame(conn, wire.encode(challenge), deadline=time.monotonic() + 5)
            framing.recv_frame(conn, 1 << 20, "impostor", deadline=time.monotonic() + 5)
            framing.send_frame(conn, wire.encode(wire.AuthOk(proof_for(hello, nonce))), deadline=time.monotonic() + 5)
            framing.recv_frame(conn, 1 << 20, "impostor", deadline=time.monotonic() + 2)  # whatever comes next (nothing should)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return lst, thread


@pytest.mark.parametrize("how", ["random", "reflected_client_proof", "other_secret"])
def test_consumer_refuses_a_producer_that_cannot_prove_the_secret(how):
    def proof_for(hello, nonce):
        if how == "random":
            return os.urandom(32)
        if how == "reflected_client_proof":  # what the client itself computed: labels differ
            return auth.client_proof(secret(), nonce, hello.nonce, wire.PROTOCOL_VERSION, hello.role)
        return auth.server_proof(secret(WRONG), hello.nonce, nonce, wire.PROTOCOL_VERSION, hello.role)

    lst, thread = impostor_server(proof_for)
    client = SideChannelClient("127.0.0.1", lst.getsockname()[1], rpc_timeout_s=2.0, retries=0,
                               secret=secret())
    try:
        with pytest.raises(AuthenticationError, match="failed to prove it knows the shared secret"):
            client.handshake(handshake())
    finally:
        client.close()
        thread.join(5)
        lst.close()


# --- raw attackers: what does a refused peer receive? ------------------------------------


def read_all(sock, timeout_s=5.0):
    """Every byte the server sends until it closes (bounded)."""
    sock.settimeout(timeout_s)
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        data += chunk
    return bytes(data)


@pytest.mark.parametrize("attack", ["wrong_proof", "empty_proof", "skip_auth", "no_hello",
                                    "version_1_handshake"])
def test_refused_peer_receives_no_metadata(server, handler, attack):
    sent_after = frame(handshake()) + frame(wire.Renew(wire.PROTOCOL_VERSION, [wire.LeaseWire(1, 1, "r", b"t" * 16, b"b" * 16, b"c" * 16)]))
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        if attack == "no_hello":
            sock.sendall(sent_after)
        elif attack == "version_1_handshake":
            sock.sendall(frame(wire.Handshake(1, "D", wire.RankInfo(0, 1, 8), COMPAT)))
        else:
            sock.sendall(frame(wire.Hello(wire.PROTOCOL_VERSION, "consumer", auth.new_nonce())))
            if attack == "wrong_proof":
                sock.sendall(frame(wire.Auth(wire.PROTOCOL_VERSION, os.urandom(32))))
            elif attack == "empty_proof":
                sock.sendall(frame(wire.Auth(wire.PROTOCOL_VERSION, b"")))
            try:
                sock.sendall(sent_after)  # a pushy peer: it asks anyway
            except OSError:
                pass
        data = read_all(sock)
    assert MARKER not in data, "agent metadata reached an unauthenticated peer"
    kinds = [type(m).__name__ for m in decode_replies(data)]
    assert set(kinds) <= {"Challenge", "Refused"} and kinds[-1] == "Refused", kinds
    if attack == "version_1_handshake":
        assert "version 1 is not supported" in decode_replies(data)[-1].reason
    assert handler.calls == 0


# --- the connector end to end (fake transport, real side channel) ---------------------------

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=256)


def engine(fabric, role, engine_id, **extra):
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"rpc_timeout_s": 1.0, "load_timeout_s": 5.0,
                                                         "lease_ttl_s": 5.0, **extra})
    return Engine(config, SHAPE, connector_kwargs={"transport_factory": fabric.factory})


def run_pair(p, d, prompts):
    def pump():
        p.step()
        d.step()

    for rid, prompt in prompts.items():
        p.add_request(rid, prompt, {"do_remote_decode": True})
    wait_until(lambda: all(r in p.results and p.results[r].status.value == "finished" for r in prompts),
               step=pump, what="prefills")
    params = {rid: p.results[rid].kv_transfer_params for rid in prompts}
    for rid, prompt in prompts.items():
        d.add_request(rid, prompt, params[rid])
    wait_until(lambda: all(r in d.results and d.results[r].status.value in ("finished", "failed")
                           for r in prompts), step=pump, what="decodes")
    return params, {rid: d.results[rid] for rid in prompts}


@pytest.fixture
def secret_files(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for path, value in ((good, SECRET), (bad, WRONG)):
        path.write_bytes(value)
        os.chmod(path, 0o600)
    return str(good), str(bad)


@pytest.mark.parametrize("consumer", ["same_env", "same_file", "wrong_file", "none"])
def test_connector_end_to_end(secret_files, monkeypatch, caplog, consumer):
    caplog.set_level(logging.DEBUG)
    good, bad = secret_files
    monkeypatch.setenv("RDMA_KV_TEST_SECRET", SECRET.decode())
    d_extra = {"same_env": {"auth_secret_env": "RDMA_KV_TEST_SECRET"}, "same_file": {"auth_secret_file": good},
               "wrong_file": {"auth_secret_file": bad}, "none": {}}[consumer]
    fabric = FakeFabric()
    p = engine(fabric, "kv_producer", "P", auth_secret_file=good)
    d = engine(fabric, "kv_consumer", "D", **d_extra)
    try:
        prompts = {f"r{i}": list(range(1 + i, 40 + 7 * i)) for i in range(4)}
        params, results = run_pair(p, d, prompts)
        server = p.worker.worker._server
        if consumer.startswith("same"):
            for rid, r in results.items():
                assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], rid
            assert server.stats.authenticated >= 1 and server.stats.auth_failures == 0
        else:
            for rid, r in results.items():  # refused: computed locally instead
                assert r.load_failed and r.recomputed_from_block == 0, rid
            assert fabric.reads == 0
            assert server.stats.auth_failures >= 1
            assert "authentication" in caplog.text
        for value in params.values():
            assert_no_secret_in(repr(value))
        assert_no_secret_in(caplog.text)
    finally:
        p.shutdown()
        d.shutdown()
