"""Block geometry from real tensors: every layout is checked by writing
through the tensor and reading the bytes back at the derived offsets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rdma_kv.connector import (
    FullAttentionSpec,
    KVCacheConfig,
    Layout,
    MLAAttentionSpec,
    derive_geometry,
    derive_layer_geometry,
    region_bytes,
)
from rdma_kv.errors import SpecError

H, BS, D, NB = 2, 4, 8, 6  # heads, block size, head size, blocks
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype="float16")
PAGE = SPEC.page_size_bytes  # 2 * 4 * 2 * 8 * 2 = 256
LAYERS = ("l0", "l1", "l2")


def _fill_distinct(tensor):
    """Every element distinct, so a wrong offset cannot read the right bytes."""
    flat = torch.arange(tensor.numel(), dtype=torch.float32).to(tensor.dtype)
    tensor.copy_(flat.reshape(tensor.shape))


def _block_bytes(memory: np.ndarray, layer, block: int) -> bytes:
    return b"".join(
        memory[s.offset + block * s.block_stride_bytes:][: s.block_nbytes].tobytes()
        for s in layer.segments
    )


def test_cpu_layout_views_of_one_allocation_share_one_region():
    whole = torch.empty(len(LAYERS), NB, H, BS, 2 * D, dtype=torch.float16)
    _fill_distinct(whole)
    caches = {name: whole[i] for i, name in enumerate(LAYERS)}
    geometry = derive_geometry(caches, KVCacheConfig.uniform(NB, LAYERS, SPEC))
    assert len(geometry.regions) == 1
    region = geometry.regions[0]
    assert region.layer_names == LAYERS and region.nbytes == whole.numel() * 2
    assert region.base_address == whole.data_ptr()
    memory = region_bytes(caches["l1"])
    for i, layer in enumerate(geometry.layers):
        assert layer.layout is Layout.BLOCKS_FIRST
        (seg,) = layer.segments
        assert (seg.offset, seg.block_stride_bytes, seg.block_nbytes) == (i * NB * PAGE, PAGE, PAGE)
        for block in range(NB):
            expected = caches[layer.name][block].contiguous().view(torch.uint8).numpy().tobytes()
            assert _block_bytes(memory, layer, block) == expected
    assert geometry.bytes_per_block == len(LAYERS) * PAGE


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_kv_first_layouts_have_a_k_and_a_v_segment(hnd):
    caches = {}
    for name in LAYERS:
        if hnd:  # physical [2, nb, heads, block, dim], logical [2, nb, block, heads, dim]
            t = torch.empty(2, NB, H, BS, D, dtype=torch.float16).permute(0, 1, 3, 2, 4)
        else:
            t = torch.empty(2, NB, BS, H, D, dtype=torch.float16)
        _fill_distinct(t)
        caches[name] = t
    geometry = derive_geometry(caches, KVCacheConfig.uniform(NB, LAYERS, SPEC))
    assert len(geometry.regions) == 3  # separate allocations, one region each
    for layer in geometry.layers:
        assert layer.layout is Layout.KV_FIRST
        k, v = layer.segments
        half = PAGE // 2
        assert (k.offset, k.block_stride_bytes, k.block_nbytes) == (0, half, half)
        assert (v.offset, v.block_stride_bytes, v.block_nbytes) == (NB * half, half, half)
        memory = region_bytes(caches[layer.name])
        for block in range(NB):
            t = caches[layer.name]
            parts = [t[kv, block] for kv in (0, 1)]
            if hnd:  # physical order inside a block is [heads, block, dim]
                parts = [p.permute(1, 0, 2) for p in parts]
            expected = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)
            assert _block_bytes(memory, layer, block) == expected


def test_blocks_first_with_kv_dim_merges_adjacent_k_and_v():
    # FlashInfer-like [num_blocks, 2, block, heads, dim]: K and V adjacent.
    t = torch.empty(NB, 2, BS, H, D, dtype=torch.float16)
    layer = derive_layer_geometry("x", t, SPEC, NB)
    assert layer.layout is Layout.BLOCKS_FIRST
    assert [(s.offset, s.block_stride_bytes, s.block_nbytes) for s in layer.segments] == [
        (0, PAGE, PAGE)
    ]


def test_mla_layout():
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=24, dtype="bfloat16")
    t = torch.empty(NB, BS, 24, dtype=torch.bfloat16)
    layer = derive_layer_geometry("mla", t, spec, NB)
    assert [(s.offset, s.block_stride_bytes, s.block_nbytes) for s in layer.segments] == [
        (0, BS * 24 * 2, BS * 24 * 2)
    ]


def test_numpy_arrays_give_the_same_geometry_as_torch():
    whole = np.zeros((len(LAYERS), 2, NB, BS, H, D), dtype=np.float16)
    caches = {name: whole[i] for i, name in enumerate(LAYERS)}
    geometry = derive_geometry(caches, KVCacheConfig.uniform(NB, LAYERS, SPEC))
    assert len(geometry.regions) == 1
    assert geometry.regions[0].base_address == whole.ctypes.data
    # torch.from_numpy gives each view its own storage object; geometry still
    # finds the same bytes (adjacent storages stay separate regions).
    torch_caches = {n: torch.from_numpy(a) for n, a in caches.items()}
    torch_geometry = derive_geometry(torch_caches, KVCacheConfig.uniform(NB, LAYERS, SPEC))
    assert len(torch_geometry.regions) == len(LAYERS)

    def addresses(geo):
        return [
            [geo.regions[l.region_index].base_address + s.offset for s in l.segments]
            for l in geo.layers
        ]

    assert addresses(torch_geometry) == addresses(geometry)
    memory = region_bytes(caches["l2"])
    caches["l2"][1, 3] = 7  # V of block 3 in layer l2
    layer = geometry.layer("l2")
    v = layer.segments[1]
    got = memory[v.offset + 3 * v.block_stride_bytes:][: v.block_nbytes].view(np.float16)
    assert (got == 7).all()


def test_overlapping_storages_merge_into_one_region():
    whole = np.zeros((NB, H, BS, 2 * D), dtype=np.float16)
    # Two torch storages over overlapping byte ranges of one array.
    a = torch.from_numpy(whole)
    b = torch.from_numpy(whole[1:])
    spec_a = KVCacheConfig.uniform(NB - 1, ("a", "b"), SPEC)
    geometry = derive_geometry({"a": a[: NB - 1], "b": b}, spec_a)
    assert len(geometry.regions) == 1
    assert geometry.regions[0].base_address == whole.ctypes.data
    assert geometry.regions[0].nbytes == whole.nbytes
    assert [l.segments[0].offset for l in geometry.layers] == [0, PAGE]


def test_a_block_that_is_not_contiguous_is_rejected():
    # A slice of a wider last dimension: each block's data is strided.
    wide = torch.empty(NB, H, BS, 4 * D, dtype=torch.float16)
    with pytest.raises(SpecError, match="not contiguous"):
        derive_layer_geometry("x", wide[..., : 2 * D], SPEC, NB)


def test_shape_and_dtype_mismatches_are_rejected():
    with pytest.raises(SpecError, match=r"shape \(6, 2, 4, 8\) does not hold 6 blocks"):
        derive_layer_geometry("x", torch.empty(NB, H, BS, D, dtype=torch.float16), SPEC, NB)
    with pytest.raises(SpecError, match="dtype bfloat16 does not match spec dtype float16"):
        derive_layer_geometry("x", torch.empty(NB, H, BS, 2 * D, dtype=torch.bfloat16), SPEC, NB)
    with pytest.raises(SpecError, match="torch tensors or numpy arrays"):
        derive_layer_geometry("x", [1, 2], SPEC, NB)


def test_two_blocks_in_a_kv_first_shape_is_ambiguous():
    t = torch.empty(2, 2, BS, H, D, dtype=torch.float16)
    with pytest.raises(SpecError, match="ambiguous"):
        derive_layer_geometry("x", t, SPEC, 2)


def test_layers_must_match_the_config():
    caches = {"l0": torch.empty(NB, H, BS, 2 * D, dtype=torch.float16)}
    with pytest.raises(SpecError, match=r"missing layers \['l1', 'l2'\]"):
        derive_geometry(caches, KVCacheConfig.uniform(NB, LAYERS, SPEC))
