"""vLLM 0.32 objects -> rdma-kv's engine-neutral ones (and results back).

Owns the translation functions the adapter (``connector.py``) calls, and
``Requests``, which keeps a request's checked prompt between its hooks:
vLLM's ``KVTransferConfig`` and parallel layout -> our ``KVTransferConfig``;
vLLM's ``KVCacheConfig`` (specs, groups, ``KVCacheTensor(size, layers,
layer_stride, block_stride, offset, host_resident)``) -> ours;
``Request``, ``KVCacheBlocks``, ``SchedulerOutput`` (whose cached requests
are parallel lists) and ``KVConnectorOutput`` -> ours. No transfer logic.

Duck-typed on purpose: it reads attributes and never imports vLLM, so it
is unit-testable without vLLM and costs nothing to import. Imports the
standard library, ``rdma_kv.errors`` and ``rdma_kv.connector``'s
``config``, ``specs`` and ``types``.
"""

from __future__ import annotations

import collections
import hashlib
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from rdma_kv.connector.types import (
    CachedRequestData,
    GroupBlockIds,
    KVCacheBlocks,
    KVConnectorOutput,
    NewRequestData,
    Request,
    RequestId,
    SchedulerOutput,
    as_block_ids,
)
from rdma_kv.errors import ConfigError, SpecError

__all__ = [
    "DEFAULT_HOST",
    "REQUESTS_KEPT_TOKENS",
    "Requests",
    "VLLM_KV_TRANSFER_FIELDS",
    "VLLM_PARAM_ANNOTATIONS",
    "block_ids",
    "check_vllm_fields",
    "connector_output",
    "extra_keys",
    "group_block_ids",
    "kv_cache_config",
    "kv_cache_spec",
    "request",
    "scheduler_output",
    "transfer_config",
]

DEFAULT_HOST = "127.0.0.1"
"""Side-channel host when ``kv_connector_extra_config`` names none: vLLM
0.32's ``KVTransferConfig`` has no ``kv_ip``. Loopback, so that nothing is
exposed by default; set ``side_channel_host`` (and ``advertise_host`` when
binding ``0.0.0.0``) for a real cluster."""

VLLM_KV_TRANSFER_FIELDS = ("kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port",
                           "kv_connector_extra_config", "kv_connector_module_path",
                           "enable_permute_local_kv", "kv_load_failure_policy")
"""Every field of vLLM 0.32's ``KVTransferConfig`` (a test ties this to the
installed vLLM), for checking a config without importing vLLM
(``rdma-kv info --config``). Our engine-neutral config's ``kv_ip``,
``kv_rank``, ``kv_parallel_size`` and ``kv_buffer_size`` are not among
them: vLLM refuses a config that sets one."""

VLLM_PARAM_ANNOTATIONS = ("remote_prefill_cached_tokens",)
"""Keys vLLM itself adds to the params a producer returned (the scheduler
annotates params that say ``do_remote_prefill`` with the prefill's cache
hits, for the decode's usage report). A router forwards them verbatim;
they are vLLM's, not the connector's, so they are dropped before parsing."""


# --- configuration ----------------------------------------------------------------


