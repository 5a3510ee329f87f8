"""Property-based fuzzing (hypothesis) of everything a peer or a client can
hand rdma-kv: side-channel frames and messages, the handshake reply and its
geometry, agent metadata, kv_transfer_params, the step metadata a worker
receives, and a live side-channel server.

Property, for every input: it parses, or it is rejected with one of
rdma-kv's errors (``RdmaKVError``: ``MetadataError``/``ConfigError``/
``DescriptorError`` are ``ValueError``\\ s; a connection closed mid-frame is a
``PeerError``) -- never another exception, never a hang (every socket wait
is bounded). After the live campaigns an honest client is still served.

Default run: derandomized (the same ~1,600 cases every time). ``-m slow``:
~8x more cases, seeded from ``RDMA_KV_FUZZ_SEED`` (printed in the summary).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import msgspec
import pytest
from fakes import FakeFabric
from fuzz_counts import COUNTS, SEEDS
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from rdma_testutil import decode_replies, frame, wait_until

from rdma_kv.connector import KVTransferConfig, Request, SchedulerOutput
from rdma_kv.connector.rdma import auth, framing, wire, wiregeom
from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress, RdmaConnectorMetadata
from rdma_kv.connector.rdma.params import PARAM_KEYS, LeaseRef, RemotePrefillParams, parse_kv_transfer_params
from rdma_kv.connector.rdma.slots import SlotTable
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.errors import ConfigError, MetadataError, PeerError, RdmaKVError
from rdma_kv.harness.engine import Engine, ModelShape
from rdma_kv.transport import metadata as agent_metadata
from rdma_kv.transport.memory import MemoryKind

pytestmark = pytest.mark.timeout(900)

SLOW_SEED = int(os.environ.get("RDMA_KV_FUZZ_SEED", random.SystemRandom().randrange(2**32)))
SEEDS["slow campaigns (RDMA_KV_FUZZ_SEED)"] = SLOW_SEED
SLOW_FACTOR = 8
COMMON = dict(database=None, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def campaign(strategies, default_n):
    """Two tests from one property: a derandomized default cut, and a slow
    campaign ``SLOW_FACTOR`` times larger seeded with ``SLOW_SEED``."""

    def make(check):
        def default(**kw):
            check(**kw)

        def slow(**kw):
            check(**kw)

        default.__name__ = default.__qualname__ = f"test_{check.__name__}"
        slow.__name__ = slow.__qualname__ = f"test_{check.__name__}_slow"
        t_default = settings(max_examples=default_n, derandomize=True, **COMMON)(given(**strategies)(default))
        t_slow = seed(SLOW_SEED)(settings(max_examples=default_n * SLOW_FACTOR, **COMMON)(
            given(**strategies)(slow)))
        return t_default, pytest.mark.slow(t_slow)

    return make


# --- strategies -----------------------------------------------------------------------------

COMPAT = wire.CompatInfo(2, 4, 2, 8, "float16", "full_attention/4", ["blocks_first:128"] * 2)
GEOMETRY = wire.GeometryWire(
    [wiregeom.RegionWire(1 << 20, 65536)],
    [wiregeom.LayerWire("l0", 0, 128, "blocks_first", [wiregeom.SegmentWire(0, 256, 128)]),
     wiregeom.LayerWire("l1", 0, 128, "blocks_first", [wiregeom.SegmentWire(32768, 256, 128)])])
LEASES = [wire.LeaseWire(7, 3, "req-1", b"t" * 16, b"b" * 16, b"c" * 16), wire.LeaseWire(2**52, 1, "r", b"\0" * 16, b"\1" * 16, b"\xff" * 16)]
VALID_REQUESTS = [
    wire.Hello(wire.PROTOCOL_VERSION, "consumer", b"\x01" * 32),
    wire.Auth(wire.PROTOCOL_VERSION, b"\x02" * 32),
    wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 8), COMPAT),
    wire.Renew(wire.PROTOCOL_VERSION, LEASES),
    wire.Confirm(wire.PROTOCOL_VERSION, LEASES, True),
    wire.Release(wire.PROTOCOL_VERSION, LEASES),
]
VALID_REPLIES = [
    wire.Challenge(wire.PROTOCOL_VERSION, b"\x03" * 32, True),
    wire.AuthOk(b"\x04" * 32),
    wire.HandshakeReply(wire.PROTOCOL_VERSION, "P", wire.RankInfo(0, 1, 8), COMPAT, COMPAT.compat_hash(), b"md", GEOMETRY),
    wire.LeaseReply([wire.LeaseStatus.HELD, wire.LeaseStatus.GONE], 30.0),
    wire.Refused("no"),
    wire.ErrorReply("bad"),
]
REQUEST_BYTES = [wire.encode(m) for m in VALID_REQUESTS]
REPLY_BYTES = [wire.encode(m) for m in VALID_REPLIES]
TAGS = ["hello", "auth", "handshake", "renew", "confirm", "release", "challenge", "auth_ok",
        "handshake_ok", "lease", "refused", "error", "nope"]
FIELDS = ["type", "version", "role", "nonce", "proof", "engine_id", "tp_rank", "compat", "leases",
          "release", "agent_metadata", "geometry", "statuses", "ttl_s", "reason", "message", "regions",
          "layers", "num_layers", "block_size", "layouts"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, 2, -1, 2**32, 2**53, 2**63, 2**64 - 1, wire.PROTOCOL_VERSION]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=24), st.binary(max_size=48),
)
json_like = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=6),
                               st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children,
                                               max_size=6)),
    max_leaves=24,
)


@st.composite
def mutated(draw, corpus):
    """A valid encoding, then up to 4 byte-level mutations."""
    data = bytearray(draw(st.sampled_from(corpus)))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "splice", "repeat"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "splice":
            data[pos:] = draw(st.sampled_from(corpus))[pos // 2:]
        elif op == "repeat":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 32))] * draw(st.integers(1, 64))
    return bytes(data)


@st.composite
def structured(draw):
    """msgpack of a tagged map with the right and wrong field names and types."""
    body = draw(st.dictionaries(st.sampled_from(FIELDS), json_like, max_size=8))
    if draw(st.booleans()):
        body["type"] = draw(st.sampled_from(TAGS))
    if draw(st.booleans()):
        body["version"] = wire.PROTOCOL_VERSION
    return msgspec.msgpack.encode(body)


def payloads(corpus):
    return st.one_of(st.binary(max_size=256), mutated(corpus), structured())


def deep_nesting():
    return st.integers(1, 5000).map(lambda n: b"\x91" * n + b"\xc0")


# --- pure parsers ------------------------------------------------------------------------------


def rejected_cleanly(exc: BaseException, *allowed: type) -> None:
    assert isinstance(exc, allowed), f"{type(exc).__name__} escaped: {exc!r}"
    assert isinstance(exc, RdmaKVError)
    assert str(exc), "an error without a message"


@campaign({"body": st.one_of(payloads(REQUEST_BYTES), deep_nesting())}, 300)
def side_channel_request(body):
    COUNTS["side_channel_request"] += 1
    try:
        message = wire.decode_request(body)
    except Exception as exc:
        rejected_cleanly(exc, MetadataError)
        return
    assert isinstance(message, tuple(VALID_REQUESTS[i].__class__ for i in range(len(VALID_REQUESTS))))


test_side_channel_request, test_side_channel_request_slow = side_channel_request


@campaign({"body": st.one_of(payloads(REPLY_BYTES), deep_nesting())}, 200)
def side_channel_reply(body):
    """What a consumer does with a reply: decode; for a handshake reply, the
    geometry check and the slot table it prepares."""
    COUNTS["side_channel_reply"] += 1
    try:
        message = wire.decode_reply(body)
        if isinstance(message, wire.HandshakeReply):
            SlotTable(message.geometry.to_geometry())
            COMPAT.mismatches(message.compat)
    except Exception as exc:
        rejected_cleanly(exc, ValueError)


test_side_channel_reply, test_side_channel_reply_slow = side_channel_reply


@st.composite
def geometries(draw):
    """Well-formed wire geometry with hostile numbers (strides, offsets, counts)."""
    big = st.one_of(st.integers(0, 4096), st.sampled_from([2**24, 2**32, 2**40, 2**63, 2**64 - 1]))
    regions = [wiregeom.RegionWire(draw(big), draw(big.filter(bool) | st.just(1))) for _ in range(draw(st.integers(1, 3)))]
    layers = []
    for i in range(draw(st.integers(0, 4))):
        segs = [wiregeom.SegmentWire(draw(big), draw(big), draw(big.filter(bool) | st.just(1)))
                for _ in range(draw(st.integers(1, 2)))]
        layers.append(wiregeom.LayerWire(f"l{i}", draw(st.integers(0, 3)),
                                     draw(st.integers(1, wire.MAX_BLOCKS_PER_LAYER)), "blocks_first", segs))
    return wire.GeometryWire(regions, layers)


@campaign({"geometry": geometries()}, 150)
def peer_geometry(geometry):
    COUNTS["peer_geometry"] += 1
    try:
        checked = geometry.to_geometry()
        table = SlotTable(checked)
    except Exception as exc:
        rejected_cleanly(exc, ValueError)
        return
    # Accepted: every descriptor lies inside its region.
    for layer in checked.layers:
        region = checked.regions[layer.region_index]
        for seg in layer.segments:
            assert seg.offset + (layer.num_blocks - 1) * seg.block_stride_bytes + seg.block_nbytes <= region.nbytes
    assert len(table.descs) <= wire.MAX_SLOTS


test_peer_geometry, test_peer_geometry_slow = peer_geometry


def _valid_agent_blobs():
    regions = [agent_metadata.RegionInfo(1 << 20, 4096, MemoryKind.HOST, b"rkey" * 8),
               agent_metadata.RegionInfo(1 << 30, 1 << 20, MemoryKind.HOST, b"k")]
    return [agent_metadata.encode("P/tp0", "1.21.0", b"\x00worker-address" * 4, regions),
            agent_metadata.encode("x", "", b"a", [])]


@campaign({"blob": st.one_of(payloads(_valid_agent_blobs()), deep_nesting())}, 300)
def agent_metadata_blob(blob):
    COUNTS["agent_metadata"] += 1
    try:
        md = agent_metadata.decode(blob)
    except UnicodeDecodeError:
        # Transport bug (test_agent_metadata_non_utf8_is_a_metadata_error): still
        # a ValueError, and the connector's handshake turns it into a refusal.
        COUNTS["agent_metadata_unicode_escapes"] += 1
        return
    except Exception as exc:
        rejected_cleanly(exc, MetadataError)
        return
    assert md.magic == agent_metadata.MAGIC


test_agent_metadata, test_agent_metadata_slow = agent_metadata_blob


def test_agent_metadata_non_utf8_is_a_metadata_error():
    """Found by fuzzing: msgspec raises UnicodeDecodeError for non-UTF-8 strings."""
    with pytest.raises(MetadataError, match="malformed"):
        agent_metadata.decode(b"\x81\xa5magic\xa1\x80")


VALID_PARAMS = RemotePrefillParams("P", "127.0.0.1", 5555, (3, 4, 5), "req", 1, 99, 7, b"t" * 16, 30.0, 40,
                                   b"d" * 16).to_dict()
param_values = st.one_of(json_like, st.lists(st.integers(-5, 2**33), max_size=8),
                         # per-group remote_block_ids (hybrid models), including mixed forms
                         st.lists(st.lists(st.integers(-5, 2**33), max_size=4)
                                  | st.integers(0, 9), max_size=4),
                         st.sampled_from([True, False, None, 0, 1, -1, 2**53, 86400.5, float("nan"), "", "x" * 2000]))
# JSON's "\ud800" (a lone surrogate), and hex tokens that bytes.fromhex reads short (it skips blanks)
NEAR_MISSES = ["P\ud800", "\udcff", "74" * 15 + "  ", " " + "74" * 15 + "\t", "74" * 16 + " "]


@st.composite
def kv_params(draw):
    kind = draw(st.sampled_from(["mutated_valid", "one_string", "random_keys", "not_a_mapping"]))
    if kind == "one_string":  # one field of valid params made a string that looks almost right
        key = draw(st.sampled_from(PARAM_KEYS))
        return dict(VALID_PARAMS, **{key: draw(st.sampled_from(NEAR_MISSES))})
    if kind == "not_a_mapping":
        return draw(json_like)
    if kind == "random_keys":
        return draw(st.dictionaries(st.sampled_from(PARAM_KEYS) | st.text(max_size=10), param_values, max_size=14))
    params = dict(VALID_PARAMS)
    for key in draw(st.lists(st.sampled_from(PARAM_KEYS), max_size=4)):
        if draw(st.booleans()):
            params[key] = draw(param_values)
        else:
            params.pop(key, None)
    return params


@campaign({"params": kv_params()}, 300)
def kv_transfer_params(params):
    COUNTS["kv_transfer_params"] += 1
    before = repr(params)
    try:
        parsed = parse_kv_transfer_params(params)
    except Exception as exc:
        rejected_cleanly(exc, ConfigError)
        assert len(str(exc)) < 4096, "an error message that echoes unbounded client input"
    else:
        if isinstance(parsed, RemotePrefillParams):
            assert all(0 <= b < 2**32 for group in parsed.remote_block_ids for b in group)
            assert 1 <= parsed.remote_port <= 65535 and 0 < parsed.remote_lease_ttl_s <= 86400
            # What the edge accepts, the rest can use: the lease's binding, and
            # a RENEW the producer's schema takes (a lease it refuses fails
            # the whole batch, other requests' calls with it).
            lease = wire.LeaseWire.of(parsed.lease, b"c" * 16)
            body = wire.encode(wire.Renew(wire.PROTOCOL_VERSION, [lease]))
            assert isinstance(wire.decode_request(body), wire.Renew)
            PeerAddress.of(parsed)
    assert repr(params) == before, "parsing mutated the caller's params"


test_kv_transfer_params, test_kv_transfer_params_slow = kv_transfer_params


# --- the scheduler and the worker with hostile params and step metadata ------------------------

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64)
_PAIR: dict[str, object] = {}


def pair():
    """One producer and one consumer engine (fake transport, real side channel),
    shared by the campaigns of this module and closed at its end."""
    if not _PAIR:
        fabric = FakeFabric()

        def engine(role, engine_id):
            config = KVTransferConfig(
                kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"rpc_timeout_s": 0.5, "connect_timeout_s": 0.5,
                                           "load_timeout_s": 3.0, "rpc_retries": 0})
            return Engine(config, SHAPE, connector_kwargs={"transport_factory": fabric.factory})

        _PAIR.update(fabric=fabric, P=engine("kv_producer", "P"), D=engine("kv_consumer", "D"))
    return _PAIR


@pytest.fixture(scope="module", autouse=True)
def _close_pair():
    yield
    if _PAIR:
        _PAIR["P"].shutdown()
        _PAIR["D"].shutdown()
        _PAIR.clear()


@campaign({"params": kv_params(), "num_tokens": st.integers(1, 200), "computed": st.integers(0, 64)}, 100)
def scheduler_admission(params, num_tokens, computed):
    """The consumer scheduler never raises into the engine for bad params."""
    COUNTS["scheduler_admission"] += 1
    scheduler = pair()["D"].scheduler.scheduler  # the raw RdmaScheduler: no safety net
    rid = f"s{COUNTS['scheduler_admission']}"
    request = Request(rid, list(range(1, num_tokens + 1)), params if isinstance(params, dict) else None)
    count, load = scheduler.get_num_new_matched_tokens(request, computed - computed % SHAPE.block_size)
    assert count is None or count >= 0
    scheduler.request_finished(request, [])
    scheduler.build_connector_meta(SchedulerOutput())


test_scheduler_admission, test_scheduler_admission_slow = scheduler_admission


block_lists = st.lists(st.one_of(st.integers(0, SHAPE.num_blocks - 1), st.integers(-3, 2**40)), max_size=12)


@campaign({"local": block_lists, "remote": block_lists, "generation": st.integers(1, 50),
           "dead_peer": st.booleans()}, 50)
def worker_step_metadata(local, remote, generation, dead_peer):
    """A worker given hostile step metadata: never raises, reports the load,
    and never posts a read for a block id outside either KV cache."""
    COUNTS["worker_step_metadata"] += 1
    env = pair()
    p, d, fabric = env["P"], env["D"], env["fabric"]
    port = p.worker.worker.side_channel_port
    if dead_peer:
        port = 1  # nothing listens on 127.0.0.1:1
    rid = f"w{COUNTS['worker_step_metadata']}"
    spec = LoadSpec(rid, tuple(local), tuple(remote), PeerAddress("P", "127.0.0.1", port, 1),
                    LeaseRef(7, generation, rid, b"t" * 16, b"b" * 16), 30.0, b"c" * 16)
    reads_before = fabric.reads
    in_range = (len(local) == len(remote)
                and all(0 <= b < SHAPE.num_blocks for b in (*local, *remote)))
    worker = d.worker.worker
    worker.on_step(RdmaConnectorMetadata(loads=(spec,)))
    seen: set[str] = set()

    def pump():
        p.step()
        seen.update(worker.get_finished()[1])
        worker.take_load_errors()

    wait_until(lambda: rid in seen, timeout_s=10, step=pump, what=f"load {rid} reported")
    if not in_range:
        assert fabric.reads == reads_before, "a read was posted for an out-of-range block id"


test_worker_step_metadata, test_worker_step_metadata_slow = worker_step_metadata


# --- frames on a socket, and a live server ------------------------------------------------------


def framed(corpus):
    """A frame: a valid length with a fuzzed body, a lying length, or raw bytes."""
    body = payloads(corpus)
    return st.one_of(
        body.map(lambda b: struct.pack(">I", len(b)) + b),
        st.tuples(st.sampled_from([0, 1, 3, 1 << 20, (1 << 20) + 1, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1),
                  body).map(lambda t: struct.pack(">I", t[0]) + t[1]),
        st.binary(max_size=64),
    )


@campaign({"data": framed(REPLY_BYTES)}, 100)
def reply_frame(data):
    """A client reading a (hostile) producer's reply frame."""
    COUNTS["reply_frame"] += 1
    a, b = socket.socketpair()
    with a, b:
        b.sendall(data)
        b.shutdown(socket.SHUT_WR)
        try:
            body = framing.recv_frame(a, wire.MAX_REPLY_BYTES, "fuzz", deadline=time.monotonic() + 2.0)
            if body is not None:
                wire.decode_reply(body)
        except Exception as exc:
            rejected_cleanly(exc, MetadataError, PeerError)


