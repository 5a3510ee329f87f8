"""The side channel binds only the configured interface; block ids outside
either KV cache (in kv_transfer_params, in step metadata, in a peer's
geometry) are rejected before anything is posted."""

from __future__ import annotations

import logging
import os
import socket

import pytest
from fakes import FakeFabric
from rdma_testutil import pump_until, wait_until

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma import wire, wiregeom
from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress, RdmaConnectorMetadata
from rdma_kv.connector.rdma.params import LeaseRef, parse_kv_transfer_params
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.errors import ConfigError, MetadataError
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(60)

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64)


def listening_address(port):
    """The local address of the socket listening on ``port`` (from /proc/net/tcp):
    what the kernel will accept connections on."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            hex_ip, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                return socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1])
    raise AssertionError(f"nothing listens on port {port}")


class Nobody:
    """A handler that is never asked anything: the test only looks at the listening socket."""

    def live(self, leases):
        return set()


def test_server_listens_on_the_configured_interface_only():
    with SideChannelServer(Nobody(), "127.0.0.1", 0) as srv:
        assert listening_address(srv.port) == "127.0.0.1"  # not 0.0.0.0


def engine(fabric, role, engine_id, **extra):
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                              kv_ip="127.0.0.1", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"rpc_timeout_s": 1.0, "load_timeout_s": 5.0, **extra})
    return Engine(config, SHAPE, connector_kwargs={"transport_factory": fabric.factory})


def test_producer_worker_binds_side_channel_host_only():
    fabric = FakeFabric()
    p = engine(fabric, "kv_producer", "P", side_channel_host="127.0.0.1")
    try:
        port = p.worker.worker.side_channel_port
        assert listening_address(port) == "127.0.0.1"
    finally:
        p.shutdown()


def test_wildcard_bind_needs_an_advertised_host():
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", kv_port=0,
                              kv_connector_extra_config={"side_channel_host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="advertise_host"):
        RdmaSettings.from_config(config)


def test_the_connectors_lane_bound_is_the_transports():
    from rdma_kv.connector.rdma import settings
    from rdma_kv.transport.lanes import MAX_LANES

    assert settings.MAX_LANES == MAX_LANES
    for lanes, ok in ((MAX_LANES, True), (MAX_LANES + 1, False), (0, False)):
        config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_consumer", kv_port=0,
                                  kv_ip="127.0.0.1", kv_connector_extra_config={"lanes": lanes})
        if ok:
            assert RdmaSettings.from_config(config).lanes == lanes
        else:
            with pytest.raises(ConfigError, match=f"lanes must be 1..{MAX_LANES}, got {lanes}"):
                RdmaSettings.from_config(config)


@pytest.mark.parametrize("cpus", [1, 2, 3, 64])
def test_the_connectors_default_lanes_are_the_transports(monkeypatch, cpus):
    """Both follow the CPUs the process may run on, up to the same cap."""
    from rdma_kv.connector.rdma import settings
    from rdma_kv.transport import AgentConfig
    from rdma_kv.transport import config as transport_config

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert settings.DEFAULT_LANES_CAP == transport_config.DEFAULT_LANES_CAP
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_consumer", kv_port=0, kv_ip="127.0.0.1")
    want = min(cpus, transport_config.DEFAULT_LANES_CAP)
    assert RdmaSettings.from_config(config).lanes == AgentConfig().lanes == transport_config.default_lanes() == want


@pytest.mark.parametrize("ids", [[-1], [2**32], [True], [1.5], ["3"], []])
def test_params_reject_impossible_block_ids(ids):
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1,
              "remote_block_ids": ids, "remote_request_id": "r", "tp_size": 1, "remote_lease_epoch": 1,
              "remote_lease_generation": 1, "remote_lease_token": "ab" * 16, "remote_lease_ttl_s": 5, "remote_num_tokens": 1,
              "remote_prompt_digest": "cd" * 16}
    with pytest.raises(ConfigError, match="remote_block_ids"):
        parse_kv_transfer_params(params)


@pytest.fixture
def pair():
    fabric = FakeFabric()
    p = engine(fabric, "kv_producer", "P")
    d = engine(fabric, "kv_consumer", "D")
    yield fabric, p, d
    p.shutdown()
    d.shutdown()



def test_remote_block_ids_beyond_the_producer_cache_are_never_read(pair):
    fabric, p, d = pair
    prompt = list(range(1, 30))
    p.add_request("r", prompt, {"do_remote_decode": True})
    pump_until(p, d, lambda: "r" in p.results and p.results["r"].status.value == "finished", "prefill")
    params = dict(p.results["r"].kv_transfer_params)
    params["remote_block_ids"] = [0, 1, SHAPE.num_blocks + 5, 2**31, 3, 4, 5, 6]  # in [0, 2**32): parses
    reads = fabric.reads
    d.add_request("r", prompt, params)
    pump_until(p, d, lambda: "r" in d.results and d.results["r"].status.value == "finished", "decode")
    assert d.results["r"].load_failed and d.results["r"].recomputed_from_block == 0
    assert fabric.reads == reads, "a read was posted for a block outside the producer's KV cache"
    # The altered params cannot release the genuine lease (their RELEASE is
    # refused FORGED): it is left to its TTL, here forced. The RELEASE goes
    # out on the decode's RPC thread and is answered on the producer's
    # side-channel thread, after the decode finished: wait for its count.
    pump_until(p, d, lambda: p.worker.worker.leases.stats.refused_forged >= 1, "the RELEASE refused FORGED")
    assert p.held
    p.worker.worker.leases.expire(now=float("inf"))
    pump_until(p, d, lambda: not p.held, "the producer's lease expired")


@pytest.mark.parametrize("local, remote", [
    ((0, 1, SHAPE.num_blocks), (0, 1, 2)),  # local id past the consumer's cache
    ((0, -1), (0, 1)),  # negative
    ((0, 1), (0, 1, 2)),  # lengths differ
])
def test_step_metadata_with_bad_block_ids_posts_nothing(pair, local, remote):
    fabric, p, d = pair
    worker = d.worker.worker
    spec = LoadSpec("m", local, remote, PeerAddress("P", "127.0.0.1", p.worker.worker.side_channel_port, 1),
                    LeaseRef(1, 1, "m", b"t" * 16, b"b" * 16), 30.0, b"c" * 16)
    reads = fabric.reads
    worker.on_step(RdmaConnectorMetadata(loads=(spec,)))
    done: set = set()
    errors: set = set()

    def pump():
        p.step()
        done.update(worker.get_finished()[1])
        errors.update(worker.take_load_errors())

    wait_until(lambda: "m" in done, timeout_s=10, step=pump, what="the load reported")
    assert fabric.reads == reads
    assert errors, "the load's blocks were not reported as load errors"


@pytest.mark.parametrize("layer, match", [
    (wiregeom.LayerWire("l", 0, 17, "blocks_first", [wiregeom.SegmentWire(0, 256, 256)]), "beyond its region"),
    (wiregeom.LayerWire("l", 1, 1, "blocks_first", [wiregeom.SegmentWire(0, 256, 256)]), "names region 1"),
    (wiregeom.LayerWire("l", 0, wire.MAX_BLOCKS_PER_LAYER, "blocks_first", [wiregeom.SegmentWire(0, 0, 1)] * 8),
     "over the limit"),
])
def test_peer_geometry_outside_its_regions_is_rejected(layer, match):
    geometry = wire.GeometryWire([wiregeom.RegionWire(1 << 20, 4096)], [layer])
    with pytest.raises(MetadataError, match=match):
        geometry.to_geometry()


def test_refused_handshakes_are_readable_bounded_and_logged_a_few_times(pair, caplog):
    """A peer handshaking again and again on one connection with a
    mismatching, field-filling compat record: each refusal fits the wire's
    bound (it was 51 KB against 8,192: the peer could not read why), and
    the producer logs a few of them per window, each line bounded (each
    refusal was one line of 51 KB: 200 handshakes in 0.2 s made 10 MB)."""
    _, p, _ = pair
    p.step()
    compat = wire.CompatInfo(2, 4, 2, 8, "x" * 1024, "y" * 1024, ["z" * 1024] * 2, kv_layout="k" * 1024,
                             attention_backend="a" * 1024, layer_groups=[123456789] * 4096, transfer_mode="m" * 1024)
    client = SideChannelClient("127.0.0.1", p.worker.worker.side_channel_port, rpc_timeout_s=5.0, retries=0)
    try:
        with caplog.at_level(logging.WARNING, logger="rdma_kv"):
            replies = [client.call(wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 2), compat))
                       for _ in range(50)]
    finally:
        client.close()
    for reply in replies:
        assert isinstance(reply, wire.Refused), reply
        assert reply.reason.startswith("incompatible KV caches (dtype: producer ") and len(reply.reason) < 8192
        assert "layer_groups: producer " in reply.reason  # every differing field is still named
    refused = [r for r in caplog.records if "refused handshake" in r.getMessage()]
    assert 1 <= len(refused) <= 3, len(refused)
    assert max(len(r.getMessage()) for r in refused) < 8192
