"""Configuration errors name the knob to turn: a bind error names the host
(``side_channel_host``) or the port, never vLLM's absent ``kv_ip``; the
unknown-key error lists only keys a user sets; a second
``register_kv_caches`` in one process says why."""

from __future__ import annotations

import socket

import pytest
from fakes import FakeFabric

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.errors import ConfigError, NotInitializedError
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(60)


class Handler:
    def handle(self, request):  # never called: these servers fail to bind
        raise AssertionError("unexpected request")


def test_an_address_not_on_this_host_names_side_channel_host():
    with pytest.raises(ConfigError) as caught:
        SideChannelServer(Handler(), "192.0.2.1", 0)  # TEST-NET-1: never on this host
    message = str(caught.value)
    assert "192.0.2.1 is not an address of this host" in message
    assert "side_channel_host" in message and "kv_ip" not in message and "kv_port" not in message


def test_a_port_in_use_names_the_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            SideChannelServer(Handler(), "127.0.0.1", port)
    message = str(caught.value)
    assert f"port {port} on 127.0.0.1 is in use" in message and "kv_port or side_channel_port" in message
    assert "kv_ip" not in message


def test_unknown_key_lists_only_keys_a_user_sets():
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer",
                              kv_connector_extra_config={"side_channel_hots": "10.0.0.1"})
    with pytest.raises(ConfigError) as caught:
        RdmaSettings.from_config(config)
    message = str(caught.value)
    assert "['side_channel_hots']" in message and "'side_channel_host'" in message
    assert "tp_rank" not in message and "tp_size" not in message


def test_a_second_register_kv_caches_says_one_engine_per_process():
    shape = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=16)
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", engine_id="P",
                              kv_port=0)
    engine = Engine(config, shape, connector_kwargs={"transport_factory": FakeFabric().factory})
    try:
        with pytest.raises(NotInitializedError) as caught:
            engine.worker.worker.register_kv_caches({})
    finally:
        engine.shutdown()
    assert "one process cannot hold two connector engines" in str(caught.value)


@pytest.mark.ucx
def test_express_is_a_boolean_setting_that_reaches_the_agent():
    from rdma_kv.connector.rdma.connector import agent_transport

    def settings(**extra):
        return RdmaSettings.from_config(KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_consumer",
                                                         kv_connector_extra_config=extra))

    assert not settings().express
    with pytest.raises(ConfigError, match="express"):
        settings(express="yes")
    agent = agent_transport("express-knob", settings(express=True, ucx_options={"NET_DEVICES": "lo"}))
    try:
        assert agent._core.config.express
    finally:
        agent.close()


def consumer_settings(**extra):
    return RdmaSettings.from_config(KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_consumer",
                                                     kv_connector_extra_config=extra))


@pytest.mark.parametrize("extra, says", [
    # NaN (Python's json reads it): every comparison false, so renewals were never due again
    ({"renew_interval_s": float("nan")}, "renew_interval_s must be in"),
    ({"read_timeout_s": float("nan")}, "read_timeout_s must be in"),
    # past ~1e10 s a deadline overflows (OverflowError in the agent's C fields, in every handshake)
    ({"read_timeout_s": 1e11}, r"read_timeout_s must be in \(0, 86400\]"),
    ({"read_timeout_s": float("inf")}, "read_timeout_s must be in"),
    ({"connect_timeout_s": 1e10}, "connect_timeout_s must be in"),
    ({"rpc_timeout_s": 1e10}, "rpc_timeout_s must be in"),
    ({"renew_interval_s": 1e12}, "renew_interval_s must be in"),
    # each retry an attempt and a backoff on an RPC thread: 10**8 held one for hours
    ({"rpc_retries": 10 ** 8}, r"rpc_retries must be in \[0, 10\]"),
    ({"rpc_threads": 100000}, r"rpc_threads in \[1, 256\]"),
    # a conversion or format spec passed the check of the names, then for_device raised a bare ValueError
    ({"ucx_net_devices": "mlx5_{rank!x}:1"}, "without a conversion or format spec"),
    ({"ucx_net_devices": "mlx5_{local_rank:q}:1"}, "without a conversion or format spec"),
    ({"ucx_net_devices": "mlx5_{rank:>99999999999}:1"}, "without a conversion or format spec"),
])
def test_values_that_failed_later_are_refused_when_read(extra, says):
    """Found by an adversarial review of the configuration: each was
    accepted (``rdma-kv info --config`` said so) and failed, or never
    worked, at run time."""
    with pytest.raises(ConfigError, match=says):
        consumer_settings(**extra)


def test_the_bounds_themselves_are_accepted():
    s = consumer_settings(read_timeout_s=86400.0, renew_interval_s=0.0, rpc_retries=10, rpc_threads=256,
                          ucx_net_devices="mlx5_{local_rank}:1")
    assert s.read_timeout_s == 86400.0 and s.rpc_retries == 10 and s.rpc_threads == 256
