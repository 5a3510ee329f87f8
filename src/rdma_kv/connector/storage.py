"""StorageConnector: a prefix cache of KV blocks in local files.

Owns a second real connector, the kind of cache an operator layers under
network transfer (``MultiConnector`` with the RDMA connector first). Each
full block of a prompt is one safetensors file named by a chained hash:
block ``i``'s key hashes block ``i - 1``'s key and block ``i``'s tokens, so a
key names the whole prefix up to its block, like an engine's prefix cache.
The chain starts from a namespace digest of the cache format, the
configured ``namespace`` (which must identify the model weights: the KV
depends on them, the specs cannot tell two checkpoints apart) and the
KV-cache specs. A file holds one uint8 tensor per layer (the block's bytes
in the saving engine's layout, so any dtype is stored bit-exact), with the
layout and a BLAKE2b digest in its metadata; a mismatch on load is a load
error, never silently wrong KV.

Roles: a producer (``kv_producer``/``kv_both``) saves the full blocks of
every prompt whose prefill completes; a consumer (``kv_consumer``/``kv_both``)
loads the longest stored prefix, synchronously in ``start_load_kv``. Files
are written to a temporary name, fsynced and renamed, so a reader never sees
a partial file. Nothing is ever evicted: the operator owns the directory.

The files of one namespace sit in a directory per worker layout (a digest of
the layout signature, which the worker hands the scheduler in its handshake
metadata), so engines of different layouts (NHD/HND, another block shape)
that share a namespace never see each other's files. A file that fails to
load (corrupt, truncated, unreadable) is not offered again by that engine's
scheduler: its prefix misses there, and the next save of the block replaces
the file (atomically, like every save). A request with a block whose load
failed saves nothing until it finishes: the forward passes computed its later
blocks over the failed block's stale bytes (with asynchronous scheduling, in
the steps scheduled before the engine heard of the failure too).

Temporary files live in the layout directory's ``tmp/``, named
``<key>.<host>.<pid namespace>.<pid>.<random>.tmp``; each worker removes
at start-up the ones a dead process left (its pid gone on this host and pid
namespace, or, from another host, untouched for ``STALE_TMP_S``): ``storefiles``, which writes every file.

Extra config: ``storage_path`` (required), ``namespace`` (default
``"default"``), ``fsync`` (default true). Host (CPU) KV caches, one KV-cache
group, one worker per engine (tensor parallel size 1).

Imports the standard library, numpy, ``rdma_kv.errors`` and the connector's
``base``, ``config``, ``extrakeys``, ``geometry``, ``specs`` and
``types``; safetensors
lazily (the ``storage`` extra).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rdma_kv.connector.base import (
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.extrakeys import encode_extra_keys
from rdma_kv.connector.geometry import (
    KVCacheGeometry,
    derive_geometry,
    region_bytes,
    storage_address,
)
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.connector.storefiles import remove_stale_temporaries, write_atomic
from rdma_kv.connector.types import (
    BlockId,
    KVCacheBlocks,
    KVConnectorOutput,
    Request,
    RequestId,
    SchedulerOutput,
)
from rdma_kv.errors import ConfigError, NotInitializedError, SpecError

__all__ = ["BlockTransfer", "StorageConnector", "StorageConnectorMetadata",
           "StorageHandshakeMetadata", "chained_block_keys"]

logger = logging.getLogger(__name__)

FORMAT = "rdma-kv-storage/2"  # 2: the layout names each layer's memory order
_EXTRA_KEYS = ("storage_path", "namespace", "fsync")
def chained_block_keys(token_ids: Sequence[int], block_size: int, seed: bytes) -> list[str]:
    """Hex keys of the full blocks of ``token_ids``: key ``i`` is
    ``sha256(key[i-1] || tokens of block i as little-endian int64)``, key
    ``-1`` being ``seed``. Stable across processes and machines."""
    tokens = np.asarray(token_ids, dtype="<i8")
    keys, previous = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hashlib.sha256(previous + tokens[start:start + block_size].tobytes()).digest()
        keys.append(previous.hex())
    return keys


@dataclasses.dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save: ``keys[i]`` <-> ``block_ids[i]``.
    A save's ``context`` is every prompt block of its request: the saved
    blocks' KV was computed over them; its ``replace`` the keys among
    ``keys`` whose stored file failed to load (written even though a file
    exists)."""

    request_id: RequestId
    keys: tuple[str, ...]
    block_ids: tuple[BlockId, ...]
    context: tuple[BlockId, ...] = ()
    replace: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class StorageConnectorMetadata(KVConnectorMetadata):
    loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()
    finished: frozenset[RequestId] = frozenset()


