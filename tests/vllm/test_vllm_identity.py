"""Which model, and which fp8 scales, two engines' KV caches hold: the
compatibility record compared at the handshake carries both, as the vLLM
adapter derives them (worker-role adapters built as vLLM builds them, a
stand-in config; about a second each, no engine)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from rdma_kv.errors import ConfigError  # noqa: E402
from rdma_kv.vllm import RdmaKVConnector, translate  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(360)]

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS = 2
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=HEADS, head_dim=32, intermediate_size=256,
             vocab_size=512, rope_theta=10000.0, max_position_embeddings=256)


def model(path: str, served: str | None = None, **hf: Any) -> SimpleNamespace:
    """A stand-in for vLLM's ``ModelConfig``: as vLLM leaves it,
    ``served_model_name`` is the model's path when none was given."""
    config = SimpleNamespace(**{**LLAMA, **hf})
    return SimpleNamespace(model=path, served_model_name=served or path, hf_config=config, hf_text_config=config,
                           get_total_num_kv_heads=lambda: HEADS)


class Attention(torch.nn.Module):
    """What the adapter reads of vLLM's attention layer: its host copies of the k/v scales."""

    def __init__(self, k_scale: float, v_scale: float) -> None:
        super().__init__()
        self._k_scale_float, self._v_scale_float = k_scale, v_scale


def worker(role: str, engine: str, monkeypatch: pytest.MonkeyPatch, model_config: SimpleNamespace | None = None,
           cache_dtype: str = "auto", extra: dict[str, Any] | None = None,
           scales: dict[str, tuple[float, float]] | None = None) -> RdmaKVConnector:
    """A worker-role adapter (TP 1, 2 KV heads) with its KV cache registered;
    ``scales``: the attention layers in vLLM's static forward context."""
    from vllm.config import KVTransferConfig as Kv
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import rdma_kv.vllm.connector as adapter

    monkeypatch.setattr(adapter, "_attention_backend", lambda config, role: "CPU_ATTN")  # no model runner here
    fp8 = cache_dtype.startswith("fp8")
    nb, bs, head = 8, 32, 16
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=HEADS, head_size=head,
                             dtype=torch.uint8 if fp8 else torch.float16)
    page = spec.page_size_bytes
    config = KVCacheConfig(num_blocks=nb, kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
                           kv_cache_tensors=[KVCacheTensor(size=nb * page, layers=[n], layer_stride=nb * page,
                                                           block_stride=page, offset=0) for n in LAYERS])
    context = {name: Attention(*ks) for name, ks in (scales or {}).items()}
    vllm_config = SimpleNamespace(
        kv_transfer_config=Kv(kv_connector="RdmaKVConnector", kv_connector_module_path="rdma_kv.vllm",
                              kv_role=role, engine_id=engine, kv_port=0,
                              kv_connector_extra_config=extra or {}),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
        model_config=model_config or model("/models/tiny-llama"),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(static_forward_context=context))
    conn = RdmaKVConnector(vllm_config, KVConnectorRole.WORKER, config)
    conn.register_kv_caches({n: torch.zeros(nb, HEADS, bs, 2 * head, dtype=spec.dtype) for n in LAYERS})
    return conn


