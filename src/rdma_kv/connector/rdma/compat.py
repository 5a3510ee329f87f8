"""What two engines must agree on before one reads the other's KV cache.

Owns :func:`compat_info` (the model's cache, in terms independent of
tensor parallelism: the handshake compares it field by field) and
:func:`rank_info` (one rank's share of the model). The records themselves
(``CompatInfo``, ``RankInfo``) are wire messages (``wire``).

Imports the connector's ``geometry``, ``specs`` and ``rdma.wire``.
"""

from __future__ import annotations

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma.wire import CompatInfo, RankInfo
from rdma_kv.connector.specs import AttentionSpec, KVCacheConfig, normalize_dtype
from rdma_kv.errors import SpecError

__all__ = ["compat_info", "group_heads", "rank_info"]


def _rank_heads(spec: object) -> int:
    """KV heads one rank holds (1 for MLA, whose latent is not split)."""
    if isinstance(spec, AttentionSpec):
        return 1 if spec.use_mla else spec.num_kv_heads
    return 1


def _with_format(dtype: str, kv_cache_dtype: str) -> str:
    """``dtype`` with the engine's name for its bytes' format, in canonical
    spelling where it has one (vLLM's ``fp8`` and ``fp8_e4m3`` are one
    format), and not at all where it names the tensor's own dtype (an
    explicit ``bfloat16`` against another engine's ``auto`` on a bf16 model)."""
    try:
        name = normalize_dtype(kv_cache_dtype)
    except SpecError:
        name = kv_cache_dtype
    return dtype if name == dtype else f"{dtype} ({name})"


def compat_info(kv_cache_config: KVCacheConfig, geometry: KVCacheGeometry, total_kv_heads: int,
                attention_backend: str = "", transfer_mode: str = "pull", kv_cache_dtype: str = "",
                model_id: str = "", kv_cache_scales: str = "") -> CompatInfo:
    """What this engine's KV cache is, for the handshake to compare, in
    terms independent of tensor parallelism: model shape (``total_kv_heads``
    before sharding), dtype, block size, the spec of each KV-cache group
    (``+``-joined, page size per head) and, with several groups, each
    layer's group; the attention backend, and per layer the layout, bytes
    per head and memory order (so an NHD and an HND cache of one shape
    differ). ``kv_cache_dtype`` (the engine's name for the format of the
    bytes, when the tensor's dtype does not tell it: vLLM's fp8 caches are
    all ``uint8``) joins the dtype, so an ``fp8_e4m3`` and an ``fp8_e5m2``
    cache differ. ``model_id`` names the model (two models of one shape
    differ; empty: not known, compared with nothing) and ``kv_cache_scales``
    a quantized cache's k/v scales (``RdmaSettings``)."""
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    spec = specs[0]
    heads = _rank_heads(spec)
    layouts = [
        f"{layer.layout.value}:" + ",".join(str(s.block_nbytes // heads) for s in layer.segments)
        + f":{layer.head_nbytes}" + (f":{layer.memory_order}" if layer.memory_order else "")
        for layer in geometry.layers
    ]
    head_size, dtype = (spec.head_size, spec.dtype) if isinstance(spec, AttentionSpec) else (0, "")
    if kv_cache_dtype:
        dtype = _with_format(dtype, kv_cache_dtype)
    return CompatInfo(
        num_layers=len(geometry.layers),
        block_size=spec.block_size,
        total_kv_heads=total_kv_heads if isinstance(spec, AttentionSpec) and not spec.use_mla else 1,
        head_size=head_size,
        dtype=dtype,
        spec="+".join(f"{s.type_id.rsplit('_', 2)[0]}_{s.block_size}_{s.page_size_bytes // _rank_heads(s)}"
                      for s in specs),
        layouts=layouts,
        kv_layout="/".join(sorted({layer.kv_layout for layer in geometry.layers})),
        attention_backend=attention_backend,
        layer_groups=[layer.group for layer in geometry.layers] if len(specs) > 1 else [],
        transfer_mode=transfer_mode,
        model_id=model_id,
        kv_cache_scales=kv_cache_scales,
    )


def rank_info(kv_cache_config: KVCacheConfig, tp_rank: int, tp_size: int) -> RankInfo:
    """This rank's share of the model, for the handshake."""
    return RankInfo(tp_rank, tp_size, _rank_heads(kv_cache_config.kv_cache_groups[0].kv_cache_spec))


def group_heads(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """KV heads one rank holds in each KV-cache group (1 for MLA): what the
    rank plan checks before heads are read across different TP sizes."""
    return tuple(_rank_heads(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups)