test_reply_frame, test_reply_frame_slow = reply_frame


_LIVE: dict[str, SideChannelServer] = {}
LIVE_SECRET = auth.Secret(b"fuzz-campaign-secret-0123456789", "test")


def live_server(authenticated):
    """Authenticated: a stub server with a secret. Open: the producer worker
    itself (its real handler, lease table and refusals)."""
    key = "auth" if authenticated else "open"
    if key not in _LIVE:
        if authenticated:
            handler = pair()["P"].worker.worker.side_channel_handler
            _LIVE[key] = SideChannelServer(handler, "127.0.0.1", 0, io_timeout_s=1.0, secret=LIVE_SECRET)
        else:
            _LIVE[key] = pair()["P"].worker.worker._server
    return _LIVE[key]


@pytest.fixture(scope="module", autouse=True)
def _close_live():
    yield
    server = _LIVE.pop("auth", None)
    if server is not None:
        server.close()
    _LIVE.clear()


def hello_frame():
    return frame(wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32)))


def exchange(port, data, timeout_s=5.0):
    """Send ``data``, half-close, read until the server closes. Bounded."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = bytearray()
        sock.settimeout(timeout_s)
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except socket.timeout:
                raise AssertionError(f"the server neither answered nor closed within {timeout_s} s") from None
            if not chunk:
                return bytes(out)
            out += chunk
        return bytes(out)


def live_campaign(authenticated, name):
    def check(frames, opened):
        COUNTS[name] += 1
        server = live_server(authenticated)
        data = (hello_frame() if opened else b"") + b"".join(frames)
        got = decode_replies(exchange(server.port, data))  # every reply is well-formed
        if authenticated:
            assert not any(isinstance(r, (wire.HandshakeReply, wire.LeaseReply)) for r in got), \
                "an unauthenticated peer was served"

    check.__name__ = name
    return campaign({"frames": st.lists(framed(REQUEST_BYTES), min_size=1, max_size=3),
                     "opened": st.booleans()}, 100 if authenticated else 150)(check)


test_live_server_open, test_live_server_open_slow = live_campaign(False, "live_server_open")
test_live_server_auth, test_live_server_auth_slow = live_campaign(True, "live_server_auth")


def test_live_servers_still_serve_honest_peers_after_the_campaigns():
    """Runs after the campaigns above (file order): both servers answer an
    honest client, and the producer's lease table holds nothing the fuzz made up."""
    for authenticated in (False, True):
        server = live_server(authenticated)
        client = SideChannelClient("127.0.0.1", server.port, secret=LIVE_SECRET if authenticated else None)
        try:
            reply = client.lease_call(wire.Renew(wire.PROTOCOL_VERSION, [
                wire.LeaseWire(1, 1, "honest", b"t" * 16, b"b" * 16, b"c" * 16)]))
            # A lease this worker never granted: UNKNOWN (its token does not
            # verify), GONE (of another epoch than the worker's), or PENDING
            # before the worker learnt its epoch -- a well-formed refusal, not a crash.
            assert len(reply.statuses) == 1
            assert reply.statuses[0] in (wire.LeaseStatus.UNKNOWN, wire.LeaseStatus.GONE,
                                         wire.LeaseStatus.PENDING)
        finally:
            client.close()
        print(f"server ({'authenticated' if authenticated else 'open'}) stats after fuzzing: {server.stats}")
    p = pair()["P"]
    assert len(p.worker.worker.leases) == 0
