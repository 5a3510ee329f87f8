"""KVTransferConfig: validation, helpers, extra config, JSON, compute_hash."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.config import KVBufferDevice, KVLoadFailurePolicy, KVRole
from rdma_kv.errors import ConfigError


def test_defaults_match_the_documented_values():
    cfg = KVTransferConfig()
    assert cfg.kv_connector is None and cfg.kv_role is None
    assert cfg.kv_buffer_device is KVBufferDevice.CUDA
    assert cfg.kv_buffer_size == 1e9
    assert cfg.kv_ip == "127.0.0.1" and cfg.kv_port == 14579
    assert cfg.kv_parallel_size == 1 and cfg.kv_rank is None
    assert cfg.kv_load_failure_policy is KVLoadFailurePolicy.FAIL
    assert dict(cfg.kv_connector_extra_config) == {}
    assert not cfg.is_kv_transfer_instance


def test_engine_id_is_generated_unique_and_kept_when_given():
    a, b = KVTransferConfig(), KVTransferConfig()
    assert a.engine_id and b.engine_id and a.engine_id != b.engine_id
    assert KVTransferConfig(engine_id="prefill-0").engine_id == "prefill-0"


def test_strings_become_enums_that_still_compare_equal_to_strings():
    cfg = KVTransferConfig(kv_connector="X", kv_role="kv_consumer", kv_buffer_device="cpu",
                           kv_load_failure_policy="recompute")
    assert cfg.kv_role is KVRole.CONSUMER and cfg.kv_role == "kv_consumer"
    assert cfg.kv_buffer_device is KVBufferDevice.CPU
    assert cfg.kv_load_failure_policy is KVLoadFailurePolicy.RECOMPUTE


@pytest.mark.parametrize(
    "role, producer, consumer",
    [("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)],
)
def test_role_helpers(role, producer, consumer):
    cfg = KVTransferConfig(kv_connector="X", kv_role=role)
    assert cfg.is_kv_transfer_instance
    assert cfg.is_kv_producer is producer and cfg.is_kv_consumer is consumer


def test_role_without_connector_is_not_a_transfer_instance():
    cfg = KVTransferConfig(kv_role="kv_both")
    assert not (cfg.is_kv_transfer_instance or cfg.is_kv_producer or cfg.is_kv_consumer)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        ({"kv_connector": "X"}, ["kv_role must be set", "kv_producer", "kv_both"]),
        ({"kv_connector": "X", "kv_role": "producer"}, ["kv_role='producer'", "kv_consumer"]),
        ({"kv_buffer_device": "tpu"}, ["kv_buffer_device='tpu'", "cuda", "cpu"]),
        ({"kv_load_failure_policy": "retry"}, ["kv_load_failure_policy", "recompute", "fail"]),
        ({"kv_port": 65536}, ["kv_port=65536", "[0, 65535]"]),
        ({"kv_port": -1}, ["kv_port=-1"]),
        ({"kv_port": True}, ["kv_port must be an integer", "bool"]),
        ({"kv_port": "14579"}, ["kv_port must be an integer"]),
        ({"kv_connector_module_path": ""}, ["kv_connector_module_path", "dotted"]),
        ({"kv_connector_module_path": "my pkg.mod"}, ["kv_connector_module_path"]),
        ({"kv_connector": ""}, ["kv_connector must be a non-empty"]),
        ({"kv_buffer_size": 0}, ["kv_buffer_size"]),
        ({"kv_parallel_size": 0}, ["kv_parallel_size=0"]),
        ({"kv_rank": -1}, ["kv_rank=-1"]),
        ({"kv_ip": ""}, ["kv_ip"]),
        ({"engine_id": ""}, ["engine_id"]),
        ({"kv_connector_extra_config": ["a"]}, ["must be a mapping"]),
        ({"kv_connector_extra_config": {"x": object()}}, ["['x']", "JSON-compatible"]),
        ({"kv_connector_extra_config": {1: "a"}}, ["keys must be strings"]),
    ],
)
def test_invalid_values_name_the_field_and_the_valid_values(kwargs, fragments):
    with pytest.raises(ConfigError) as info:
        KVTransferConfig(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_port_bounds_are_inclusive():
    assert KVTransferConfig(kv_port=0).kv_port == 0
    assert KVTransferConfig(kv_port=65535).kv_port == 65535


def test_from_dict_rejects_unknown_keys_listing_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict({"kv_connector": "X", "kv_role": "kv_both", "kv_rol": 1})
    message = str(info.value)
    assert "['kv_rol']" in message and "kv_role" in message and "kv_load_failure_policy" in message


def test_from_json_rejects_bad_json_and_non_objects():
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVTransferConfig.from_json("{kv_connector: X}")
    with pytest.raises(ConfigError, match="must be an object"):
        KVTransferConfig.from_json("[1, 2]")


def test_json_round_trip_preserves_every_field():
    cfg = KVTransferConfig(
        kv_connector="MultiConnector",
        engine_id="e-1",
        kv_buffer_device="cpu",
        kv_buffer_size=2.5e9,
        kv_role="kv_producer",
        kv_rank=0,
        kv_parallel_size=2,
        kv_ip="10.0.0.7",
        kv_port=15000,
        kv_connector_extra_config={
            "connectors": [{"kv_connector": "StorageConnector",
                            "kv_connector_extra_config": {"storage_path": "/tmp/x"}}],
            "flag": True, "ratio": 0.5, "none": None,
        },
        kv_connector_module_path="my_pkg.conn",
        kv_load_failure_policy="recompute",
    )
    text = cfg.to_json()
    assert json.loads(text)["kv_role"] == "kv_producer"
    again = KVTransferConfig.from_json(text)
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    assert again.to_dict()["kv_connector_extra_config"]["connectors"][0]["kv_connector"] == (
        "StorageConnector"
    )


def test_extra_config_is_a_frozen_copy():
    extra = {"storage_path": "/a", "nested": {"k": [1, 2]}}
    cfg = KVTransferConfig(kv_connector_extra_config=extra)
    extra["storage_path"] = "/b"
    extra["nested"]["k"].append(3)
    assert cfg.get_extra("storage_path") == "/a"
    assert cfg.get_extra("nested")["k"] == (1, 2)
    with pytest.raises(TypeError):
        cfg.kv_connector_extra_config["storage_path"] = "/c"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_port = 1  # type: ignore[misc]


def test_get_extra_is_typed():
    cfg = KVTransferConfig(kv_connector_extra_config={"n": 3, "flag": True, "name": "x", "r": 1})
    assert cfg.get_extra("n", type=int) == 3
    assert cfg.get_extra("r", type=float) == 1.0 and isinstance(cfg.get_extra("r", type=float), float)
    assert cfg.get_extra("missing", 7, type=int) == 7
    assert cfg.get_from_extra_config("missing", "d") == "d"
    with pytest.raises(ConfigError, match=r"\['n'\] must be str, got int 3"):
        cfg.get_extra("n", type=str)
    with pytest.raises(ConfigError, match="must be int, got bool"):
        cfg.get_extra("flag", type=int)
    with pytest.raises(ConfigError, match="no key 'missing'.*keys present: \\['flag', 'n', 'name', 'r'\\]"):
        cfg.get_extra("missing")


def test_replace_validates_the_changes():
    cfg = KVTransferConfig(kv_connector="X", kv_role="kv_both", engine_id="e")
    assert cfg.replace(kv_port=1).kv_port == 1
    assert cfg.replace(kv_port=1).engine_id == "e"
    with pytest.raises(ConfigError):
        cfg.replace(kv_port=70000)
    with pytest.raises(ConfigError, match="unknown"):
        cfg.replace(kv_prot=1)


# --- compute_hash ------------------------------------------------------------------

BASE = dict(kv_connector="StorageConnector", kv_role="kv_producer", engine_id="e0")

# Every field that must NOT change the hash, with a different valid value.
NON_GRAPH_CHANGES = {
    "kv_connector": "OtherConnector",
    "engine_id": "e1",
    "kv_buffer_device": "cpu",
    "kv_buffer_size": 5e8,
    "kv_rank": 1,
    "kv_parallel_size": 4,
    "kv_ip": "10.1.1.1",
    "kv_port": 20000,
    "kv_connector_extra_config": {"storage_path": "/elsewhere"},
    "kv_connector_module_path": "some.module",
    "kv_load_failure_policy": "recompute",
}


def test_hash_coverage_table_lists_every_field():
    graph_fields = {"kv_role"}  # plus kv_connector's None-ness, tested below
    assert set(NON_GRAPH_CHANGES) | graph_fields == set(KVTransferConfig.field_names())


@pytest.mark.parametrize("field", sorted(NON_GRAPH_CHANGES))
def test_fields_that_do_not_change_the_graph_do_not_change_the_hash(field):
    base = KVTransferConfig(**BASE)
    changed = KVTransferConfig(**{**BASE, field: NON_GRAPH_CHANGES[field]})
    assert getattr(changed, field) != getattr(base, field)
    assert changed.compute_hash() == base.compute_hash()


def test_role_changes_the_hash():
    hashes = {KVTransferConfig(**{**BASE, "kv_role": r}).compute_hash()
              for r in ("kv_producer", "kv_consumer", "kv_both")}
    assert len(hashes) == 3


def test_enabling_a_connector_changes_the_hash():
    without = KVTransferConfig()
    with_connector = KVTransferConfig(**BASE)
    assert without.compute_hash() != with_connector.compute_hash()
    assert KVTransferConfig().compute_hash() == without.compute_hash()


def test_hash_is_a_stable_hex_digest():
    digest = KVTransferConfig(**BASE).compute_hash()
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert KVTransferConfig(**BASE).compute_hash() == digest
