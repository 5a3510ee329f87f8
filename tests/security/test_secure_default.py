"""Secure by default: a producer whose side channel listens off loopback
refuses to start without a shared secret unless ``allow_unauthenticated``
says so; loopback and consumers need neither."""

from __future__ import annotations

import pytest

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.errors import ConfigError


def settings(role="kv_producer", kv_ip="127.0.0.1", **extra):
    return RdmaSettings.from_config(KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, kv_port=0,
                                                     kv_ip=kv_ip, kv_connector_extra_config=extra))


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
@pytest.mark.parametrize("where", [{"kv_ip": "10.0.0.7"}, {"side_channel_host": "10.0.0.7"},
                                   {"side_channel_host": "prefill-0.example"},
                                   {"side_channel_host": "0.0.0.0", "advertise_host": "10.0.0.7"}])
def test_a_producer_off_loopback_without_a_secret_refuses_to_start(role, where):
    with pytest.raises(ConfigError) as err:
        settings(role, **where)
    message = str(err.value)
    host = where.get("side_channel_host", where.get("kv_ip"))
    assert f"listens on {host!r}, not a loopback address" in message
    for how in ("'auth_secret_file'", "'auth_secret_env'", "'allow_unauthenticated': true"):
        assert how in message  # the error says how to set either


@pytest.mark.parametrize("extra", [{"auth_secret_file": "/etc/rdma-kv/secret"},
                                   {"auth_secret_env": "RDMA_KV_SECRET"},
                                   {"allow_unauthenticated": True}])
def test_a_secret_or_the_explicit_flag_lets_it_start(extra):
    s = settings(side_channel_host="10.0.0.7", **extra)
    assert s.side_channel_host == "10.0.0.7"
    assert s.allow_unauthenticated is extra.get("allow_unauthenticated", False)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "localhost"])
def test_loopback_needs_no_secret(host):
    assert settings(side_channel_host=host).allow_unauthenticated is False


def test_a_consumer_needs_no_secret_anywhere():
    assert settings("kv_consumer", kv_ip="10.0.0.7").side_channel_host == "10.0.0.7"


def test_the_flag_must_be_a_bool():
    with pytest.raises(ConfigError, match="'allow_unauthenticated'.* must be bool"):
        settings(side_channel_host="10.0.0.7", allow_unauthenticated="yes")