@dataclasses.dataclass(frozen=True)
class StorageHandshakeMetadata(KVConnectorHandshakeMetadata):
    """The worker's layout digest: the scheduler's files live under it."""

    layout: str


@dataclasses.dataclass
class _Tracked:
    """Scheduler-side view of a running request (for deciding saves)."""

    prompt_token_ids: tuple[int, ...]
    block_ids: list[BlockId]
    num_computed_tokens: int
    seed: bytes
    """Its chain's start (``StorageConnector._request_seed``)."""
    saved: bool = False


class StorageConnector(KVConnectorBase):
    """KV blocks to and from local safetensors files; see the module docstring."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        unknown = sorted(set(config.kv_connector_extra_config) - set(_EXTRA_KEYS))
        if unknown:
            raise ConfigError(
                f"StorageConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"valid keys are {list(_EXTRA_KEYS)}"
            )
        if kv_cache_config is None:
            raise ConfigError("StorageConnector needs the engine's KVCacheConfig")
        self._group = kv_cache_config.single_group()
        self._block_size = self._group.kv_cache_spec.block_size
        storage_path = config.get_extra("storage_path", type=str)
        if not storage_path:
            raise ConfigError("kv_connector_extra_config['storage_path'] must not be empty")
        namespace = config.get_extra("namespace", "default", type=str)
        self._fsync = config.get_extra("fsync", True, type=bool)
        identity = json.dumps(
            {
                "format": FORMAT,
                "namespace": namespace,
                "layers": list(self._group.layer_names),
                "spec": self._group.kv_cache_spec.type_id,
                "dtype": getattr(self._group.kv_cache_spec, "dtype", None),
            },
            sort_keys=True,
        ).encode()
        self._seed = hashlib.sha256(identity).digest()
        self._namespace_root = os.path.join(os.path.abspath(storage_path), self._seed.hex()[:16])
        # <namespace root>/<layout digest>: set by register_kv_caches (worker)
        # or set_xfer_handshake_metadata (scheduler)
        self._root: str | None = None
        # scheduler side
        self._lookups: dict[RequestId, tuple[int, tuple[str, ...]]] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._tracked: dict[RequestId, _Tracked] = {}
        self._loading: dict[BlockId, tuple[RequestId, int, str]] = {}  # block -> (req, index, key)
        self._bad_keys: set[str] = set()  # files that failed to load: missed, then replaced
        self._warned_no_layout = False
        # worker side
        self._geometry: KVCacheGeometry | None = None
        self._memory: list[tuple[np.ndarray, int]] = []
        self._load_errors: set[BlockId] = set()
        # Requests with a failed load, and their failed blocks: nothing computed
        # over them is saved until the request finishes.
        self._failed: dict[RequestId, frozenset[BlockId]] = {}
        self._stats = {"blocks_loaded": 0, "blocks_saved": 0, "load_errors": 0,
                       "save_errors": 0}

    @property
    def directory(self) -> str:
        """Where this model's blocks are stored in this engine's layout
        (``storage_path/<namespace digest>/<layout digest>``)."""
        if self._root is None:
            raise NotInitializedError(
                "StorageConnector has no layout yet: the worker learns it in "
                "register_kv_caches(), the scheduler from the worker's handshake metadata "
                "(set_xfer_handshake_metadata)"
            )
        return self._root

    def path_for(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key + ".safetensors")

    def _request_seed(self, extra_keys: Sequence[Any]) -> bytes:
        """The chain's start for a request: the namespace's, or with
        ``extra_keys`` (``Request.extra_keys``: a LoRA adapter, images, a
        cache salt, which decide the KV as much as the tokens) a digest of
        both, so the same tokens with other keys are other files. A request
        without keys keeps the keys (and files) it had."""
        if not extra_keys:
            return self._seed
        return hashlib.sha256(self._seed + encode_extra_keys(extra_keys)).digest()

    def _stored_prefix(self, token_ids: Sequence[int], max_blocks: int, seed: bytes) -> tuple[str, ...]:
        keys = chained_block_keys(token_ids[: max_blocks * self._block_size], self._block_size, seed)
        hits = 0
        while (hits < len(keys) and keys[hits] not in self._bad_keys
               and os.path.exists(self.path_for(keys[hits]))):
            hits += 1
        return tuple(keys[:hits])

    def _has_layout(self) -> bool:
        """Scheduler side: whether the workers' layout is known (else the
        cache is off: a warning, once)."""
        if self._root is None and not self._warned_no_layout:
            self._warned_no_layout = True
            logger.warning("StorageConnector: no handshake metadata from the worker yet, so its "
                           "KV layout (and directory) is unknown: nothing is loaded or saved "
                           "until set_xfer_handshake_metadata")
        return self._root is not None

    def get_kv_connector_stats(self) -> Mapping[str, Any] | None:
        stats = dict(self._stats)
        self._stats = dict.fromkeys(self._stats, 0)
        return stats if any(stats.values()) else None

    # --- scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens of whole stored blocks beyond ``num_computed_tokens``. Never
        the whole prompt: the last prompt token is always computed, since the
        engine needs its logits."""
        self._lookups.pop(request.request_id, None)
        if not self.config.is_kv_consumer or not self._has_layout():
            return 0, False
        max_blocks = (request.num_prompt_tokens - 1) // self._block_size
        keys = self._stored_prefix(request.prompt_token_ids, max_blocks, self._request_seed(request.extra_keys))
        hit_tokens = len(keys) * self._block_size
        if hit_tokens <= num_computed_tokens:
            return 0, False
        # Remember exactly which keys were checked: update_state_after_alloc
        # loads those, whatever appears on disk in between.
        self._lookups[request.request_id] = (num_computed_tokens, keys)
        return hit_tokens - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        if lookup is None:
            raise NotInitializedError(
                f"update_state_after_alloc(request {request.request_id!r}, "
                f"num_external_tokens={num_external_tokens}) without a preceding "
                "get_num_new_matched_tokens that reported those tokens"
            )
        num_computed, keys = lookup
        if num_computed + num_external_tokens != len(keys) * self._block_size:
            raise ConfigError(
                f"request {request.request_id!r}: asked to load {num_external_tokens} tokens "
                f"after {num_computed}, but {len(keys) * self._block_size} were reported"
            )
        block_ids = blocks.group(0)
        if len(block_ids) < len(keys):
            raise ConfigError(
                f"request {request.request_id!r}: {len(block_ids)} blocks allocated, "
                f"{len(keys)} needed to load {len(keys) * self._block_size} tokens"
            )
        first = num_computed // self._block_size
        self._pending_loads.append(
            BlockTransfer(request.request_id, keys[first:], tuple(block_ids[first:len(keys)]))
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StorageConnectorMetadata:
        for request_id in scheduler_output.finished_req_ids:
            self._tracked.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._tracked[new.request_id] = _Tracked(
                new.prompt_token_ids, list(new.block_ids[0]), new.num_computed_tokens,
                self._request_seed(new.extra_keys),
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            tracked = self._tracked.get(cached.request_id)
            if tracked is None:
                continue
            if cached.new_block_ids is not None:
                if cached.resumed_from_preemption:
                    tracked.block_ids = list(cached.new_block_ids[0])
                else:
                    tracked.block_ids.extend(cached.new_block_ids[0])
            tracked.num_computed_tokens = cached.num_computed_tokens
        saves = []
        if self.config.is_kv_producer and self._has_layout():
            for request_id, tracked in self._tracked.items():
                scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
                if tracked.saved or not scheduled:
                    continue
                if tracked.num_computed_tokens + scheduled < len(tracked.prompt_token_ids):
                    continue  # chunked prefill: save once the whole prompt is computed
                tracked.saved = True
                save = self._plan_save(request_id, tracked)
                if save.keys:
                    saves.append(save)
        loads, self._pending_loads = tuple(self._pending_loads), []
        for load in loads:
            for index, (key, block_id) in enumerate(zip(load.keys, load.block_ids)):
                self._loading[block_id] = (load.request_id, index, key)
        return StorageConnectorMetadata(loads=loads, saves=tuple(saves),
                                        finished=frozenset(scheduler_output.finished_req_ids))

    def _plan_save(self, request_id: RequestId, tracked: _Tracked) -> BlockTransfer:
        keys = chained_block_keys(tracked.prompt_token_ids, self._block_size, tracked.seed)
        keys = keys[: len(tracked.block_ids)]
        todo = [i for i, key in enumerate(keys)
                if key in self._bad_keys or not os.path.exists(self.path_for(key))]
        replace = tuple(keys[i] for i in todo if keys[i] in self._bad_keys)
        self._bad_keys.difference_update(replace)  # a save that fails again is learned again
        return BlockTransfer(
            request_id, tuple(keys[i] for i in todo), tuple(tracked.block_ids[i] for i in todo),
            tuple(tracked.block_ids[: len(keys)]), replace,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A block whose load failed names the file that failed: the first
        failed block of each load (the later ones were not read). That key
        is not offered again; the next save of its block replaces the file."""
        first_failed: dict[RequestId, tuple[int, str]] = {}
        for block_id in connector_output.invalid_block_ids:
            loading = self._loading.get(block_id)
            if loading is None:
                continue  # another connector's load (MultiConnector)
            request_id, index, key = loading
            if request_id not in first_failed or index < first_failed[request_id][0]:
                first_failed[request_id] = (index, key)
        self._bad_keys.update(key for _, key in first_failed.values())

    def request_finished(
        self, request: Request, block_ids: Sequence[BlockId]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves finish within the step (``wait_for_save``): free at once."""
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        for block_id in block_ids:
            loading = self._loading.get(block_id)
            if loading is not None and loading[0] == request.request_id:
                del self._loading[block_id]
        return False, None

    def set_xfer_handshake_metadata(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' layout: where this engine's files are."""
        layouts = {m.layout for m in metadata.values() if isinstance(m, StorageHandshakeMetadata)}
        if len(layouts) != 1:
            raise ConfigError(
                f"StorageConnector: expected one worker layout in the handshake metadata, got "
                f"{sorted(layouts)} from ranks {sorted(metadata)} (one worker per engine)"
            )
        self._root = os.path.join(self._namespace_root, layouts.pop())

    # --- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        assert self.kv_cache_config is not None  # checked in __init__
        geometry = derive_geometry(kv_caches, self.kv_cache_config)
        # Per layer: its storage as bytes, and the shift from region offsets
        # to offsets in that storage.
        self._memory = []
        for layer in geometry.layers:
            tensor = kv_caches[layer.name]
            shift = geometry.regions[layer.region_index].base_address - storage_address(tensor)
            self._memory.append((region_bytes(tensor), shift))
        self._geometry = geometry
        digest = hashlib.sha256(self._layout_signature().encode()).hexdigest()[:16]
        self._root = os.path.join(self._namespace_root, digest)
        remove_stale_temporaries(os.path.join(self.directory, "tmp"))

    def get_handshake_metadata(self) -> StorageHandshakeMetadata | None:
        if self._root is None:
            return None
        return StorageHandshakeMetadata(os.path.basename(self._root))

    def _require_geometry(self) -> KVCacheGeometry:
        if self._geometry is None:
            raise NotInitializedError(
                "StorageConnector worker has no KV caches; the engine must call "
                "register_kv_caches() at startup"
            )
        return self._geometry

    def _layout_signature(self) -> str:
        """What a loader must share with the saver to copy a block's bytes
        as they are: per layer, its segments' sizes and its memory order
        (NHD and HND blocks have equal sizes and permuted bytes)."""
        geometry = self._require_geometry()
        return json.dumps(
            [[layer.name, [s.block_nbytes for s in layer.segments], layer.memory_order]
             for layer in geometry.layers]
        )

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Load this step's blocks, synchronously. A block that cannot be read
        or verified stops its request's load: it and the request's later
        blocks become load errors (the engine recomputes from there), and the
        request saves nothing until it finishes (``wait_for_save``)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, StorageConnectorMetadata)
        for request_id in metadata.finished:
            self._failed.pop(request_id, None)
        for load in metadata.loads:
            for index, (key, block_id) in enumerate(zip(load.keys, load.block_ids)):
                try:
                    self._read_block(key, block_id)
                except Exception as exc:  # any failure is a load error, never a crash
                    logger.warning(
                        "request %r: loading block %d from %s failed: %s",
                        load.request_id, block_id, self.path_for(key), exc,
                    )
                    self._load_errors.update(load.block_ids[index:])
                    self._failed[load.request_id] = (
                        self._failed.get(load.request_id, frozenset())
                        | frozenset(load.block_ids[index:]))
                    self._stats["load_errors"] += len(load.block_ids) - index
                    break
                self._stats["blocks_loaded"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in ``start_load_kv``; nothing to wait for."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        """Nothing per layer: a file holds every layer of a block, so saving
        happens in ``wait_for_save``, once all layers of the step are written."""

    def wait_for_save(self) -> None:
        """Write the step's saves, except those of a request whose load
        failed in this step or an earlier one (until it finishes), and those
        computed over a block that failed to load for a request not finished:
        the forward passes computed them over that block's stale bytes (the
        engine recomputes them; a later request saves them). With
        asynchronous scheduling the engine schedules the step after a failed
        load before it hears of the failure, so a step's save can follow
        another step's failed load. A write that fails (disk full, a dead
        mount) is logged and counted (``save_errors``), and ends that
        request's saves."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, StorageConnectorMetadata)
        failed_blocks: frozenset[BlockId] = frozenset().union(*self._failed.values())
        for save in metadata.saves:
            if save.request_id in self._failed or not failed_blocks.isdisjoint(
                    save.context + save.block_ids):
                logger.warning("request %r: not saving %d block(s) computed over a block that "
                               "failed to load", save.request_id, len(save.keys))
                continue
            for key, block_id in zip(save.keys, save.block_ids):
                if key not in save.replace and os.path.exists(self.path_for(key)):
                    continue
                try:
                    self._write_block(key, block_id)
                except OSError as exc:  # a cache that cannot write must not stop the engine
                    logger.warning("request %r: saving block %d to %s failed, not saving its "
                                   "later blocks: %s", save.request_id, block_id,
                                   self.path_for(key), exc)
                    self._stats["save_errors"] += 1
                    break
                self._stats["blocks_saved"] += 1

    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- files -------------------------------------------------------------------

    def _block_views(self, block_id: int) -> list[tuple[str, list[np.ndarray]]]:
        """Per layer, writable views of block ``block_id``'s segments."""
        geometry = self._require_geometry()
        views = []
        for layer, (memory, shift) in zip(geometry.layers, self._memory):
            if not 0 <= block_id < layer.num_blocks:
                raise SpecError(f"block id {block_id} outside [0, {layer.num_blocks})")
            parts = []
            for seg in layer.segments:
                start = shift + seg.offset + block_id * seg.block_stride_bytes
                parts.append(memory[start:start + seg.block_nbytes])
            views.append((layer.name, parts))
        return views

    def _write_block(self, key: str, block_id: int) -> None:
        from safetensors.numpy import save

        tensors = {name: np.concatenate(parts) for name, parts in self._block_views(block_id)}
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(tensors):
            digest.update(tensors[name].data)
        payload = save(
            tensors,
            metadata={
                "format": FORMAT,
                "key": key,
                "layout": self._layout_signature(),
                "blake2b": digest.hexdigest(),
            },
        )
        write_atomic(self.path_for(key), os.path.join(self.directory, "tmp"), key, payload, self._fsync)

    def _read_block(self, key: str, block_id: int) -> None:
        from safetensors import safe_open

        with safe_open(self.path_for(key), framework="np") as f:
            meta = f.metadata() or {}
            expected = {"format": FORMAT, "key": key, "layout": self._layout_signature()}
            for field, value in expected.items():
                if meta.get(field) != value:
                    raise SpecError(
                        f"file {field} is {meta.get(field)!r}, expected {value!r}"
                    )
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(tensors):
            digest.update(np.ascontiguousarray(tensors[name]).data)
        if digest.hexdigest() != meta.get("blake2b"):
            raise SpecError("content digest does not match: the file is corrupt")
        views = self._block_views(block_id)
        if sorted(tensors) != sorted(name for name, _ in views):
            raise SpecError(
                f"file holds layers {sorted(tensors)}, expected {[n for n, _ in views]}"
            )
        for name, parts in views:  # check every layer before writing any
            data = tensors[name]
            if data.dtype != np.uint8 or data.size != sum(len(p) for p in parts):
                raise SpecError(
                    f"layer {name!r}: file holds {data.size} {data.dtype} values, expected "
                    f"{sum(len(p) for p in parts)} uint8"
                )
        for name, parts in views:
            data, start = tensors[name], 0
            for part in parts:
                part[:] = data[start:start + len(part)]
                start += len(part)
