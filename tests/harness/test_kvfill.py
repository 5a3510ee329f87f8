"""The harness's KV content (:mod:`rdma_kv.harness.kvfill`) against its
formula written out in int64, as it was computed before the place-only
part was cached: every verification in the demo and the fault tests
compares against these values, so a faster path must give the same bits."""

from __future__ import annotations

import random

import pytest
import torch

from rdma_kv.harness.kvfill import expected_block, fill_block

MOD = 251


def reference(tokens: list[int], block_index: int, seed: int, page_shape: tuple[int, int, int],
              num_layers: int, dtype: torch.dtype, heads: range | None = None) -> tuple[torch.Tensor, int]:
    num_heads, block_size, width = page_shape
    heads = range(num_heads) if heads is None else heads
    start = block_index * block_size
    valid = min(block_size, len(tokens) - start)
    h = torch.as_tensor(list(heads), dtype=torch.int64).view(-1, 1, 1)
    grid = ((h * block_size + torch.arange(block_size).view(1, -1, 1)) * width
            + torch.arange(width).view(1, 1, -1)).unsqueeze(0)
    layer = torch.arange(num_layers, dtype=torch.int64).view(num_layers, 1, 1, 1)
    tok = torch.zeros(block_size, dtype=torch.int64)
    tok[:valid] = torch.as_tensor(tokens[start:start + valid], dtype=torch.int64)
    values = (grid * 40503 + layer * 2654435761 + seed + tok.view(1, 1, block_size, 1) * 97) % MOD
    return values.to(dtype), valid


def _cases(n: int) -> list[tuple]:
    rng = random.Random(20261128)
    out = []
    for _ in range(n):
        heads_n = rng.choice([1, 2, 4, 8])
        block_size = rng.choice([1, 4, 16, 32])
        shape = (heads_n, block_size, rng.choice([2, 64, 256]))
        heads = rng.choice([None, range(heads_n), range(heads_n, 2 * heads_n), range(3 * heads_n, 4 * heads_n)])
        tokens = [rng.randrange(0, 262_144) for _ in range(rng.randrange(1, 5 * block_size + 2))]
        block_index = rng.randrange((len(tokens) + block_size - 1) // block_size)
        seed = rng.randrange(1 << 48)    # block_seeds' range: 6 bytes of a digest
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
        out.append((tokens, block_index, seed, shape, rng.choice([1, 2, 8, 32]), dtype, heads))
    return out


@pytest.mark.parametrize("case", _cases(48), ids=lambda c: f"{c[3]}-L{c[4]}-{c[5]}-{c[6]}")
def test_expected_block_is_the_formula(case: tuple) -> None:
    want, want_valid = reference(*case)
    got, valid = expected_block(*case)
    assert valid == want_valid
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_the_reduction_is_exact_at_its_edges() -> None:
    """Sums before the reduction of 0, 250, 251 and 500 (the largest, 250 +
    250) all occur in one block, and the block is still the formula."""
    from rdma_kv.harness.kvfill import _place_term

    tokens = [(t * 211) % 251 for t in range(1, 257)]   # 97 * token runs over every residue
    block = 0
    seed = 0
    place = _place_term(256, 256, 8, 0, 8, 1).to(torch.int64)
    term = (torch.as_tensor(tokens, dtype=torch.int64) * 97 % MOD).view(1, 1, -1, 1)
    sums = set((place + term).unique().tolist())
    assert {0, 250, 251, 500} <= sums
    got, _ = expected_block(tokens, block, seed, (8, 256, 256), 8, torch.float32)
    want, _ = reference(tokens, block, seed, (8, 256, 256), 8, torch.float32)
    assert torch.equal(got, want)


def test_fill_writes_the_expected_positions_only() -> None:
    whole = torch.full((2, 4, 2, 8, 16), -1.0, dtype=torch.float16)
    tokens = list(range(100, 113))          # 13 tokens: block 1 holds 5
    fill_block(whole, 3, tokens, 1, 12345, first_position=2)
    want, valid = reference(tokens, 1, 12345, (2, 8, 16), 2, torch.float16)
    assert valid == 5
    assert torch.equal(whole[:, 3, :, 2:5], want[:, :, 2:5])
    assert bool((whole[:, 3, :, :2] == -1).all()) and bool((whole[:, 3, :, 5:] == -1).all())
    assert bool((whole[:, :3] == -1).all())


def test_same_bits_is_bitwise() -> None:
    from rdma_kv.harness.kvfill import same_bits

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        whole = torch.zeros((2, 3, 4, 8), dtype=dtype)
        block = whole[:, 1]                         # strided, as verify_blocks reads it
        assert same_bits(block, torch.zeros((2, 4, 8), dtype=dtype))
        block[1, 2, 3] = -0.0                       # equal as floats, not as bits
        assert not same_bits(block, torch.zeros((2, 4, 8), dtype=dtype))
        assert torch.equal(block, torch.zeros((2, 4, 8), dtype=dtype))
        assert not same_bits(block, torch.zeros((2, 4, 7), dtype=dtype))
        assert not same_bits(block, torch.zeros((2, 4, 8), dtype=torch.float64))


def test_one_layer_is_that_layer_of_the_whole_block():
    """fill_block(layer=l), as the harness's forward stores a layer in its turn, writes layer l's slice only."""
    tokens = list(range(3, 40))
    whole = torch.zeros(3, 4, 2, 8, 16, dtype=torch.float16)
    full, valid = expected_block(tokens, 2, 12345, (2, 8, 16), 3, torch.float16)
    for layer in range(3):
        one, _ = expected_block(tokens, 2, 12345, (2, 8, 16), 3, torch.float16, layer=layer)
        assert torch.equal(one[0], full[layer])
    fill_block(whole, 1, tokens, 2, 12345, 0, layer=1)
    assert torch.equal(whole[1, 1, :, :valid], full[1, :, :valid])
    assert not whole[[0, 2]].any() and not whole[:, [0, 2, 3]].any()