def handshake(producer: dict[str, Any], consumer: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The producer's answer to the consumer's HANDSHAKE, and the consumer's
    own check of that answer (``None`` when it accepts it)."""
    from rdma_kv.connector.rdma import wire

    p = worker("kv_producer", "P", monkeypatch, **producer)
    try:
        d = worker("kv_consumer", "D", monkeypatch, **consumer)
        try:
            pw, dw = p.connector.worker, d.connector.worker
            reply = pw._producer.handler.on_handshake(
                wire.Handshake(wire.PROTOCOL_VERSION, "D", dw._local.rank, dw._compat))
            return reply, dw._compat.mismatches(pw._compat, mine="consumer", theirs="producer")
        finally:
            d.shutdown()
    finally:
        p.shutdown()


SAME_MODEL = [
    ("one path", dict(model_config=model("/models/llama-8b")), dict(model_config=model("/models/llama-8b"))),
    ("a copy elsewhere", dict(model_config=model("/models/llama-8b")), dict(model_config=model("/mnt/nvme/llama-8b/"))),
    ("one served name", dict(model_config=model("/models/a", served="llama")),
     dict(model_config=model("/mnt/b", served="llama"))),
    ("model_id set on both", dict(model_config=model("/models/a"), extra={"model_id": "llama-8b"}),
     dict(model_config=model("/mnt/llama-copy"), extra={"model_id": "llama-8b"})),
]

OTHER_MODEL = [
    ("two fine-tunes of one base", dict(model_config=model("/models/llama-ft-math")),
     dict(model_config=model("/models/llama-ft-code"))),
    ("other served names", dict(model_config=model("/models/a", served="llama")),
     dict(model_config=model("/models/a", served="mistral"))),
    ("one name, another architecture", dict(model_config=model("/models/m")),
     dict(model_config=model("/models/m", rope_theta=500000.0, vocab_size=640))),
    ("other model_id", dict(model_config=model("/models/a"), extra={"model_id": "llama-8b"}),
     dict(model_config=model("/models/a"), extra={"model_id": "llama-70b-draft"})),
]


@pytest.mark.parametrize(("case", "producer", "consumer"), SAME_MODEL, ids=[c[0] for c in SAME_MODEL])
def test_one_model_loaded_from_two_paths_exchanges_kv(case, producer, consumer, monkeypatch) -> None:
    from rdma_kv.connector.rdma import wire

    reply, theirs = handshake(producer, consumer, monkeypatch)
    assert isinstance(reply, wire.HandshakeReply), reply
    assert theirs == []


@pytest.mark.parametrize(("case", "producer", "consumer"), OTHER_MODEL, ids=[c[0] for c in OTHER_MODEL])
def test_two_models_of_one_shape_do_not_exchange_kv(case, producer, consumer, monkeypatch) -> None:
    """Every field the record had compared was equal (one shape, dtype,
    block size, layout, backend): the producer answered the handshake and
    the decode would have generated from another model's KV, silently.
    Now the record names the model, and a mismatch is refused naming both
    identities and what to set."""
    from rdma_kv.connector.rdma import wire

    reply, theirs = handshake(producer, consumer, monkeypatch)
    assert isinstance(reply, wire.Refused), reply
    assert "model_id: producer '" in reply.reason and "--served-model-name" in reply.reason, reply.reason
    assert [line.split(":")[0] for line in theirs] == ["model_id"], theirs


def test_the_identity_the_adapter_derives() -> None:
    from rdma_kv.vllm.identity import model_id

    derived = model_id(SimpleNamespace(model_config=model("/models/Llama-3-8B/")))
    assert derived.startswith("Llama-3-8B@") and len(derived) == len("Llama-3-8B@") + 12, derived
    assert model_id(SimpleNamespace(model_config=model("meta-llama/Llama-3-8B"))) == derived  # a hub name
    assert model_id(SimpleNamespace(model_config=model("/x", served="llama"))) == "llama"
    assert model_id(SimpleNamespace(model_config=model("/x", served=["llama", "alias"]))) == "llama"
    assert model_id(SimpleNamespace()) == ""  # no model config: no identity (not compared)


def test_an_identity_from_vllms_own_model_config(tmp_path) -> None:
    """vLLM's ``ModelConfig`` (reads config.json, loads no weights): a copy
    of the model elsewhere has the identity, another served name has its own."""
    import shutil

    from tiny_model import build_tiny_llama
    from vllm.config import ModelConfig

    from rdma_kv.vllm.identity import model_id

    first = build_tiny_llama(tmp_path / "a" / "tiny")
    copy = shutil.copytree(first, tmp_path / "b" / "tiny")
    one = model_id(SimpleNamespace(model_config=ModelConfig(model=first)))
    assert one.startswith("tiny@"), one
    assert model_id(SimpleNamespace(model_config=ModelConfig(model=str(copy)))) == one
    assert model_id(SimpleNamespace(model_config=ModelConfig(model=first, served_model_name="tiny-llama"))) \
        == "tiny-llama"


def test_model_id_is_the_operators_or_the_adapters() -> None:
    from vllm.config import KVTransferConfig as Kv

    kv = Kv(kv_connector="RdmaKVConnector", kv_connector_module_path="rdma_kv.vllm", kv_role="kv_consumer")
    assert translate.transfer_config(kv, model_id="tiny@abc").kv_connector_extra_config["model_id"] == "tiny@abc"
    given = SimpleNamespace(**{**vars(kv), "kv_connector_extra_config": {"model_id": "llama"}})
    assert translate.transfer_config(given, model_id="tiny@abc").kv_connector_extra_config["model_id"] == "llama"
    for bad in ("", 7):
        with pytest.raises(ConfigError, match="model_id"):
            translate.transfer_config(SimpleNamespace(**{**vars(kv), "kv_connector_extra_config": {"model_id": bad}}))
    with pytest.raises(ConfigError, match="kv_cache_scales"):
        translate.transfer_config(SimpleNamespace(**{**vars(kv), "kv_connector_extra_config": {"kv_cache_scales": "x"}}))


# --- fp8 scales ------------------------------------------------------------------------------


@pytest.mark.parametrize(("p_scales", "d_scales", "accepted"), [
    ((1.0, 1.0), (1.0, 1.0), True),
    ((0.02, 0.03), (0.02, 0.03), True),
    ((0.02, 0.03), (1.0, 1.0), False),  # a checkpoint's scales vs none (1.0)
    ((0.02, 0.03), (0.02, 0.05), False),
])
def test_fp8_scales_are_compared_at_the_handshake(p_scales, d_scales, accepted, monkeypatch) -> None:
    """An fp8 cache stores K/scale and V/scale: the same bytes under other
    scales are other values. Both engines ran one model, one fp8 format:
    the record matched and the decode would have dequantized the
    producer's bytes with its own scales, silently."""
    from rdma_kv.connector.rdma import wire

    def side(ks: tuple[float, float]) -> dict[str, Any]:
        return dict(cache_dtype="fp8_e4m3", scales={LAYERS[0]: (1.0, 1.0), LAYERS[1]: ks})

    reply, theirs = handshake(side(p_scales), side(d_scales), monkeypatch)
    if accepted:
        assert isinstance(reply, wire.HandshakeReply), reply
    else:
        assert isinstance(reply, wire.Refused), reply
        assert "kv_cache_scales: producer" in reply.reason and "k/v scales" in reply.reason, reply.reason
        assert [line.split(":")[0] for line in theirs] == ["kv_cache_scales"], theirs


def test_the_scales_the_adapter_reads() -> None:
    from rdma_kv.vllm.identity import kv_cache_scales

    def config(dtype: str, scales: dict[str, tuple[float, float]]) -> SimpleNamespace:
        return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=dtype),
                               compilation_config=SimpleNamespace(
                                   static_forward_context={n: Attention(*s) for n, s in scales.items()}))

    ones = {n: (1.0, 1.0) for n in LAYERS}
    assert kv_cache_scales(config("auto", {LAYERS[0]: (0.5, 0.5)})) == ""  # not quantized: scales unused
    assert kv_cache_scales(config("fp8", ones)) == "k 1.0 v 1.0, 2 layers"
    mixed = kv_cache_scales(config("fp8", {LAYERS[0]: (0.5, 0.25), LAYERS[1]: (1.0, 1.0)}))
    assert mixed.startswith("sha256 ") and mixed.endswith(", 2 layers"), mixed
    assert mixed != kv_cache_scales(config("fp8", {LAYERS[0]: (1.0, 1.0), LAYERS[1]: (0.5, 0.25)}))  # per layer
    with pytest.raises(ConfigError, match="no attention layer"):
        kv_cache_scales(config("fp8", {}))  # fp8, and no scales to compare: refused at start-up


