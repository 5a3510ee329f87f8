"""A small paged-attention engine that drives a KV connector, for tests, the
demo, and as a worked example for engine authors.

Owns :class:`Engine` (a scheduler loop and one worker in one process), its
block pool with prefix caching, and :class:`ModelShape`. The KV cache is a
torch tensor in vLLM's CPU layout: one allocation, every layer a
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view of it. The
"forward pass" writes deterministic KV (``kvfill``) so a consumer verifies
every block it loaded from the prompt alone.

**Embedding rdma-kv in an engine** (what :meth:`Engine.step` does, in order):

1. Startup: create the connector twice from one ``KVTransferConfig`` (role
   ``SCHEDULER`` and ``WORKER``), call the worker's
   ``register_kv_caches({layer: tensor})``, hand its
   ``get_handshake_metadata()`` to the scheduler's
   ``set_xfer_handshake_metadata({rank: md})``.
2. Admission: for a waiting request, compute its local prefix hit, ask
   ``get_num_new_matched_tokens(request, num_computed)``; allocate blocks;
   call ``update_state_after_alloc(request, blocks, n)`` (``n = 0`` when the
   connector offered nothing). ``(n, True)``: park the request until the
   worker reports it in ``finished_recving``.
3. Every step: ``build_connector_meta`` -> worker ``bind_connector_metadata``
   -> per layer ``wait_for_layer_load`` / that layer's forward (its KV
   stored) / ``save_kv_layer`` ->
   ``start_load_kv`` -> ``wait_for_save`` -> ``get_finished(finished_ids)``
   -> ``get_block_ids_with_load_errors`` -> ``clear_connector_metadata`` ->
   scheduler ``update_connector_output``. That is vLLM 0.32's order when
   every load of the step is asynchronous (``_get_kv_connector_output``:
   async loads are started *after* the forward is launched); with
   ``start_load="before_forward"``, the order of a step with synchronous
   loads (and of older vLLMs): ``start_load_kv`` before the layers.
4. A parked request reported in ``finished_recving``: if any of its blocks
   is in the load errors, ``kv_load_failure_policy`` decides: ``recompute``
   from the first bad block, or ``fail`` the request.
5. A finished (or aborted) request: ``request_finished(request, block_ids)``;
   ``delay_free=True`` keeps its blocks allocated until the worker reports
   it in ``finished_sending``; the returned params go to the request's
   output (a router hands them to the decode request). A request aborted
   while it waits for a load keeps its blocks until the workers report it in
   ``finished_recving``, whatever ``request_finished`` said (vLLM 0.32's
   rule for a finished ``WAITING_FOR_REMOTE_KVS`` request).

Keep stepping while requests wait for loads or blocks are held: the worker
reports completions (and lease expiries) only from ``get_finished``.

**Tensor parallel** (``tp_size > 1``): one scheduler and one worker per
rank, each rank's KV cache holding its share of the KV heads (vLLM's rule:
``heads/tp`` contiguous heads per rank, or one replicated head when ranks
outnumber heads), every rank's connector config naming its ``tp_rank``,
``tp_size`` and the model's ``total_kv_heads``. A request is finished
sending or receiving once *every* rank reported it (as vLLM aggregates
its workers' outputs); load errors are the union of the ranks'.

Imports the standard library, torch, ``rdma_kv.errors``, ``rdma_kv.connector``
and ``rdma_kv.harness`` modules ``blocks`` (the block pool) and ``kvfill``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from rdma_kv.connector import (
    CachedRequestData,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVConnectorBase,
    KVConnectorFactory,
    KVConnectorOutput,
    KVConnectorRole,
    KVLoadFailurePolicy,
    KVTransferConfig,
    NewRequestData,
    Request,
    BlockId,
    RequestId,
    SchedulerOutput,
)
from rdma_kv.errors import ConfigError
from rdma_kv.harness.blocks import BlockPool
from rdma_kv.harness.kvfill import block_seeds, expected_block, fill_block, same_bits

__all__ = ["Engine", "ModelShape", "RequestResult", "Status"]

logger = logging.getLogger(__name__)

UNWRITTEN = -1.0
"""What a block holds once allocated, before a forward pass or a load
writes it (with ``verify``): never a value of :mod:`kvfill`'s."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    num_layers: int = 8
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    num_blocks: int = 512
    dtype: str = "float16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{i}.self_attn" for i in range(self.num_layers))

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers."""
        item = torch.empty(0, dtype=self.torch_dtype).element_size()
        return self.num_layers * self.num_kv_heads * self.block_size * 2 * self.head_size * item


class Status(str, enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # waiting for an asynchronous load
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"  # kv_load_failure_policy=fail
    ABORTED = "aborted"


@dataclasses.dataclass
class RequestResult:
    """What happened to one request; ``Engine.results`` keeps them."""

    request_id: str
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    local_hit_tokens: int = 0
    external_tokens: int = 0
    load_failed: bool = False
    recomputed_from_block: int | None = None
    bad_blocks: list[int] = dataclasses.field(default_factory=list)
    """Prompt block indices whose content did not verify: loaded blocks and
    prefix-cache hits (``Engine``'s ``verify``)."""
    kv_transfer_params: dict[str, Any] | None = None
    submitted_at: float = 0.0
    admitted_at: float = 0.0
    loaded_at: float = 0.0
    finished_at: float = 0.0
    error: str | None = None

    @property
    def load_s(self) -> float:
        return self.loaded_at - self.admitted_at if self.loaded_at else 0.0


@dataclasses.dataclass(eq=False)
class _Req:
    request: Request
    result: RequestResult
    seeds: list[int]
    block_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    scheduled_once: bool = False
    load_reported: bool = False  # its load was in finished_recving (every rank)


def shard_heads(rank: int, tp_size: int, num_heads: int) -> range:
    """The KV heads tensor-parallel ``rank`` holds (vLLM's sharding)."""
    if tp_size <= num_heads:
        per = num_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_heads // tp_size
    return range(head, head + 1)


@dataclasses.dataclass(eq=False)
class _Rank:
    """One tensor-parallel rank: its worker connector and its KV heads' cache."""

    heads: range
    kv: torch.Tensor
    kv_caches: dict[str, torch.Tensor]
    worker: Any = None


class Engine:
    """One engine instance: scheduler loop, block pool and a worker per
    tensor-parallel rank (one by default).

    ``connector_kwargs`` go to the connector's constructor (e.g.
    ``transport_factory`` for a fake transport). ``verify`` checks against
    :mod:`kvfill` every block a request uses without computing it: the
    loaded ones and its prefix-cache hits in the step its load completes
    (the blocks before the first failed one, when a load failed), the hits
    at admission when nothing loads; it also fills each block it allocates
    with :data:`UNWRITTEN`, so a block no load wrote never verifies;
    ``fill=False`` skips writing KV in the fake forward pass (benchmarks).
    ``tp_size`` ranks split ``shape.num_kv_heads`` (the model's); they need a
    fixed ``kv_port`` (rank ``r`` serves ``kv_port + r``).
    """

    def __init__(
        self,
        config: KVTransferConfig,
        shape: ModelShape = ModelShape(),
        *,
        connector_kwargs: Mapping[str, Any] | None = None,
        prefix_caching: bool = True,
        verify: bool = True,
        fill: bool = True,
        max_running: int = 64,
        tp_size: int = 1,
        start_load: str = "after_forward",
    ) -> None:
        if start_load not in ("after_forward", "before_forward"):
            raise ValueError(f"start_load must be 'after_forward' or 'before_forward', not {start_load!r}")
        self.config, self.shape, self.tp_size = config, shape, tp_size
        self.start_load_first = start_load == "before_forward"
        self.policy = config.kv_load_failure_policy
        self.prefix_caching, self.verify, self.max_running = prefix_caching, verify, max_running
        self.fill = fill  # False: skip the fake forward's KV writes (benchmarks)
        names = shape.layer_names
        self.ranks = []
        for rank in range(tp_size):
            heads = shard_heads(rank, tp_size, shape.num_kv_heads)
            kv = torch.zeros(shape.num_layers, shape.num_blocks, len(heads), shape.block_size,
                             2 * shape.head_size, dtype=shape.torch_dtype)
            self.ranks.append(_Rank(heads, kv, {name: kv[i] for i, name in enumerate(names)}))
        self.kv, self.kv_caches = self.ranks[0].kv, self.ranks[0].kv_caches
        spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=len(self.ranks[0].heads),
                                 head_size=shape.head_size, dtype=shape.dtype)
        self.kv_cache_config = KVCacheConfig(
            shape.num_blocks, (KVCacheTensor(self.kv.numel() * self.kv.element_size(), names),),
            (KVCacheGroupSpec(names, spec),))
        self.scheduler = self._create(KVConnectorRole.SCHEDULER, connector_kwargs)
        handshakes = {}
        try:
            for rank, part in enumerate(self.ranks):
                part.worker = self._create(KVConnectorRole.WORKER, connector_kwargs, rank)
                part.worker.register_kv_caches(part.kv_caches)
                handshakes[rank] = part.worker.get_handshake_metadata()
            if handshakes[0] is not None:
                self.scheduler.set_xfer_handshake_metadata(handshakes)
        except BaseException:
            for part in self.ranks:
                if part.worker is not None:
                    part.worker.shutdown()
            raise
        self.worker = self.ranks[0].worker
        self._reported: dict[str, collections.Counter[str]] = {
            "sending": collections.Counter(), "recving": collections.Counter()}
        self.pool = BlockPool(shape.num_blocks)
        self.requests: dict[str, _Req] = {}
        self.results: dict[str, RequestResult] = {}
        self.waiting: collections.deque[_Req] = collections.deque()
        self.held: dict[str, list[int]] = {}  # delayed frees, until finished_sending
        self._held_for_load: set[str] = set()  # aborted while loading: held until finished_recving
        self._delayed: set[str] = set()  # request_finished said delay_free: finished_sending may come
        self._finished_ids: set[RequestId] = set()
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self.steps = 0
        self.on_finished: Callable[[RequestResult], None] | None = None

    def _create(self, role: KVConnectorRole, kwargs: Mapping[str, Any] | None, rank: int = 0) -> KVConnectorBase:
        config = self.config
        if self.tp_size > 1:
            config = dataclasses.replace(config, kv_connector_extra_config={
                **config.kv_connector_extra_config, "tp_rank": rank, "tp_size": self.tp_size,
                "total_kv_heads": self.shape.num_kv_heads})
        if kwargs:
            cls = KVConnectorFactory.get_connector_class(config)
            return cls(config, role, self.kv_cache_config, **kwargs)
        return KVConnectorFactory.create_connector(config, role, self.kv_cache_config)

    # --- API -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    kv_transfer_params: Mapping[str, Any] | None = None,
                    extra_keys: tuple[Hashable, ...] = ()) -> None:
        """``extra_keys``: what else would decide the prompt's KV in a real
        engine (an image, an adapter; ``Request.extra_keys``). The harness
        fills KV from the token ids alone; the connector binds the keys."""
        if request_id in self.requests:
            raise ConfigError(f"request {request_id!r} is already in the engine")
        request = Request(request_id, prompt_token_ids, kv_transfer_params, extra_keys)
        result = RequestResult(request_id, num_prompt_tokens=request.num_prompt_tokens,
                               submitted_at=time.perf_counter())
        req = _Req(request, result, block_seeds(request.prompt_token_ids, self.shape.block_size))
        self.requests[request_id] = req
        self.results[request_id] = result
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, Status.ABORTED)

    def has_work(self) -> bool:
        """Requests not finished, or blocks held for a remote reader."""
        return bool(self.requests or self.held)

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def run(self, until: Callable[[], bool] | None = None, timeout_s: float = 30.0) -> None:
        """Step until ``until()`` (default: no work left); ``TimeoutError`` after ``timeout_s``."""
        done = until or (lambda: not self.has_work())
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not done after {timeout_s} s: {self.describe()}")
            self.step()
            if not self._busy():
                time.sleep(0.0005)  # only waiting on remote work: do not spin a core

    def describe(self) -> str:
        by = collections.Counter(r.status.value for r in self.requests.values())
        return f"requests {dict(by)}, held {len(self.held)}, free blocks {self.pool.num_free}"

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        for part in self.ranks:
            part.worker.shutdown()

    # --- sleep mode, as vLLM >= 0.33 drives it ---------------------------------------------

    def sleep(self) -> None:
        """vLLM's sleep (level 1): each worker's connector unregisters its KV
        caches, then the KV memory is discarded (here: overwritten, as a
        remapped allocation would read) and the prefix cache forgotten."""
        for part in self.ranks:
            part.worker.unregister_kv_caches()
        for part in self.ranks:
            part.kv.fill_(-1.0)
        self.pool.cached.clear()
        self.pool.key_of.clear()

    def wake_up(self) -> None:
        """vLLM's wake: each worker's connector registers the KV caches
        again, then the engine core hands the scheduler the workers' new
        handshake metadata (``set_xfer_handshake_metadata``)."""
        handshakes = {}
        for rank, part in enumerate(self.ranks):
            part.worker.restore_kv_caches()
            handshakes[rank] = part.worker.get_handshake_metadata()
        if handshakes[0] is not None:
            self.scheduler.set_xfer_handshake_metadata(handshakes)

    # --- one step ---------------------------------------------------------------------------

    def _busy(self) -> bool:
        return any(r.status is Status.RUNNING for r in self.requests.values()) or bool(self.waiting)

    def step(self) -> KVConnectorOutput:
        self.steps += 1
        bs = self.shape.block_size
        compute: list[tuple[_Req, int]] = []  # (request, first token to compute)
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        # Parked requests whose load finished in the previous step.
        for rid in list(self._recved):
            self._recved.discard(rid)
            req = self.requests.get(rid)
            if req is None or req.status is not Status.LOADING:
                continue
            first = self._after_load(req)
            if first is None:
                continue
            req.status = Status.RUNNING
            compute.append((req, first))
            cached_reqs.append(CachedRequestData(req.request.request_id, None, first))
        # Admission.
        running = sum(1 for r in self.requests.values() if r.status in (Status.RUNNING, Status.LOADING))
        while self.waiting and running < self.max_running:
            req = self.waiting[0]
            request = req.request
            n_blocks = -(-request.num_prompt_tokens // bs)
            keys = req.seeds[1:n_blocks + 1] if self.prefix_caching else []
            # Block i's cache key is the seed of block i+1 (it covers tokens through i).
            full = request.num_prompt_tokens // bs
            hits = self.pool.hits(keys[:full]) if self.prefix_caching else []
            num_computed = len(hits) * bs
            n_ext, load_async = self.scheduler.get_num_new_matched_tokens(request, num_computed)
            if n_ext is None:
                break
            blocks = self.pool.allocate(hits, n_blocks - len(hits))
            if blocks is None:
                break  # no room: try again next step
            self.waiting.popleft()
            running += 1
            if self._verifying:
                # A fresh block holds no KV yet: what a block that was freed
                # held before must not verify in place of a load that never
                # wrote it (the same prompt again leaves the same KV).
                for part in self.ranks:
                    part.kv[:, blocks[len(hits):]] = UNWRITTEN
            req.block_ids = blocks
            request.num_computed_tokens = num_computed
            req.result.local_hit_tokens = num_computed
            req.result.external_tokens = n_ext
            req.result.admitted_at = time.perf_counter()
            self.scheduler.update_state_after_alloc(request, KVCacheBlocks.of(blocks), n_ext)
            new_reqs.append(NewRequestData.from_request(request, KVCacheBlocks.of(blocks)))
            if n_ext and load_async:
                req.status = Status.LOADING
            else:
                if hits and self._verifying:
                    req.result.bad_blocks = self.verify_blocks(req, range(len(hits)))
                request.num_computed_tokens = num_computed + n_ext
                req.status = Status.RUNNING
                compute.append((req, num_computed + n_ext))
        num_scheduled = {r.request.request_id: max(1, r.request.num_prompt_tokens - first)
                         for r, first in compute}
        output = SchedulerOutput(tuple(new_reqs), tuple(cached_reqs), num_scheduled,
                                 frozenset(self._finished_ids))
        finished_ids, self._finished_ids = self._finished_ids, set()
        # Worker side: every rank runs the same step.
        meta = self.scheduler.build_connector_meta(output)
        errors: set[int] = set()
        for part in self.ranks:
            worker = part.worker
            worker.bind_connector_metadata(meta)
            if self.start_load_first:
                worker.start_load_kv(None)
            self._forward(compute, part)
            if not self.start_load_first:
                worker.start_load_kv(None)
            worker.wait_for_save()
            rank_sending, rank_recving = worker.get_finished(finished_ids)
            self._reported["sending"].update(rank_sending or ())
            self._reported["recving"].update(rank_recving or ())
            errors |= set(worker.get_block_ids_with_load_errors())
            worker.clear_connector_metadata()
        sending, recving = self._all_ranks("sending"), self._all_ranks("recving")
        self._cache_prefixes(compute)
        kv_output = KVConnectorOutput.of(sending, recving, errors)
        self.scheduler.update_connector_output(kv_output)
        # Scheduler bookkeeping.
        self._load_errors |= set(kv_output.invalid_block_ids)
        for rid in kv_output.finished_recving:
            req = self.requests.get(rid)
            if req is not None and req.status is Status.LOADING:
                req.load_reported = True
                self._recved.add(rid)
            elif rid in self._held_for_load:  # aborted while loading: its load is over now
                self._held_for_load.discard(rid)
                blocks = self.held.pop(rid, None)
                if blocks is not None:
                    self.pool.release(blocks)
        for rid in kv_output.finished_sending:
            if rid not in self._delayed:
                # The contract (connector/base.py): reported in done_sending only
                # if request_finished delayed its free. vLLM frees on it anyway,
                # so such a report frees blocks the engine still holds for
                # another reason (a load that may still land).
                raise AssertionError(f"{self.config.engine_id}: request {rid!r} reported in finished_sending, but "
                                     "request_finished did not delay its free")
            self._delayed.discard(rid)
            blocks = self.held.pop(rid, None)
            if blocks is not None:
                self.pool.release(blocks)
        for req, _ in compute:
            req.request.num_computed_tokens = req.request.num_prompt_tokens
            req.request.output_token_ids.append(0)
            self._finish(req, Status.FINISHED)
        return kv_output

    def _after_load(self, req: _Req) -> int | None:
        """First token to compute after a load; None when the request failed."""
        bs = self.shape.block_size
        result = req.result
        result.loaded_at = time.perf_counter()
        first_block = req.request.num_computed_tokens // bs
        bad = [i for i, b in enumerate(req.block_ids) if b in self._load_errors and i >= first_block]
        self._load_errors -= set(req.block_ids)
        if bad:
            result.load_failed = True
            if self.policy is KVLoadFailurePolicy.FAIL:
                result.error = f"KV load failed for blocks {[req.block_ids[i] for i in bad]}"
                self._finish(req, Status.FAILED)
                return None
            result.recomputed_from_block = bad[0]
            if self._verifying:  # the blocks kept (hits, and loads before the first failed one)
                result.bad_blocks = self.verify_blocks(req, range(bad[0]))
            return bad[0] * bs
        if self._verifying:  # the loaded blocks, and the prefix-cache hits the request reads with them
            result.bad_blocks = self.verify_blocks(req, range(len(req.block_ids)))
        return req.request.num_prompt_tokens

    @property
    def _verifying(self) -> bool:
        """Whether blocks are checked against kvfill: ``verify``, and the
        forward writes kvfill's KV (else a prefix hit holds zeros)."""
        return self.verify and self.fill

    def _all_ranks(self, kind: str) -> set[str]:
        """Request ids every rank has reported as finished ``kind``."""
        counts = self._reported[kind]
        done = {rid for rid, n in counts.items() if n >= self.tp_size}
        for rid in done:
            del counts[rid]
        return done

    def verify_blocks(self, req: _Req, indices: Sequence[int] | range) -> list[int]:
        """Prompt block indices whose content differs from kvfill's (on any
        rank), bit for bit (a -0.0 where kvfill has 0.0 is wrong too)."""
        tokens = req.request.prompt_token_ids
        bad = []
        for i in indices:
            for part in self.ranks:
                values, valid = expected_block(tokens, i, req.seeds[i], tuple(part.kv.shape[2:]),
                                               self.shape.num_layers, part.kv.dtype, part.heads)
                if not same_bits(part.kv[:, req.block_ids[i], :, :valid], values[:, :, :valid]):
                    bad.append(i)
                    break
        return bad

    def _forward(self, compute: Sequence[tuple[_Req, int]], part: _Rank) -> None:
        """The fake forward pass of one rank: write kvfill's KV of its heads
        for the computed tokens, layer by layer in vLLM's order (its attention
        layers' hooks): ``wait_for_layer_load``, the layer's KV, then
        ``save_kv_layer``. A layer's KV is not in memory before its turn, so
        a connector that saved a layer ahead of its ``save_kv_layer`` sends
        what was there before, as it would in vLLM."""
        bs = self.shape.block_size
        writes = [(req, i, first - i * bs if i == first // bs else 0)
                  for req, first in compute
                  for i in range(first // bs, len(req.block_ids) if self.fill else 0)]
        for layer, name in enumerate(part.kv_caches):
            part.worker.wait_for_layer_load(name)
            for req, i, first_position in writes:
                fill_block(part.kv, req.block_ids[i], req.request.prompt_token_ids, i, req.seeds[i],
                           first_position, part.heads, layer)
            part.worker.save_kv_layer(name, part.kv_caches[name], None)

    def _cache_prefixes(self, compute: Sequence[tuple[_Req, int]]) -> None:
        if self.prefix_caching:
            for req, _ in compute:
                for i in range(req.request.num_prompt_tokens // self.shape.block_size):
                    self.pool.cache(req.seeds[i + 1], req.block_ids[i])

    def _finish(self, req: _Req, status: Status) -> None:
        rid = req.request.request_id
        self.requests.pop(rid, None)
        loading = req.status is Status.LOADING and not req.load_reported
        req.status = req.result.status = status
        req.result.finished_at = time.perf_counter()
        req.request.aborted = status is Status.ABORTED
        delay, params = self.scheduler.request_finished(req.request, [BlockId(b) for b in req.block_ids])
        req.result.kv_transfer_params = params
        if delay:
            self._delayed.add(rid)
        if loading:
            self._held_for_load.add(rid)  # until finished_recving (the engine's own hold)
        if req.block_ids:
            if delay or loading:
                self.held[rid] = list(req.block_ids)
            else:
                self.pool.release(req.block_ids)
        self._finished_ids.add(RequestId(rid))
        if self.on_finished is not None:
            self.on_finished(req.result)
