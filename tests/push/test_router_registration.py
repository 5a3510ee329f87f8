"""Registering with a P/D router's service discovery (vllm-router's
``--vllm-discovery-address``): what the engine sends, and that the address
it registers is the one a decode finds in the router's request id. A ZMQ
ROUTER socket stands where the router's is (the router itself drives real
vLLM in tests/vllm/test_vllm_push.py)."""

from __future__ import annotations

import uuid

import msgspec
import pytest
from fakes import FakeFabric
from netutil import free_base_port

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma.params import router_address
from rdma_kv.errors import ConfigError
from rdma_kv.harness.engine import Engine, ModelShape

zmq = pytest.importorskip("zmq", reason="pyzmq not installed (the test extra installs it)")

pytestmark = pytest.mark.timeout(60)

SHAPE = ModelShape(num_layers=1, num_kv_heads=2, head_size=8, block_size=4, num_blocks=16, dtype="float32")


def config(role: str, engine_id: str, discovery: str, mode: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_connector_extra_config={"mode": mode, "router_discovery_address": discovery,
                                                       "router_http_address": f"127.0.0.1:{8000 if role == 'kv_producer' else 8001}"})


@pytest.mark.parametrize("mode, transfer_mode", [("push", "WRITE"), ("pull", "READ")])
def test_both_engines_register_and_the_prefill_address_round_trips_through_a_request_id(mode, transfer_mode):
    port = free_base_port(1)
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    engines = []
    try:
        engines.append(Engine(config("kv_producer", "prefill-7", f"127.0.0.1:{port}", mode), SHAPE, connector_kwargs=kw))
        engines.append(Engine(config("kv_consumer", "decode-7", f"127.0.0.1:{port}", mode), SHAPE, connector_kwargs=kw))
        seen: dict[str, dict] = {}
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while len(seen) < 2:
            assert poller.poll(10_000), f"no registration within 10 s; seen {list(seen)}"
            _identity, body = router.recv_multipart()
            payload = msgspec.msgpack.decode(body)
            seen[payload["type"]] = payload
        p, d = seen["P"], seen["D"]
        assert (p["http_address"], d["http_address"]) == ("127.0.0.1:8000", "127.0.0.1:8001")
        assert p["transfer_mode"] == d["transfer_mode"] == transfer_mode
        # What vllm-router writes into X-Request-Id, and vLLM into the request id.
        rid = f"cmpl-___prefill_addr_{p['zmq_address']}___decode_addr_{d['zmq_address']}_{uuid.uuid4().hex}-0-ab12cd34"
        side_channel = engines[0].worker.worker.side_channel_port
        assert router_address(rid) == ("127.0.0.1", side_channel, "prefill-7", 1)
    finally:
        for e in engines:
            e.shutdown()
        router.close(linger=0)


def test_the_registration_settings_are_checked():
    from rdma_kv.connector.rdma.settings import RdmaSettings

    with pytest.raises(ConfigError, match="go together"):
        RdmaSettings.from_config(KVTransferConfig(
            kv_connector="RdmaKVConnector", kv_role="kv_producer", engine_id="p", kv_port=0,
            kv_connector_extra_config={"router_discovery_address": "127.0.0.1:1"}))
    # (a kv_both engine is neither a prefill nor a decode to the router)
    with pytest.raises(ConfigError, match="kv_both"):
        RdmaSettings.from_config(KVTransferConfig(
            kv_connector="RdmaKVConnector", kv_role="kv_both", engine_id="b", kv_port=0,
            kv_connector_extra_config={"router_discovery_address": "127.0.0.1:1", "router_http_address": "h:1"}))
    with pytest.raises(ConfigError, match="request id names prefill address"):
        router_address("cmpl-___prefill_addr_host:1.2.3.4,notify:5___decode_addr_x_" + "0" * 32)


def test_an_ipv6_discovery_address_is_reached():
    """A ZMQ socket is IPv4-only unless told: with "[::1]:PORT" the
    registration never connected and every beat was dropped silently, so
    the router never learnt the engine (found by an adversarial review)."""
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    from rdma_kv.connector.rdma.discovery import RouterRegistration

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.IPV6, 1)
    try:
        port = router.bind_to_random_port("tcp://[::1]")
    except zmq.ZMQError as exc:
        router.close(linger=0)
        pytest.skip(f"cannot bind [::1] here: {exc}")
    registration = RouterRegistration(f"[::1]:{port}", lambda: {"type": "P", "zmq_address": "x"}, interval_s=0.2)
    try:
        assert router.poll(10_000), "no registration reached the router over IPv6 within 10 s"
        assert msgspec.msgpack.decode(router.recv_multipart()[-1])["type"] == "P"
    finally:
        registration.close()
        router.close(linger=0)
