"""Which NICs the selftest reads through (``nic_targets``), from the
rank's ``NET_DEVICES`` read as UCX reads it: a valid value UCX accepts
(an HCA without its port, an exclusion, a range) is checked, never FAILed
as an unknown device; a name that matches nothing FAILs as written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rdma_kv.cli.info import load_settings
from rdma_kv.selftest.report import Status
from rdma_kv.selftest.ucx import UcxFacts, nic_targets

TRANSPORTS = [
    {"md": "self", "transport": "self", "device": "memory", "type": "loopback", "memory_types": "host"},
    {"md": "tcp", "transport": "tcp", "device": "lo", "type": "network", "memory_types": ""},
    {"md": "tcp", "transport": "tcp", "device": "eth0", "type": "network", "memory_types": ""},
    *({"md": hca, "transport": tl, "device": f"{hca}:{port}", "type": "network", "memory_types": "host"}
      for hca in ("mlx5_0", "mlx5_1") for port in (1, 2) for tl in ("rc_mlx5", "ud_mlx5"))]
FACTS = UcxFacts(checks=(), loaded=True, transports=TRANSPORTS)


def settings(extra: dict[str, Any]) -> Any:
    return load_settings(json.dumps({"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
                                     "kv_role": "kv_consumer", "kv_connector_extra_config": extra}))


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)


@pytest.mark.parametrize("extra, env, devices", [
    ({}, None, ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_1:2"]),             # every verbs device
    ({}, "all", ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_1:2"]),
    ({"ucx_options": {"NET_DEVICES": "all"}}, None, ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_1:2"]),
    ({"ucx_net_devices": "mlx5_{rank}"}, None, ["mlx5_0:1", "mlx5_0:2"]),      # the HCA's ports
    ({"ucx_net_devices": "mlx5_0:2,lo"}, None, ["lo", "mlx5_0:2"]),
    ({"ucx_options": {"NET_DEVICES": "^mlx5_0"}}, None, ["mlx5_1:1", "mlx5_1:2"]),  # verbs devices it leaves
    ({}, "mlx5_[0-1]:1", ["mlx5_0:1", "mlx5_1:1"]),
    ({"ucx_options": {"NET_DEVICES": "eth0"}}, "mlx5_0:1", ["eth0"]),          # the config's own wins
])
def test_valid_values_are_read_through(extra: dict[str, Any], env: str | None, devices: list[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if env is not None:
        monkeypatch.setenv("UCX_NET_DEVICES", env)
    targets, decided = nic_targets(FACTS, settings(extra))
    assert decided == []
    assert sorted(t["device"] for t in targets) == devices
    tls = {t["device"]: t["tls"] for t in targets}
    assert all(tls[d] == ("tcp" if d in ("lo", "eth0") else "rc,ud") for d in devices), tls


@pytest.mark.parametrize("value, failed, read", [
    ("lo,mlx5_9:1", "mlx5_9:1", ["lo"]),
    ("^mlx5_9", "mlx5_9", ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_1:2"]),  # excludes nothing: said, the rest read
    ("mlx5_[2-3]:1,mlx5_1:1", "mlx5_[2-3]:1", ["mlx5_1:1"]),
    ("mlx5_0:1, lo", " lo", ["mlx5_0:1"]),                                   # UCX strips no spaces
])
def test_names_that_match_no_device_fail_as_written(value: str, failed: str, read: list[str]) -> None:
    targets, decided = nic_targets(FACTS, settings({"ucx_options": {"NET_DEVICES": value}}))
    assert [(c.name, c.status) for c in decided] == [(f"nic:{failed}", Status.FAIL)]
    assert f"names {failed!r}, but UCX reports no such device" in decided[0].detail
    assert sorted(t["device"] for t in targets) == read


def test_a_value_ucx_refuses_fails_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "all,lo")
    targets, decided = nic_targets(FACTS, settings({}))
    assert targets == [] and [(c.name, c.status) for c in decided] == [("nic", Status.FAIL)]
    assert "UCX_NET_DEVICES: 'all,lo': 'all' must stand alone" in decided[0].detail


def test_an_exclusion_that_leaves_no_verbs_device_skips() -> None:
    targets, decided = nic_targets(FACTS, settings({"ucx_options": {"NET_DEVICES": "^mlx5_0,mlx5_1"}}))
    assert targets == [] and [(c.name, c.status) for c in decided] == [("nic", Status.SKIP)]
    assert decided[0].detail.startswith("no RDMA NIC that ucx_net_devices/NET_DEVICES of rank 0=^mlx5_0,mlx5_1 leaves")
    assert "no ucx_net_devices is configured" not in decided[0].detail  # it is: it excludes every HCA


def test_a_device_with_no_network_transport_fails() -> None:
    targets, decided = nic_targets(FACTS, settings({"ucx_options": {"NET_DEVICES": "memory"}}))
    assert targets == [] and [(c.name, c.status) for c in decided] == [("nic:memory", Status.FAIL)]
    assert "which is no network device (its transports: self)" in decided[0].detail
