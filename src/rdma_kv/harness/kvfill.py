"""Deterministic KV content: what a model would have computed, without a model.

Owns :func:`fill_block`, the KV the harness's fake forward pass writes into
a block, and :func:`expected_block`, the same thing for verification. The
content of token position ``p`` in layer ``l`` depends on the token prefix
up to ``p`` (as real attention KV does): a hash chain over the prompt's
blocks seeds each block, the token at ``p`` perturbs its position. So a
consumer verifies every loaded block from the prompt alone, a block reused
through a prefix-cache hit has the content a fresh computation would have,
and a block read from the wrong place (or reused memory) does not match.

Values are small integers (< 251), exact in fp16, bf16 and fp32.

Imports functools, hashlib, numpy and torch.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["block_seeds", "expected_block", "fill_block", "same_bits"]

_MOD = 251


def block_seeds(tokens: Sequence[int], block_size: int) -> list[int]:
    """Seed of block ``i``: a hash of the tokens before it (chained). One
    more entry than blocks: entry ``i + 1`` covers every token through block
    ``i``, the key of block ``i`` in a prefix cache."""
    arr = np.asarray(tokens, dtype="<i8")
    seeds, digest = [], hashlib.sha256(b"rdma-kv-harness").digest()
    for start in range(0, len(arr), block_size):
        seeds.append(int.from_bytes(digest[:6], "little"))
        digest = hashlib.sha256(digest + arr[start:start + block_size].tobytes()).digest()
    seeds.append(int.from_bytes(digest[:6], "little"))
    return seeds


def expected_block(
    tokens: Sequence[int], block_index: int, seed: int, page_shape: tuple[int, ...],
    num_layers: int, dtype: torch.dtype, heads: range | None = None, layer: int | None = None,
) -> tuple[torch.Tensor, int]:
    """``(values, valid)``: the block's KV for every layer, shape
    ``[num_layers, *page_shape]`` with page ``[heads, block_size, 2*head]``,
    and how many leading positions hold tokens (the rest is undefined).
    ``heads``: which of the model's KV heads the page holds (a tensor-parallel
    rank's share; default all of ``page_shape[0]``), so every rank writes the
    values of the same head that a single engine would. ``layer``: that
    layer's KV only (shape ``[1, *page_shape]``).

    Value at (layer, head, position, column):
    ``(grid * 40503 + layer * 2654435761 + seed + token * 97) % 251``, with
    ``grid`` the element's index in an unsplit page and ``token`` 0 past
    ``valid``. The part that depends on the place only is computed once per
    page shape (:func:`_place_term`), so a block costs one add and one
    reduction (a shift, not a division) on 16-bit integers: the harness stands in for a GPU's forward
    pass, and its CPU would otherwise be taken from the copy it demonstrates."""
    num_heads, block_size, width = page_shape
    heads = range(num_heads) if heads is None else heads
    start = block_index * block_size
    valid = min(block_size, len(tokens) - start)
    tok = np.zeros(block_size, dtype=np.int64)
    tok[:valid] = np.asarray(tokens[start:start + valid], dtype=np.int64)
    term = torch.from_numpy(((seed % _MOD + (tok % _MOD) * 97) % _MOD).astype(np.int16))
    place = _place_term(block_size, width, num_layers, heads.start, heads.stop, heads.step)
    if layer is not None:
        place = place[layer:layer + 1]
    values = place + term.view(1, 1, -1, 1)
    # values < 2 * 251: (values + 5) >> 8 is 1 exactly where values >= 251
    values.sub_((values + (256 - _MOD)).bitwise_right_shift_(8).mul_(_MOD))
    return values.to(dtype), valid


@functools.lru_cache(maxsize=16)
def _place_term(block_size: int, width: int, num_layers: int, h0: int, h1: int, hstep: int) -> torch.Tensor:
    """``(grid * 40503 + layer * 2654435761) % 251`` as int16, shape
    ``[num_layers, heads, block_size, width]``: :func:`expected_block`'s
    place-only part (read only; callers add to it out of place)."""
    h = torch.arange(h0, h1, hstep, dtype=torch.int64).view(-1, 1, 1)
    grid = ((h * block_size + torch.arange(block_size).view(1, -1, 1)) * width
            + torch.arange(width).view(1, 1, -1)).unsqueeze(0)
    layer = torch.arange(num_layers, dtype=torch.int64).view(num_layers, 1, 1, 1)
    return ((grid * 40503 + layer * 2654435761) % _MOD).to(torch.int16)


def fill_block(
    whole: torch.Tensor, block_id: int, tokens: Sequence[int], block_index: int, seed: int,
    first_position: int = 0, heads: range | None = None, layer: int | None = None,
) -> None:
    """Write block ``block_index`` of ``tokens`` into ``block_id`` of the KV
    cache ``whole`` (``[num_layers, num_blocks, heads, block_size, 2*head]``),
    positions ``first_position`` .. the last token of the block; ``heads`` and
    ``layer`` (that layer only, as a forward pass stores them) as in
    :func:`expected_block`."""
    values, valid = expected_block(tokens, block_index, seed, tuple(whole.shape[2:]),
                                   whole.shape[0], whole.dtype, heads, layer)
    layers = slice(None) if layer is None else slice(layer, layer + 1)
    whole[layers, block_id, :, first_position:valid] = values[:, :, first_position:valid]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same shape and dtype, either strided) hold
    the same bits: stricter than ``torch.equal`` on floats (``-0.0`` is not
    ``0.0``, a NaN equals its own bits) and, compared as integers, about 4x
    faster on fp16 here."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))
