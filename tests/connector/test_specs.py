"""KV-cache specs: byte math against hand-computed values, type_id, merge,
dtype handling and KVCacheConfig validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rdma_kv.connector import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from rdma_kv.connector.specs import KVCacheSpec, dtype_itemsize, normalize_dtype
from rdma_kv.errors import SpecError

# Llama-3-8B: 32 layers, 8 KV heads (GQA), head 128, block 16.
LLAMA = dict(block_size=16, num_kv_heads=8, head_size=128)


@pytest.mark.parametrize("dtype", ["float16", torch.bfloat16, "half", "bf16", np.float16])
def test_llama_8b_page_is_64_kib_in_16_bit(dtype):
    spec = FullAttentionSpec(**LLAMA, dtype=dtype)
    # K and V (2) x 16 tokens x 8 heads x 128 dims x 2 bytes = 65,536 bytes.
    assert spec.page_size_bytes == 65_536
    assert spec.itemsize == 2


def test_llama_8b_fp32_page_doubles():
    assert FullAttentionSpec(**LLAMA, dtype="float32").page_size_bytes == 131_072


def test_llama_8b_memory_grows_with_length():
    spec = FullAttentionSpec(**LLAMA, dtype="bfloat16")
    # 8,192 tokens = 512 blocks x 64 KiB = 32 MiB per layer; x 32 layers = 1 GiB.
    assert spec.max_memory_usage_bytes(8192) == 33_554_432
    assert 32 * spec.max_memory_usage_bytes(8192) == 1 << 30
    # A partial last block still costs a whole block: 8,193 tokens = 513 blocks.
    assert spec.max_memory_usage_bytes(8193) == 513 * 65_536
    assert spec.max_memory_usage_bytes(131_072) == 8192 * 65_536
    # The step budget does not cap full attention.
    assert spec.max_memory_usage_bytes(8192, max_num_batched_tokens=16) == 33_554_432


def test_sliding_window_memory_is_capped_by_the_window():
    # Mistral-7B-like: window 4,096, 8 KV heads, head 128, bf16, block 16.
    spec = SlidingWindowSpec(**LLAMA, dtype="bfloat16", sliding_window=4096)
    assert spec.page_size_bytes == 65_536
    # min(4095 + 2048, 32768) = 6,143 tokens -> ceil(6143/16) = 384 blocks,
    # +1 for a window that starts mid-block = 385 blocks.
    assert spec.max_memory_usage_bytes(32_768, max_num_batched_tokens=2048) == 385 * 65_536
    # The same at 128k: still capped.
    assert spec.max_memory_usage_bytes(131_072, max_num_batched_tokens=2048) == 385 * 65_536
    # Shorter than the window: the length caps it: ceil(1000/16) = 63, +1.
    assert spec.max_memory_usage_bytes(1000, max_num_batched_tokens=2048) == 64 * 65_536
    # Without a step budget a whole prompt may be computed in one step.
    assert spec.max_memory_usage_bytes(32_768) == (2048 + 1) * 65_536


def test_mla_page_has_one_latent_vector():
    # DeepSeek-V2-like latent: 512 + 64 rope dims, 1 "head", bf16, block 64.
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert spec.use_mla and spec.num_kv_tensors == 1
    assert spec.page_size_bytes == 64 * 576 * 2 == 73_728
    assert spec.type_id == "mla_attention_64_73728"
    with pytest.raises(SpecError, match="use_mla must be True"):
        MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="bf16", use_mla=False)


def test_type_id_separates_specs_whose_kv_differs():
    full = FullAttentionSpec(**LLAMA, dtype="float16")
    assert full.type_id == "full_attention_16_65536"
    window = SlidingWindowSpec(**LLAMA, dtype="float16", sliding_window=4096)
    assert window.type_id == "sliding_window_4096_16_65536"
    ids = {
        full.type_id,
        window.type_id,
        SlidingWindowSpec(**LLAMA, dtype="float16", sliding_window=1024).type_id,
        FullAttentionSpec(**LLAMA, dtype="float32").type_id,
        FullAttentionSpec(**{**LLAMA, "block_size": 32}, dtype="float16").type_id,
        FullAttentionSpec(**LLAMA, dtype="float16", use_mla=True).type_id,
    }
    assert len(ids) == 6
    # Same page geometry with a different head split is the same KV format.
    same = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=256, dtype="float16")
    assert same.type_id == full.type_id


def test_merge_of_equal_specs_returns_the_spec():
    spec = FullAttentionSpec(**LLAMA, dtype="float16")
    assert FullAttentionSpec.merge([spec, FullAttentionSpec(**LLAMA, dtype="half")]) == spec


def test_merge_records_one_sliding_window_and_rejects_two():
    plain = FullAttentionSpec(**LLAMA, dtype="float16")
    windowed = FullAttentionSpec(**LLAMA, dtype="float16", sliding_window=4096)
    assert FullAttentionSpec.merge([plain, windowed]).sliding_window == 4096
    other = FullAttentionSpec(**LLAMA, dtype="float16", sliding_window=1024)
    with pytest.raises(SpecError, match=r"one sliding window, got \[1024, 4096\]"):
        FullAttentionSpec.merge([windowed, other])


def test_merge_rejects_incompatible_specs():
    a = FullAttentionSpec(**LLAMA, dtype="float16")
    with pytest.raises(SpecError, match="dtype='float16' vs 'bfloat16'"):
        FullAttentionSpec.merge([a, FullAttentionSpec(**LLAMA, dtype="bfloat16")])
    with pytest.raises(SpecError, match="num_kv_heads=8 vs 4"):
        FullAttentionSpec.merge([a, FullAttentionSpec(**{**LLAMA, "num_kv_heads": 4}, dtype="float16")])
    window = SlidingWindowSpec(**LLAMA, dtype="float16", sliding_window=8)
    with pytest.raises(SpecError, match="cannot merge SlidingWindowSpec"):
        FullAttentionSpec.merge([a, window])
    with pytest.raises(SpecError, match="SlidingWindowSpec vs FullAttentionSpec"):
        KVCacheSpec.merge([window, a])
    with pytest.raises(SpecError, match="sliding_window=8 vs 16"):
        SlidingWindowSpec.merge([window, SlidingWindowSpec(**LLAMA, dtype="float16", sliding_window=16)])
    with pytest.raises(SpecError, match="empty"):
        FullAttentionSpec.merge([])


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_size": 1.5}, "head_size"),
        ({"dtype": "int4"}, "unsupported KV dtype 'int4'"),
        ({"use_mla": 1}, "use_mla must be a bool"),
    ],
)
def test_spec_validation(kwargs, fragment):
    with pytest.raises(SpecError, match=fragment):
        FullAttentionSpec(**{**LLAMA, "dtype": "float16", **kwargs})


def test_dtype_normalisation():
    assert normalize_dtype(torch.float16) == normalize_dtype("fp16") == "float16"
    assert normalize_dtype(np.dtype("float32")) == "float32"
    assert dtype_itemsize("fp8") == 1 and dtype_itemsize(torch.bfloat16) == 2
    spec = FullAttentionSpec(**LLAMA, dtype=torch.bfloat16)
    assert spec.dtype == "bfloat16" and spec.torch_dtype is torch.bfloat16


def test_kv_cache_config_validates_groups_and_sizes():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
    page = spec.page_size_bytes  # 2 * 4 * 2 * 8 * 2 = 256
    assert page == 256
    group = KVCacheGroupSpec(("a", "b"), spec)
    ok = KVCacheConfig(10, (KVCacheTensor(10 * page, ("a",)), KVCacheTensor(10 * page, ("b",))),
                       (group,))
    assert ok.spec_for("b") == spec and ok.layer_names == ("a", "b")
    assert ok.single_group() == group
    with pytest.raises(SpecError, match="too small for layer 'b'.*10 blocks x 256 bytes = 2560"):
        KVCacheConfig(10, (KVCacheTensor(10 * page - 1, ("b",)),), (group,))
    with pytest.raises(SpecError, match="layer 'c', which is in no KV-cache group"):
        KVCacheConfig(10, (KVCacheTensor(10 * page, ("c",)),), (group,))
    with pytest.raises(SpecError, match="groups 0 and 1"):
        KVCacheConfig(10, (), (group, KVCacheGroupSpec(("b",), spec)))
    with pytest.raises(SpecError, match="exactly one KV-cache group, got 2"):
        KVCacheConfig(10, (), (group, KVCacheGroupSpec(("c",), spec))).single_group()
    with pytest.raises(SpecError, match="twice"):
        KVCacheGroupSpec(("a", "a"), spec)
    uniform = KVCacheConfig.uniform(10, ["x", "y"], spec)
    assert [t.size for t in uniform.kv_cache_tensors] == [2560, 2560]


def test_specs_are_frozen_and_hashable():
    spec = AttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
    assert {spec: 1}[AttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="half")] == 1
    with pytest.raises(AttributeError):
        spec.block_size = 32  # type: ignore[misc]
