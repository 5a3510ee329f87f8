"""What the handshake compares of a vLLM engine beyond its KV cache's
shape: which model it runs (:func:`model_id`) and, for an fp8 KV cache,
the k/v scales its bytes are stored under (:func:`kv_cache_scales`).

Reads vLLM's config objects by attribute (``model_config``,
``cache_config``, ``compilation_config.static_forward_context``); imports
the standard library and ``rdma_kv.errors`` only, so it runs against
vLLM's real objects and plain stand-ins alike.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import PurePosixPath
from typing import Any

from rdma_kv.errors import ConfigError

__all__ = ["ARCHITECTURE_FIELDS", "kv_cache_scales", "model_id"]

ARCHITECTURE_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "hidden_act", "rms_norm_eps", "layer_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "max_position_embeddings",
    "sliding_window", "layer_types", "attention_bias", "tie_word_embeddings",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
)
"""The fields of the model's (text) ``hf_config`` whose digest joins a
derived identity: what makes two checkpoints of one name different
networks (a path's last component alone would not tell ``/a/model`` from
``/b/model``). Not its path, dtype or transformers version: one model
copied elsewhere keeps its identity. Weights are not read: two fine-tunes
of one base with one directory name and one config are one identity
(set ``--served-model-name`` or ``model_id``)."""


def _architecture_digest(model_config: Any) -> str:
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    outer = getattr(model_config, "hf_config", None)
    fields = {name: getattr(hf, name) for name in ARCHITECTURE_FIELDS if getattr(hf, name, None) is not None}
    fields["architectures"] = list(getattr(outer, "architectures", None) or [])
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_id(vllm_config: Any) -> str:
    """The model this engine runs, as the handshake compares it: the first
    ``--served-model-name`` when one was given (routers send the prefill
    and the decode leg by that name), else the model's last path component
    (or hub name) and a digest of its architecture (``ARCHITECTURE_FIELDS``),
    e.g. ``Llama-3-8B@3f1c0a9b2d4e``. One model loaded from two paths ending
    in one name (``/models/m``, ``/mnt/m``) has one identity; paths of other
    names need the same served name or ``model_id`` on both engines. Empty
    without a model config (not compared)."""
    model_config = getattr(vllm_config, "model_config", None)
    model = getattr(model_config, "model", None)
    if not model:
        return ""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):  # vLLM keeps the first (ModelConfig's get_served_model_name)
        served = served[0] if served else None
    if served and str(served) != str(model):  # vLLM puts the model's own name there when none was given
        return str(served)
    name = PurePosixPath(str(model).rstrip("/")).name or str(model)
    return f"{name}@{_architecture_digest(model_config)}"


def kv_cache_scales(vllm_config: Any) -> str:
    """The k/v scales of every attention layer of an fp8 KV cache (vLLM
    stores K/k_scale and V/v_scale, per layer, per tensor): ``k 1.0 v 1.0,
    N layers`` when all layers share one pair, else a SHA-256 of every
    layer's name and pair. Empty for an unquantized cache (vLLM uses no
    scale there). vLLM 0.32 fixes the scales when it loads the weights
    (from the checkpoint, else 1.0; ``process_weights_after_loading``) and
    builds the worker's connector after that, so they are known here; it
    has no runtime scale calculation (``calculate_kv_scales`` is gone from
    its ``CacheConfig``). An fp8 cache whose layers show no scales is
    refused (``ConfigError``): they could not be compared."""
    dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "") or "")
    if not dtype.startswith("fp8"):
        return ""
    compilation = getattr(vllm_config, "compilation_config", None)
    context = getattr(compilation, "static_forward_context", None) or {}
    pairs = sorted((str(name), float(layer._k_scale_float), float(layer._v_scale_float))
                   for name, layer in context.items()
                   if getattr(layer, "_k_scale_float", None) is not None
                   and getattr(layer, "_v_scale_float", None) is not None)
    if not pairs:
        raise ConfigError(
            f"--kv-cache-dtype {dtype}: no attention layer with k/v scales in vLLM's forward context, so "
            "this engine's fp8 scales cannot be compared with its peers' (the same fp8 bytes under other "
            "scales are other values); rdma-kv needs the model loaded before the KV connector is built "
            "(vLLM 0.32 does so), or run the KV cache unquantized (--kv-cache-dtype auto)")
    if any(not (math.isfinite(k) and math.isfinite(v)) for _, k, v in pairs):
        raise ConfigError(f"--kv-cache-dtype {dtype}: a layer's k/v scale is not finite: {pairs[:4]}")
    if len({(k, v) for _, k, v in pairs}) == 1:
        _, k, v = pairs[0]
        return f"k {k!r} v {v!r}, {len(pairs)} layers"
    text = json.dumps([[name, k.hex(), v.hex()] for name, k, v in pairs])
    return f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:24]}, {len(pairs)} layers"
