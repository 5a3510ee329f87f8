"""The KV layout is part of what two engines must share: caches of one shape
in NHD and HND order (FlashAttention vs FlashInfer on some GPUs) are not
compatible, the handshake refuses them naming both sides, and the consumer's
request recomputes."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from fakes import FakeFabric
from rdma_testutil import wait_until

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.geometry import derive_geometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.leases import LeaseTable
from rdma_kv.connector.rdma.compat import compat_info
from rdma_kv.connector.rdma.producer import ProducerHandler
from rdma_kv.connector.specs import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec
from rdma_kv.connector.types import EngineId
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(60)

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 2, 8, 16, 4, 32
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype="float16")
CONFIG = KVCacheConfig.uniform(BLOCKS, [f"layer.{i}" for i in range(LAYERS)], SPEC)


def kv_first(order: str) -> dict[str, np.ndarray]:
    """FlashAttention's logical shape [2, num_blocks, block_size, heads, head]
    in NHD memory order, or the same shape as a permuted view of an HND
    allocation [2, num_blocks, heads, block_size, head] (how vLLM builds it)."""
    caches = {}
    for name in CONFIG.layer_names:
        if order == "NHD":
            caches[name] = np.zeros((2, BLOCKS, BLOCK, HEADS, HEAD), dtype=np.float16)
        else:
            caches[name] = np.zeros((2, BLOCKS, HEADS, BLOCK, HEAD), dtype=np.float16).transpose(0, 1, 3, 2, 4)
    return caches


def compat(order: str, backend: str = "FLASH_ATTN") -> wire.CompatInfo:
    return compat_info(CONFIG, derive_geometry(kv_first(order), CONFIG), HEADS, backend)


def prefilled(p: Engine, d: Engine, request_id: str, prompt: list[int]):
    """Prefill ``prompt`` on ``p`` for a remote decode, stepping both engines
    until it finished; returns the function that steps both."""
    p.add_request(request_id, prompt, {"do_remote_decode": True})

    def pump() -> None:
        p.step()
        d.step()

    wait_until(lambda: request_id in p.results and p.results[request_id].status.value == "finished", step=pump,
               what="prefill")
    return pump


def test_nhd_and_hnd_of_one_shape_are_not_compatible():
    nhd, hnd = compat("NHD"), compat("HND")
    assert kv_first("NHD")["layer.0"].shape == kv_first("HND")["layer.0"].shape
    assert (nhd.kv_layout, hnd.kv_layout) == ("NHD", "HND")
    assert nhd != hnd and nhd.compat_hash() != hnd.compat_hash()
    diff = nhd.mismatches(hnd, mine="producer", theirs="consumer")
    assert "kv_layout: producer 'NHD' vs consumer 'HND'" in diff
    layouts = next(line for line in diff if line.startswith("layouts:"))
    assert "(2,B,16,H,32) order 0,1,2,3,4" in layouts and "(2,B,16,H,32) order 0,1,3,2,4" in layouts
    # The same layout twice (another allocation, other addresses) is compatible.
    assert compat("HND") == hnd


def test_attention_backend_dtype_and_block_size_are_compared():
    assert compat("NHD", "FLASH_ATTN") != compat("NHD", "FLASHINFER")
    spec32 = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype="float32")
    cfg32 = KVCacheConfig.uniform(BLOCKS, CONFIG.layer_names, spec32)
    caches32 = {n: np.zeros((2, BLOCKS, BLOCK, HEADS, HEAD), dtype=np.float32) for n in CONFIG.layer_names}
    c32 = compat_info(cfg32, derive_geometry(caches32, cfg32), HEADS, "FLASH_ATTN")
    assert {line.split(":")[0] for line in compat("NHD").mismatches(c32)} >= {"dtype", "layouts"}


def test_mla_is_named_mla():
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype="float16", use_mla=True)
    cfg = KVCacheConfig.uniform(BLOCKS, ["layer.0"], spec)
    caches = {"layer.0": np.zeros((BLOCKS, BLOCK, 576), dtype=np.float16)}
    assert compat_info(cfg, derive_geometry(caches, cfg), 1).kv_layout == "MLA"


def test_handshake_refuses_a_layout_mismatch_naming_both_sides():
    producer = ProducerHandler(EngineId("P"), wire.RankInfo(0, 1, HEADS), 30.0, LeaseTable(), compat("NHD"), lambda: b"",
                               derive_geometry(kv_first("NHD"), CONFIG))
    reply = producer.on_handshake(wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, HEADS), compat("HND")))
    assert isinstance(reply, wire.Refused)
    assert "kv_layout: producer 'NHD' vs consumer 'HND'" in reply.reason
    assert isinstance(producer.on_handshake(wire.Handshake(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, HEADS), compat("NHD"))),
                      wire.HandshakeReply)


def test_a_mismatched_consumer_recomputes(caplog):
    """End to end over the side channel (fake transport): the engines differ
    only in their attention backend; the consumer's load fails at the
    handshake, nothing is read, and the request is computed locally."""
    shape = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64)
    fabric = FakeFabric()

    def engine(role, engine_id, backend):
        config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                                  kv_load_failure_policy="recompute",
                                  kv_connector_extra_config={"rpc_timeout_s": 1.0, "load_timeout_s": 5.0,
                                                             "attention_backend": backend})
        return Engine(config, shape, connector_kwargs={"transport_factory": fabric.factory})

    p, d = engine("kv_producer", "P", "FLASH_ATTN"), engine("kv_consumer", "D", "FLASHINFER")
    try:
        prompt = list(range(1, 20))
        pump = prefilled(p, d, "m", prompt)
        with caplog.at_level(logging.WARNING):
            d.add_request("m", prompt, p.results["m"].kv_transfer_params)
            wait_until(lambda: d.results["m"].status.value in ("finished", "failed"), step=pump, what="decode")
        assert d.results["m"].load_failed and d.results["m"].status.value == "finished"  # recomputed
        assert "attention_backend: producer 'FLASH_ATTN' vs consumer 'FLASHINFER'" in caplog.text
        assert fabric.reads == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_the_kv_cache_dtype_joins_the_dtype():
    """vLLM's fp8 caches are all uint8 tensors: the engine's name for the
    format (``kv_cache_dtype``) is what tells them apart."""
    e4m3 = compat_info(CONFIG, derive_geometry(kv_first("NHD"), CONFIG), HEADS, "X", kv_cache_dtype="fp8_e4m3")
    e5m2 = compat_info(CONFIG, derive_geometry(kv_first("NHD"), CONFIG), HEADS, "X", kv_cache_dtype="fp8_e5m2")
    assert e4m3.dtype == "float16 (float8_e4m3fn)"
    assert e4m3.mismatches(e5m2) == ["dtype: local 'float16 (float8_e4m3fn)' vs remote 'float16 (float8_e5m2)'"]
    fp8 = compat_info(CONFIG, derive_geometry(kv_first("NHD"), CONFIG), HEADS, "X", kv_cache_dtype="fp8")
    assert fp8.mismatches(e4m3) == []  # vLLM's "fp8" is e4m3: one format, two spellings
    same = compat_info(CONFIG, derive_geometry(kv_first("NHD"), CONFIG), HEADS, "X", kv_cache_dtype="half")
    assert same.dtype == "float16"  # naming the tensor's own dtype is "auto" (the other engine's default)
    other = compat_info(CONFIG, derive_geometry(kv_first("NHD"), CONFIG), HEADS, "X", kv_cache_dtype="nvfp4")
    assert other.dtype == "float16 (nvfp4)"  # a name the specs do not know is kept as it is
    assert compat("NHD", "X").dtype == "float16"  # none given (vLLM's "auto"): the tensor's dtype alone


def test_the_model_is_compared_when_both_sides_name_one():
    """Two models of one shape had equal records (the record named none);
    now ``model_id`` joins it, compared only when both sides name one: an
    engine that names none (outside vLLM: the harness, the demo) is
    accepted by any peer, as before."""
    def named(model_id: str) -> wire.CompatInfo:
        return compat_info(CONFIG, derive_geometry(kv_first("NHD"), CONFIG), HEADS, "X", model_id=model_id)

    diff = named("llama-ft-math@1").mismatches(named("llama-ft-code@1"), mine="producer", theirs="consumer")
    assert len(diff) == 1 and diff[0].startswith("model_id: producer 'llama-ft-math@1' vs consumer 'llama-ft-code@1'")
    assert "--served-model-name" in diff[0] and "'model_id'" in diff[0]
    assert named("m@1").mismatches(named("m@1")) == []
    assert named("m@1").mismatches(named("")) == [] and named("").mismatches(named("m@1")) == []


def test_fp8_scales_are_part_of_the_record():
    def scaled(scales: str) -> wire.CompatInfo:
        return compat_info(CONFIG, derive_geometry(kv_first("NHD"), CONFIG), HEADS, "X", kv_cache_dtype="fp8",
                           kv_cache_scales=scales)

    diff = scaled("k 1.0 v 1.0, 2 layers").mismatches(scaled("sha256 ab, 2 layers"))
    assert len(diff) == 1 and diff[0].startswith("kv_cache_scales: local 'k 1.0 v 1.0, 2 layers' vs remote")
    assert scaled("").mismatches(scaled("k 1.0 v 1.0, 2 layers")) != []  # unlike model_id: an unscaled side differs


@pytest.mark.parametrize(("p_model", "d_model", "loaded"), [("m-a", "m-b", False), ("m-a", "m-a", True),
                                                           ("m-a", None, True)])
def test_engines_of_two_models_do_not_exchange_kv(p_model, d_model, loaded):
    """End to end over the side channel (fake transport): engines of one
    shape naming other models refuse each other at the handshake; nothing
    is read and the decode recomputes. One that names none is not checked."""
    shape = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64)
    fabric = FakeFabric()

    def engine(role, engine_id, model_id):
        extra = {"rpc_timeout_s": 1.0, "load_timeout_s": 5.0, **({"model_id": model_id} if model_id else {})}
        config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                                  kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
        return Engine(config, shape, connector_kwargs={"transport_factory": fabric.factory})

    p, d = engine("kv_producer", "P", p_model), engine("kv_consumer", "D", d_model)
    try:
        prompt = list(range(1, 20))
        pump = prefilled(p, d, "m", prompt)
        d.add_request("m", prompt, p.results["m"].kv_transfer_params)
        wait_until(lambda: d.results["m"].status.value in ("finished", "failed"), step=pump, what="decode")
        assert d.results["m"].status.value == "finished"
        assert d.results["m"].load_failed is not loaded
        assert (fabric.reads > 0) is loaded
    finally:
        p.shutdown()
        d.shutdown()
