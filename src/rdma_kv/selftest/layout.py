"""The layout checks the handshake relies on, run on real tensors.

Two engines copy KV block for block only when their caches have the same
memory order, and the connector reads that order from the tensors' strides
(``connector.geometry``: block dim, K/V dim, NHD vs HND), never from a name.
This check builds the KV layouts GPU backends use (FlashAttention's
``[2, blocks, block_size, heads, head]`` in NHD and HND order, FlashInfer's
``[blocks, 2, ...]`` in both, MLA's ``[blocks, block_size, latent]``) on
the device under test, and checks for each:

- the layout and ``kv_layout`` (NHD, HND, MLA) derived from the strides;
- that every block's bytes are where the geometry says: each block is
  filled with its own value through torch's indexing, then the storage is
  read back byte for byte at the geometry's segments;
- that the handshake's compatibility record refuses NHD against HND of one
  shape (``kv_layout`` and ``layouts`` differ) and accepts two allocations
  of one layout.

Device-agnostic: ``cuda:N`` in the selftest, ``cpu`` in the tests.

May import: numpy, rdma_kv.connector (geometry, specs, rdma.compat,
rdma.wire), rdma_kv.selftest.report; torch is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdma_kv.connector.geometry import Layout, derive_geometry
from rdma_kv.connector.rdma.compat import compat_info
from rdma_kv.connector.rdma.wire import CompatInfo
from rdma_kv.connector.specs import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec
from rdma_kv.selftest.report import Check

__all__ = ["CASES", "Case", "layout_check"]

BLOCKS, BLOCK, HEADS, HEAD, LATENT = 8, 16, 4, 32, 576
HND = (0, 1, 3, 2, 4)  # a permuted view of [.., heads, block_size, head]: vLLM's HND caches


@dataclass(frozen=True)
class Case:
    name: str
    allocation: tuple[int, ...]  # what is allocated
    permute: tuple[int, ...] | None  # the view the engine hands over
    layout: Layout
    kv_layout: str

    @property
    def mla(self) -> bool:
        return self.kv_layout == "MLA"


CASES = (
    Case("FlashAttention NHD", (2, BLOCKS, BLOCK, HEADS, HEAD), None, Layout.KV_FIRST, "NHD"),
    Case("FlashAttention HND", (2, BLOCKS, HEADS, BLOCK, HEAD), HND, Layout.KV_FIRST, "HND"),
    Case("FlashInfer NHD", (BLOCKS, 2, BLOCK, HEADS, HEAD), None, Layout.BLOCKS_FIRST, "NHD"),
    Case("FlashInfer HND", (BLOCKS, 2, HEADS, BLOCK, HEAD), HND, Layout.BLOCKS_FIRST, "HND"),
    Case("MLA", (BLOCKS, BLOCK, LATENT), None, Layout.BLOCKS_FIRST, "MLA"),
)


def _config(case: Case) -> KVCacheConfig:
    spec = (MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype="float16")
            if case.mla else FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype="float16"))
    return KVCacheConfig.uniform(BLOCKS, ["layer.0"], spec)


def _one(torch: Any, device: str, case: Case) -> tuple[CompatInfo, str | None]:
    """The case's compatibility record, and what is wrong with its geometry (None: right)."""
    tensor = torch.zeros(case.allocation, dtype=torch.float16, device=torch.device(device))
    if case.permute is not None:
        tensor = tensor.permute(case.permute)
    config = _config(case)
    geometry = derive_geometry({"layer.0": tensor}, config)
    layer = geometry.layers[0]
    compat = compat_info(config, geometry, 1 if case.mla else HEADS, "selftest")
    if (layer.layout, layer.kv_layout) != (case.layout, case.kv_layout):
        return compat, (f"{case.name}: strides {tuple(tensor.stride())} read as {layer.layout.value} "
                        f"{layer.kv_layout or '?'}, expected {case.layout.value} {case.kv_layout}")
    for b in range(BLOCKS):  # each block holds its own value, written through torch's view
        (tensor[:, b] if case.layout is Layout.KV_FIRST else tensor[b]).fill_(b + 1)
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage()).cpu().numpy()
    shift = geometry.regions[0].base_address - int(tensor.untyped_storage().data_ptr())
    block_bytes = 2 * (BLOCK * LATENT if case.mla else 2 * BLOCK * HEADS * HEAD)
    if layer.block_nbytes != block_bytes:
        return compat, f"{case.name}: the geometry gives {layer.block_nbytes} bytes per block, expected {block_bytes}"
    for seg in layer.segments:
        for b in range(BLOCKS):
            start = shift + seg.offset + b * seg.block_stride_bytes
            values = whole[start:start + seg.block_nbytes].view(np.float16)
            if not np.all(values == b + 1):
                return compat, (f"{case.name}: block {b}'s segment at byte {start} (+{seg.block_nbytes}) holds "
                                f"{sorted(set(values.tolist()))[:4]}, not only block {b}'s value {b + 1}")
    return compat, None


def layout_check(torch: Any, device: str, name: str = "layout", cases: Sequence[Case] = CASES) -> Check:
    """PASS when every case's geometry is right on ``device`` and the
    handshake's record tells NHD from HND (``cases`` must hold both
    FlashAttention cases); FAIL naming every problem."""
    try:
        results = {case.name: _one(torch, device, case) for case in cases}
        problems = [why for _, why in results.values() if why]
        nhd, hnd = results["FlashAttention NHD"][0], results["FlashAttention HND"][0]
        again = _one(torch, device, next(c for c in cases if c.name == "FlashAttention NHD"))[0]  # other addresses
    except Exception as exc:  # report, never raise: this is a diagnostic
        return Check.failed(name, f"on {device}: {type(exc).__name__}: {exc}")
    fields = {line.split(":")[0] for line in nhd.mismatches(hnd)}
    if not {"kv_layout", "layouts"} <= fields:
        problems.append(f"the handshake's compatibility record does not tell NHD from HND (differs in {sorted(fields)})")
    if again != nhd:
        problems.append(f"two NHD allocations give different compatibility records: {nhd.mismatches(again)}")
    if problems:
        return Check.failed(name, f"on {device}: " + "; ".join(problems))
    return Check.passed(name, f"on {device}: {', '.join(c.name for c in cases)}: layout and NHD/HND read from the "
                        "tensors' strides, every block's bytes where the geometry puts them; the handshake "
                        "refuses NHD vs HND (kv_layout, layouts) and accepts two NHD allocations",
                        layouts=[c.name for c in cases], device=device)