def test_a_real_engine_names_its_model_and_its_fp8_scales(tmp_path) -> None:
    """In a real vLLM 0.32 engine (CPU, the tiny Llama, ``--kv-cache-dtype
    fp8``, a child process): vLLM has loaded the weights when it builds the
    worker's connector, so the record carries the scales (1.0: the tiny
    checkpoint has none) and the identity derived from vLLM's own model
    config (no served name: the directory's name and an architecture digest).

    vLLM's CPU attention refuses an fp8 cache without AVX-512 or AMX
    ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"): on such a CPU
    the engine runs with the model's own cache dtype, the identity is
    checked, and the scales' part is skipped saying why."""
    import torch

    fp8 = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
    child = pathlib.Path(__file__).with_name("identity_child.py")
    proc = subprocess.run([sys.executable, str(child), str(tmp_path), "fp8" if fp8 else "auto"],
                          capture_output=True, text=True, timeout=300)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, f"child exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "model_id='tiny-llama@" in result[0], result
    if not fp8:
        assert "kv_cache_scales=''" in result[0] and "dtype='float32'" in result[0], result
        pytest.skip("the identity held; an fp8 KV cache needs AVX-512 or AMX in vLLM's CPU attention, "
                    "which this CPU lacks (torch.cpu._is_avx512_supported, _is_amx_tile_supported)")
    assert "kv_cache_scales='k 1.0 v 1.0, 2 layers'" in result[0], result
    assert "dtype='uint8 (float8_e4m3fn)'" in result[0], result