def check_vllm_fields(raw: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` for keys of a ``--kv-transfer-config`` JSON that
    vLLM 0.32's ``KVTransferConfig`` does not have (vLLM refuses them at
    startup), naming the key to use instead where there is one."""
    unknown = sorted(set(raw) - set(VLLM_KV_TRANSFER_FIELDS))
    if not unknown:
        return
    hint = ("; the side channel's host is kv_connector_extra_config['side_channel_host']"
            if "kv_ip" in unknown else "")
    raise ConfigError(f"vLLM 0.32's KVTransferConfig has no field(s) {unknown} (vLLM refuses "
                      f"them at startup){hint}; its fields are {list(VLLM_KV_TRANSFER_FIELDS)}")


def transfer_config(vllm_kv: Any, *, tp_rank: int = 0, tp_size: int = 1,
                    dp_rank: int = 0, attention_backend: str = "",
                    total_kv_heads: int = 0, kv_cache_dtype: str = "", model_id: str = "",
                    kv_cache_scales: str = "") -> KVTransferConfig:
    """Our ``KVTransferConfig`` from vLLM's (``vllm.config.KVTransferConfig``).

    vLLM's fields map one to one (``kv_connector``, ``engine_id``,
    ``kv_buffer_device``, ``kv_role``, ``kv_port``, ``kv_connector_extra_config``,
    ``kv_connector_module_path``, ``kv_load_failure_policy``). The host comes
    from the extra config's ``side_channel_host`` (default ``DEFAULT_HOST``).
    The tensor-parallel rank and size come from vLLM's parallel config, never
    from the user; with data parallelism, DP rank ``d`` uses base port
    ``port + d * tp_size`` (rank ``r`` adds ``r``), so ranks never collide.
    ``kv_cache_dtype`` is vLLM's ``cache_config.cache_dtype`` ("auto": none),
    compared at the handshake (its fp8 formats share one tensor dtype), and
    so is ``kv_cache_scales`` (``identity.kv_cache_scales``). ``model_id``
    (``identity.model_id``) is the derived identity of the model, which the
    operator's ``model_id`` in the extra config overrides.
    """
    extra = dict(getattr(vllm_kv, "kv_connector_extra_config", None) or {})
    for key in ("tp_rank", "tp_size", "total_kv_heads", "attention_backend", "kv_cache_dtype", "kv_cache_scales"):
        if key in extra:
            raise ConfigError(
                f"kv_connector_extra_config[{key!r}] is set, but under vLLM the tensor-parallel "
                "rank and size, the attention backend, the KV-cache dtype and its scales come from "
                "vLLM's config; remove it")
    host = extra.get("side_channel_host", DEFAULT_HOST)
    if not isinstance(host, str) or not host:
        raise ConfigError(f"kv_connector_extra_config['side_channel_host'] must be a host, got {host!r}")
    port = extra.get("side_channel_port", getattr(vllm_kv, "kv_port", 14579))
    if dp_rank and isinstance(port, int) and port:
        extra["side_channel_port"] = port + dp_rank * tp_size
    extra.update(tp_rank=tp_rank, tp_size=tp_size)
    if total_kv_heads:  # the model's, for heterogeneous-TP planning (worker side)
        extra["total_kv_heads"] = total_kv_heads
    if attention_backend:  # part of the compatibility check (worker side)
        extra["attention_backend"] = attention_backend
    if kv_cache_dtype and kv_cache_dtype != "auto":  # likewise: "auto" is the tensor's own dtype
        extra["kv_cache_dtype"] = kv_cache_dtype
    if kv_cache_scales:
        extra["kv_cache_scales"] = kv_cache_scales
    if "model_id" in extra:  # the operator's (one model loaded from paths of different names)
        given = extra["model_id"]
        if not isinstance(given, str) or not given.strip():
            raise ConfigError(f"kv_connector_extra_config['model_id'] must name the model (the same on the "
                              f"prefill and the decode engines), got {given!r}; remove it to derive it from "
                              "vLLM's model config")
    elif model_id:
        extra["model_id"] = model_id
    device: Any = getattr(vllm_kv, "kv_buffer_device", None) or "cpu"  # KVTransferConfig parses it
    policy: Any = getattr(vllm_kv, "kv_load_failure_policy", None) or "fail"
    return KVTransferConfig(
        kv_connector=vllm_kv.kv_connector,
        engine_id=None if vllm_kv.engine_id is None else str(vllm_kv.engine_id),
        kv_buffer_device=device,
        kv_role=vllm_kv.kv_role,
        kv_ip=host,
        kv_port=getattr(vllm_kv, "kv_port", 14579),
        kv_connector_extra_config=extra,
        kv_connector_module_path=getattr(vllm_kv, "kv_connector_module_path", None),
        kv_load_failure_policy=policy,
    )


def kv_cache_spec(spec: Any) -> KVCacheSpec:
    """Our spec for a vLLM ``FullAttentionSpec``, ``MLAAttentionSpec`` or
    ``SlidingWindowSpec``. Other kinds (Mamba, chunked-local, sink, cross
    attention...) and anything whose page differs from the plain K/V page
    (padding, quantised KV, a V head of another size) raise ``SpecError``:
    the connector moves whole pages and must know their size exactly. So
    does a sliding window that keeps extra tokens below it
    (``extra_retained_tokens``): the connector skips exactly the blocks
    before the window, and would leave those unwritten."""
    kind = type(spec).__name__
    common = dict(block_size=int(spec.block_size), num_kv_heads=int(spec.num_kv_heads),
                  head_size=int(spec.head_size), dtype=spec.dtype)
    if kind == "MLAAttentionSpec":
        ours: KVCacheSpec = MLAAttentionSpec(**common)
    elif kind == "FullAttentionSpec":
        head_v = getattr(spec, "head_size_v", None)
        if head_v not in (None, spec.head_size):
            raise SpecError(f"FullAttentionSpec with head_size_v={head_v} != head_size="
                            f"{spec.head_size} is not supported by RdmaKVConnector")
        ours = FullAttentionSpec(**common, sliding_window=getattr(spec, "sliding_window", None))
    elif kind == "SlidingWindowSpec":
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        if extra:
            # vLLM keeps these tokens' blocks below the window (multi-module MTP re-prefills
            # them) and counts them loaded; a transfer that skips the window's blocks would
            # leave them unwritten, and NIXL's prefill back-off for such drafters is not done here.
            raise SpecError(f"SlidingWindowSpec with extra_retained_tokens={extra} (speculative decoding "
                            "that reads prefill tokens ahead: num_prefill_lookahead_tokens > 1) is not "
                            "supported by RdmaKVConnector: its blocks below the window would be counted "
                            "loaded and never transferred")
        ours = SlidingWindowSpec(**common, sliding_window=int(spec.sliding_window))
    else:
        raise SpecError(f"RdmaKVConnector supports FullAttentionSpec, MLAAttentionSpec and "
                        f"SlidingWindowSpec KV caches; this model has a {kind}")
    theirs = getattr(spec, "page_size_bytes", ours.page_size_bytes)
    if theirs != ours.page_size_bytes:
        raise SpecError(f"vLLM's {kind} has pages of {theirs} bytes, rdma-kv computes "
                        f"{ours.page_size_bytes} for {common} (padded or quantised KV is not "
                        "supported)")
    return ours


def kv_cache_config(config: Any) -> KVCacheConfig:
    """Our ``KVCacheConfig`` from vLLM's. vLLM 0.32's ``KVCacheTensor`` names
    its layers ``layers`` (older releases: ``shared_by``); its placement
    fields (``layer_stride``, ``block_stride``, ``offset``) are not copied:
    the connector derives every layer's geometry from the registered tensors
    themselves (shape, strides, storage), whatever the backend's layout."""
    groups = tuple(KVCacheGroupSpec(tuple(g.layer_names), kv_cache_spec(g.kv_cache_spec))
                   for g in config.kv_cache_groups)
    tensors = []
    for t in config.kv_cache_tensors:
        layers = getattr(t, "layers", None)
        if layers is None:
            layers = getattr(t, "shared_by", None) or ()
        tensors.append(KVCacheTensor(size=int(t.size), shared_by=tuple(layers)))
    return KVCacheConfig(int(config.num_blocks), tuple(tensors), groups)


# --- per request and per step ------------------------------------------------------------


def request(req: Any) -> Request:
    """Our ``Request`` for a vLLM ``Request`` (the engine's id, with its random
    suffix, is the id everywhere in the connector).

    ``kv_transfer_params`` lose ``VLLM_PARAM_ANNOTATIONS``; the rest goes to
    the connector as is (it rejects unknown keys). A prompt given as
    embeddings has no token ids: the connector only counts prompt tokens,
    so zeros of the right length stand in for them.
    """
    ids = req.prompt_token_ids
    if ids is None:
        ids = [0] * int(req.num_prompt_tokens)
    return _engine_fields(Request(str(req.request_id), ids, _params(req), extra_keys(req)), req)


def extra_keys(req: Any) -> tuple[Any, ...]:
    """What besides its token ids decides a vLLM request's KV, as vLLM's
    prefix cache hashes it with each block (``kv_cache_utils``): the LoRA
    adapter, each multimodal input (identifier and position), the cache
    salt, and for a prompt given as embeddings (its token ids are zeros) a
    hash of them. The prefill's and the decode's must be equal for a load
    (``params.prompt_digest`` covers them), so the adapter is named by its
    name only: two engines may load one adapter from paths of their own
    (vLLM's prefix cache, within one engine, hashes the path too)."""
    keys: list[Any] = []
    lora = getattr(req, "lora_request", None)
    if lora:
        keys.append(("lora", str(getattr(lora, "lora_name", ""))))
    for feature in getattr(req, "mm_features", None) or ():
        position = getattr(feature, "mm_position", None)
        keys.append(("mm", str(feature.identifier), getattr(position, "offset", None)))
    salt = getattr(req, "cache_salt", None)
    if salt:
        keys.append(("cache_salt", str(salt)))
    embeds = getattr(req, "prompt_embeds", None)
    if embeds is not None:
        keys.append(("prompt_embeds", embeds_hash(embeds)))
    return tuple(keys)


def embeds_hash(embeds: Any) -> bytes:
    """SHA-256 of a prompt's embeddings (dtype, shape and bytes), once per
    request (``Requests`` keeps it with the prompt): 8 MB of a 1k-token
    prompt of an 8B model (bfloat16) hash in ~7 ms on this host."""
    import torch

    t = embeds.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.digest()


def _params(req: Any) -> Mapping[str, Any] | None:
    params = req.kv_transfer_params
    if params and any(k in params for k in VLLM_PARAM_ANNOTATIONS):
        params = {k: v for k, v in params.items() if k not in VLLM_PARAM_ANNOTATIONS}
    return params


def _engine_fields(ours: Request, req: Any) -> Request:
    ours.num_computed_tokens = int(req.num_computed_tokens)
    ours.output_token_ids = list(req.output_token_ids)
    # vLLM's NixlConnector holds the KV of FINISHED_STOPPED and _LENGTH_CAPPED
    # requests only; these three finished without an answer to hand over.
    ours.aborted = str(getattr(req, "status", "")) in ("FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR")
    return ours


def _prompt_size(req: Any) -> int:
    ids = req.prompt_token_ids
    return int(req.num_prompt_tokens) if ids is None else len(ids)


REQUESTS_KEPT_TOKENS = 1 << 22
"""The most prompt tokens :class:`Requests` keeps checked (~32 MB of tuple)."""


class Requests:
    """Our ``Request`` for each vLLM request the scheduler hooks are called
    with, its prompt checked (and digested, ``Request.memo``) once rather
    than at every hook: vLLM asks ``get_num_new_matched_tokens`` at every
    step a request waits, then ``update_state_after_alloc`` and
    ``request_finished``; a 32k-token prompt took ~1 ms of the engine
    core's thread per hook to check and ~1.5 ms to digest.

    An entry is the same vLLM object (a weak reference: nothing is kept
    alive) with a prompt of the same length (vLLM's streaming sessions
    extend a waiting request's prompt in place); ``kv_transfer_params``
    and the engine's fields are read again at every hook. At most
    ``REQUESTS_KEPT_TOKENS`` prompt tokens are kept, the least recently
    used dropped first (rebuilt when asked again); :meth:`finished` drops
    a request's entry."""

    def __init__(self, kept_tokens: int = REQUESTS_KEPT_TOKENS) -> None:
        self._kept_tokens = kept_tokens
        self._tokens = 0
        self._entries: collections.OrderedDict[str, tuple[weakref.ref[Any], int, Request]] = (
            collections.OrderedDict())

    def __len__(self) -> int:
        return len(self._entries)

    def of(self, req: Any) -> Request:
        kept = self._kept(req)
        if kept is not None:
            return kept
        rid, size = str(req.request_id), _prompt_size(req)
        ours = request(req)
        self._drop(rid)
        try:
            ref = weakref.ref(req)
        except TypeError:
            return ours  # (an object without weak references is not kept)
        self._entries[rid] = (ref, size, ours)
        self._tokens += size
        while self._tokens > self._kept_tokens and len(self._entries) > 1:
            self._drop(next(iter(self._entries)))
        return ours

    def finished(self, req: Any) -> Request:
        """``of(req)``, the entry dropped (none made): the request is done."""
        ours = self._kept(req) or request(req)
        self._drop(str(req.request_id))
        return ours

    def _kept(self, req: Any) -> Request | None:
        """The next ``Request`` from ``req``'s entry, if it is still ``req``'s."""
        rid = str(req.request_id)
        entry = self._entries.get(rid)
        if entry is None or entry[0]() is not req or entry[1] != _prompt_size(req):
            return None
        self._entries.move_to_end(rid)
        return _engine_fields(entry[2].with_params(_params(req)), req)

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._tokens -= entry[1]


def block_ids(blocks: Any) -> KVCacheBlocks:
    """Our ``KVCacheBlocks`` from vLLM's (``get_block_ids()``: a list per group)."""
    return KVCacheBlocks.of(*blocks.get_block_ids())


def group_block_ids(ids: Iterable[Iterable[int]]) -> GroupBlockIds:
    """Block ids per group, as vLLM hands them to ``request_finished_all_groups``
    (a tuple of lists, one per KV-cache group)."""
    return tuple(as_block_ids(list(group)) for group in ids)


def _groups(ids: Iterable[Iterable[int]] | None) -> tuple[tuple[Any, ...], ...] | None:
    return None if ids is None else tuple(as_block_ids(list(g)) for g in ids)


def scheduler_output(out: Any) -> SchedulerOutput:
    """Our ``SchedulerOutput``: one record per cached request from vLLM's
    struct of arrays (``req_ids[i]``, ``new_block_ids[i]``, ...);
    ``resumed_req_ids`` (a set) becomes each record's flag."""
    new = tuple(
        NewRequestData(RequestId(r.req_id), tuple(r.prompt_token_ids or ()),
                       _groups(r.block_ids) or (), int(r.num_computed_tokens))
        for r in out.scheduled_new_reqs
    )
    cached_in = out.scheduled_cached_reqs
    resumed = getattr(cached_in, "resumed_req_ids", None) or set()
    cached = tuple(
        CachedRequestData(RequestId(rid), _groups(cached_in.new_block_ids[i]),
                          int(cached_in.num_computed_tokens[i]), rid in resumed)
        for i, rid in enumerate(cached_in.req_ids)
    )
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={RequestId(k): int(v) for k, v in out.num_scheduled_tokens.items()},
        finished_req_ids=frozenset(RequestId(r) for r in out.finished_req_ids),
    )


def connector_output(out: Any) -> KVConnectorOutput:
    """Our ``KVConnectorOutput`` from vLLM's (its ``None`` sets are empty)."""
    return KVConnectorOutput.of(out.finished_sending, out.finished_recving,
                                getattr(out, "invalid_block_ids", None))


def finished_sets(sending: Iterable[str], recving: Iterable[str]
                  ) -> tuple[set[str] | None, set[str] | None]:
    """vLLM's ``get_finished`` form: ``None`` for an empty set."""
    return (set(sending) or None, set(recving) or None)


def stats_dict(data: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A plain, serialisable copy of the connector's stats (crosses processes)."""
    return None if not data else {k: (dict(v) if isinstance(v, Mapping) else v)
                                   for k, v in data.items()}
