"""The RDMA connector's scheduler side: what to load, what to hold, what to release.

Owns the per-request decisions of both roles:

- **producer** (``kv_producer``/``kv_both``): a request whose params say
  ``do_remote_decode`` and whose prompt was fully computed is held at
  ``request_finished`` (``delay_free=True``) under a lease (a generation of
  this scheduler's random epoch); the returned params are what a router
  hands verbatim to the decode request. The lease is shipped to the workers
  in the next step's metadata; they report the request in ``done_sending``
  when the consumer releases it or the lease expires. Its token covers
  what the params let a consumer read (``params.lease_binding``).
  **Memory pressure**: when a request the engine asked about this step was
  not given blocks and needs more than are free (it waits for memory:
  ``bind_free_blocks``) while leases hold more than
  ``lease_max_share`` of the KV cache, the oldest leases beyond that share
  are ended (``reclaims`` in the next step's metadata; their consumers get
  GONE and recompute), so held blocks cannot starve new prefills (the
  leases held and the rule: ``held``). Each
  lease also ends ``lease_max_s`` after its grant whatever its renewals
  (``leases``).
- **consumer** (``kv_consumer``/``kv_both``): a request whose params say
  ``do_remote_prefill`` loads the prompt tokens beyond its local prefix hit
  asynchronously (``(n, True)``). Blocks already computed locally are not
  read again. The first time it sees a request, its producer's address
  goes out in the next step's ``connects``, so the workers handshake while
  the request waits for admission. A full hit (nothing to load), a bad
  parameter set, or an abort before the load was handed to a worker
  releases the producer's lease at once. While the request waits for admission its lease is renewed
  through the workers. An abort after the load was handed to a worker
  delays the free of its blocks until the worker reports no read can land
  in them (``done_sending``).

Block ids are handled per KV-cache group (hybrid models): a sliding-window
group is held, offered and read only from the first block its window still
needs (``intake.blocks_to_read``, ``KVCacheSpec.num_skipped_blocks``); every other
group from the first block not computed locally.

Nothing here raises into the engine for bad peer input: bad params make the
request computed locally (logged, naming the field). What the params ask
of this engine's KV cache is checked by ``intake``.

The consumer's per-request record is ``remotes``'; the producer's leases
held are ``held``'s, its concurrent-dispatch prefills (push mode)
``pushsched``'s.

Imports the standard library and the connector's ``config``, ``specs``,
``types``, ``rdma.discovery``, ``rdma.held``, ``rdma.intake``, ``rdma.meta``,
``rdma.params``, ``rdma.pushsched``, ``rdma.remotes`` and
``rdma.settings``; never the transport.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.rdma.meta import (
    LoadSpec,
    PeerAddress,
    RdmaConnectorMetadata,
    RdmaHandshakeMetadata,
    RemoteLease,
    SendSpec,
)
from rdma_kv.connector.rdma.params import (
    ConcurrentPrefill,
    LeaseRef,
    RemoteDecodeRequest,
    RemotePrefillParams,
    lease_binding,
    lease_token,
    other_prompt,
    parse_kv_transfer_params,
    request_prompt_digest,
)
from rdma_kv.connector.rdma.discovery import RouterRegistration
from rdma_kv.connector.rdma.held import HeldLeases
from rdma_kv.connector.rdma.intake import blocks_to_read, concurrent_load, remote_blocks_problem
from rdma_kv.connector.rdma.pushsched import PushPrefills, router_payload
from rdma_kv.connector.rdma.remotes import Concurrent, LoadOwners, Remote, RemoteStage, SiblingGrants, load_key
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.connector.types import (
    BlockId,
    BlockIds,
    EngineId,
    KVCacheBlocks,
    KVConnectorOutput,
    Request,
    RequestId,
    SchedulerOutput,
    as_group_block_ids,
)
from rdma_kv.errors import ConfigError

__all__ = ["RdmaScheduler", "RemoteStage"]

logger = logging.getLogger(__name__)


class RdmaScheduler:
    """Scheduler-side logic; ``RdmaConnector`` delegates to it."""

    def __init__(
        self,
        config: KVTransferConfig,
        settings: RdmaSettings,
        kv_cache_config: KVCacheConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._settings = settings
        self._specs = tuple(group.kv_cache_spec for group in kv_cache_config.kv_cache_groups)
        self._num_blocks = kv_cache_config.num_blocks
        self._clock = clock
        self._engine_id = EngineId(str(config.engine_id))
        self._producer = config.is_kv_producer
        self._consumer = config.is_kv_consumer
        self._new_epoch()
        self._generations = itertools.count(1)
        self._port = settings.side_channel_port
        self._router: RouterRegistration | None = None  # started once the side-channel port is known
        self._push_prefills = PushPrefills(len(self._specs))
        """Producer, push mode: the prefills under a router's transfer id (concurrent dispatch)."""
        self._registration = 1  # the workers' KV-cache registration (set_handshake_metadata)
        # producer
        self._pending_sends: list[SendSpec] = []
        self._held = HeldLeases(self._num_blocks, settings.lease_max_share)
        """Leases granted and not yet reported finished, and memory pressure (``held``)."""
        self._pending_reclaims: list[int] = []
        self._sibling_grants = SiblingGrants()
        self.shared_with_siblings = 0
        """Children of requests with n > 1 that handed over a sibling's lease (for stats and tests)."""
        # consumer
        self._remote: dict[RequestId, Remote] = {}
        self._bad: set[RequestId] = set()
        self._pending_loads: list[LoadSpec] = []
        self._pending_releases: list[RemoteLease] = []
        self._pending_aborts: list[RequestId] = []
        self._aborting: set[RequestId] = set()
        """Requests whose shipped load was aborted and that the workers have
        not yet reported in ``finished_recving`` (reads may still land in
        their blocks)."""
        self._pending_connects: dict[PeerAddress, None] = {}  # ordered set, emptied every step
        self._owners = LoadOwners()  # which request took each load's params (vLLM's n > 1 children)
        self.refused_other_prompt = 0  # params holding another prompt's KV (params.other_prompt)

    def _new_epoch(self) -> None:
        """A new lease epoch: the workers end every lease of the old one when
        it reaches them, and answer GONE to any call naming it. At start
        (random per process and JSON-safe: a restarted producer never
        confirms a lease granted by its previous life) and when the workers
        re-registered their KV caches (sleep mode: the blocks of the old
        leases were computed in memory that is gone; a lease issued then but
        not yet shipped must not be confirmed as issued-and-held)."""
        self.epoch = secrets.randbits(52) | 1
        # Signs this epoch's leases (params.lease_token); shipped to this
        # engine's workers only, in the step metadata.
        self._lease_key = secrets.token_bytes(32)

    # --- startup ---------------------------------------------------------------------

    def set_handshake_metadata(self, metadata: Mapping[int, Any]) -> None:
        """Learn the side-channel port the workers really bound (kv_port 0)
        and their KV-cache registration (params carry it); then register with
        the router's discovery, if configured (``discovery``)."""
        rank0 = metadata.get(0)
        if isinstance(rank0, RdmaHandshakeMetadata):
            self._port = rank0.port - rank0.tp_rank
        if self._settings.router_discovery_address and self._router is None and (self._port or not self._producer):
            self._router = RouterRegistration(self._settings.router_discovery_address, self._router_payload)
            payload = self._router_payload()
            logger.info("registering with the router at %s as %s (%s), side channel %s",
                        self._settings.router_discovery_address, payload["type"], payload["transfer_mode"],
                        payload["zmq_address"])
        # vLLM calls this again after a wake from sleep: the workers re-registered.
        registrations = [m.registration for m in metadata.values() if isinstance(m, RdmaHandshakeMetadata)]
        if registrations and max(registrations) != self._registration:
            self._registration = max(registrations)
            self._new_epoch()  # every lease of the memory before the sleep ends; its params answer GONE

    def _router_payload(self) -> dict[str, Any]:
        return router_payload(self._settings, self._producer, self._port or 0, self._engine_id)

    def shutdown(self) -> None:
        if self._router is not None:
            self._router.close()
            self._router = None

    # --- parsing at the edge -------------------------------------------------------------

    def _parse(self, request: Request) -> RemoteDecodeRequest | RemotePrefillParams | Concurrent | None:
        if request.request_id in self._bad:
            return None
        try:
            parsed = parse_kv_transfer_params(request.kv_transfer_params, max_block_ids=request.num_prompt_tokens)
            if isinstance(parsed, ConcurrentPrefill):
                return self._concurrent(request, parsed)
        except ConfigError as exc:
            self._bad.add(request.request_id)
            logger.warning("request %r: invalid kv_transfer_params, computing locally: %s",
                           request.request_id, exc)
            return None
        if isinstance(parsed, RemotePrefillParams):
            problem = self._check_remote(request, parsed)
            if problem:
                self._bad.add(request.request_id)
                logger.warning("request %r: cannot load remote KV, computing locally: %s",
                               request.request_id, problem)
                self._release(Remote(parsed))
                return None
        return parsed

    def _concurrent(self, request: Request, parsed: ConcurrentPrefill) -> Concurrent:
        """A decode dispatched with its prefill (``intake.concurrent_load``)."""
        return concurrent_load(request.request_id, parsed, consumer=self._consumer, kv_role=self._config.kv_role,
                               mode=self._settings.mode, num_groups=len(self._specs))

    def _check_remote(self, request: Request, params: RemotePrefillParams) -> str | None:
        if not self._consumer:
            role = self._config.kv_role
            return (f"this engine's kv_role is {role.value if role else None!r}; loading needs "
                    "kv_consumer or kv_both")
        if params.remote_num_tokens != request.num_prompt_tokens:
            return (f"kv_transfer_params['remote_num_tokens']={params.remote_num_tokens} but the "
                    f"request's prompt has {request.num_prompt_tokens} tokens; a router must send "
                    "the decode request the same prompt as the prefill")
        other = other_prompt(params, request)
        if other is not None:
            self.refused_other_prompt += 1
            return other
        problem = remote_blocks_problem(self._specs, request.num_prompt_tokens, params.remote_block_ids)
        if problem:
            return problem
        # Differing TP sizes are the workers' to map (``topology``); sizes that
        # cannot share the model's KV heads fail there, as load errors.
        return None

    # --- consumer: admission -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if self._producer:
            self._held.waiting(rid, sum(-(-request.num_tokens // spec.block_size) for spec in self._specs))
            if self._settings.mode == "push" and rid not in self._push_prefills:
                self._push_prefills.note(request)
        remote = self._remote.get(rid)
        if remote is None:
            parsed = self._parse(request)
            if not isinstance(parsed, (RemotePrefillParams, Concurrent)):
                return 0, False
            key = load_key(parsed)
            owner = self._owners.owner(key)
            other = self._remote.get(owner) if owner is not None else None
            if other is not None and other.stage in (RemoteStage.WAITING, RemoteStage.PENDING,
                                                     RemoteStage.SHIPPED):
                # Another request here loads under these very params (vLLM's children of
                # one request with n > 1): ask again once its KV is in (a prefix-cache hit).
                self._held.given(rid)
                return None, False
            if other is not None or self._owners.sibling_finished(key, rid):
                # The load is another request's (loaded, released, or a sibling's that finished
                # before vLLM asked about this one: max_num_seqs): a load under it would be
                # refused (CLAIMED; a push registration, REFUSED), a load error (under
                # kv_load_failure_policy=fail, an error for the request). Computed locally,
                # nothing released: it is not ours.
                self._remote[rid] = Remote(parsed, stage=RemoteStage.RELEASED)
                return 0, False
            self._owners.take(key, rid)
            remote = self._remote[rid] = Remote(parsed)
            if rid in self._aborting:
                # The same id's aborted load is still in the workers' hands:
                # a second load under it would be refused there (and hang),
                # and their reports could not tell the two apart.
                logger.warning("request %r: a load under this request id was aborted and may still be "
                               "landing; computing this one locally (engines that reuse request ids: "
                               "vLLM makes them unique unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set)",
                               rid)
                self._release(remote)
                return 0, False
            self._pending_connects[parsed.peer if isinstance(parsed, Concurrent) else PeerAddress.of(parsed)] = None
        if remote.stage is not RemoteStage.WAITING:
            return 0, False  # loaded (or released) already: e.g. after a preemption
        count = request.num_prompt_tokens - num_computed_tokens
        remote.num_computed, remote.count = num_computed_tokens, max(count, 0)
        if count <= 0:
            return 0, False  # full local hit; update_state_after_alloc releases the lease
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._held.given(request.request_id)
        remote = self._remote.get(request.request_id)
        if remote is None or remote.stage is not RemoteStage.WAITING:
            return
        if num_external_tokens == 0:
            self._release(remote)  # full hit, or the engine chose to compute locally
            return
        if isinstance(remote.params, Concurrent):
            self._concurrent_load(request, remote, remote.params, blocks, num_external_tokens)
            return
        params = remote.params
        local_block_ids: list[BlockIds] = []
        remote_block_ids: list[BlockIds] = []
        skipped: list[int] = []
        error = None
        if num_external_tokens != remote.count:
            error = (f"asked to load {num_external_tokens} tokens after {remote.num_computed}, "
                     f"but {remote.count} were offered")
        elif blocks.num_groups != len(self._specs):
            error = f"blocks of {blocks.num_groups} KV-cache groups allocated, {len(self._specs)} expected"
        for g, spec in enumerate(self._specs):
            if error is not None:
                break
            part = blocks_to_read(spec, request.num_prompt_tokens, remote.num_computed,
                                  blocks.group(g), params.remote_block_ids[g])
            if isinstance(part, str):
                error = part if len(self._specs) == 1 else f"KV-cache group {g}: {part}"
                break
            local_block_ids.append(part[0])
            remote_block_ids.append(part[1])
            skipped.append(part[2])
        if error is not None:
            # Nothing is read; the blocks it would have filled are reported as load errors.
            local_block_ids = [self._unread_blocks(request, remote.num_computed, blocks, g)
                               for g in range(len(self._specs))]
            remote_block_ids, skipped = [() for _ in self._specs], []
        remote.stage = RemoteStage.PENDING
        self._pending_loads.append(LoadSpec(
            request.request_id,
            tuple(local_block_ids),
            tuple(remote_block_ids),
            PeerAddress.of(params),
            params.lease,
            params.remote_lease_ttl_s,
            remote.claim,
            error,
            tuple(skipped),
            params.remote_registration,
        ))

    def _concurrent_load(self, request: Request, remote: Remote, concurrent: Concurrent,
                         blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The load of a concurrent push: this engine's blocks from the first
        token not computed locally, registered with the producer under the
        transfer id (no lease: a placeholder names the request)."""
        spec = self._specs[0]
        first = remote.num_computed // spec.block_size
        last = -(-request.num_prompt_tokens // spec.block_size)
        error = None
        if num_external_tokens != remote.count:
            error = (f"asked to load {num_external_tokens} tokens after {remote.num_computed}, "
                     f"but {remote.count} were offered")
        elif blocks.num_groups != 1 or len(blocks.group(0)) < last:
            error = f"{len(blocks.group(0)) if blocks.num_groups else 0} blocks allocated for {last}"
        elif remote.num_computed % spec.block_size:
            error = f"a local prefix hit of {remote.num_computed} tokens is not whole blocks"
        local = tuple(blocks.group(0)[first:last]) if blocks.num_groups else ()
        remote.stage = RemoteStage.PENDING
        placeholder = LeaseRef(0, 0, request.request_id, bytes(16), bytes(16))
        self._pending_loads.append(LoadSpec(
            request.request_id, (local,), ((),), concurrent.peer, placeholder, self._settings.lease_ttl_s,
            remote.claim, error, (0,), 1, concurrent.transfer_id, remote.num_computed,
            request.num_prompt_tokens, request_prompt_digest(request)))

    def _unread_blocks(self, request: Request, num_computed: int, blocks: KVCacheBlocks,
                       group: int) -> BlockIds:
        """The blocks a failed plan of ``group`` would have loaded (best effort)."""
        if group >= blocks.num_groups:
            return ()
        spec = self._specs[group]
        first = max(num_computed // spec.block_size, spec.num_skipped_blocks(request.num_prompt_tokens))
        return tuple(blocks.group(group)[first:-(-request.num_prompt_tokens // spec.block_size)])

    def _release(self, remote: Remote) -> None:
        if remote.stage in (RemoteStage.WAITING, RemoteStage.PENDING):
            remote.stage = RemoteStage.RELEASED
            lease = remote.lease
            if lease is not None:  # a concurrent push holds none: its producer's registration never came
                self._pending_releases.append(lease)

    # --- every step ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RdmaConnectorMetadata:
        loads, self._pending_loads = tuple(self._pending_loads), []
        for load in loads:
            remote = self._remote.get(load.request_id)
            if remote is not None:
                remote.stage = RemoteStage.SHIPPED
        now = self._clock()
        due = [r for r in self._remote.values() if r.stage is RemoteStage.WAITING
               and isinstance(r.params, RemotePrefillParams)
               and self._settings.renewal_due(r.renewed_at, now, r.params.remote_lease_ttl_s)]
        for remote in due:
            remote.renewed_at = now
        for rid, generation in self._held.step():  # memory pressure: the oldest leases ended
            self._sibling_grants.ended(rid)
            self._pending_reclaims.append(generation)
        meta = RdmaConnectorMetadata(
            lease_epoch=self.epoch if self._producer else 0,
            lease_key=self._lease_key if self._producer else b"",
            loads=loads,
            sends=tuple(self._pending_sends),
            releases=tuple(self._pending_releases),
            renewals=tuple(r.lease for r in due if r.lease is not None),
            aborts=tuple(self._pending_aborts),
            connects=tuple(self._pending_connects),
            reclaims=tuple(self._pending_reclaims),
            layer_pushes=self._push_prefills.step(scheduler_output) if self._producer else (),
            idle=not any(scheduler_output.num_scheduled_tokens.values()),
        )
        self._pending_sends, self._pending_releases, self._pending_aborts = [], [], []
        self._pending_reclaims = []
        self._pending_connects = {}
        return meta

    def bind_free_blocks(self, free_blocks: Callable[[], int]) -> None:
        """Learn how to read the engine's free KV-cache blocks (vLLM: its
        block pool's): a request left waiting is memory pressure only if it
        needs more (``held``)."""
        self._held.bind_free_blocks(free_blocks)

    @property
    def reclaimed(self) -> int:
        """Leases ended under memory pressure (for stats and tests)."""
        return self._held.reclaimed

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending:
            if rid in self._held:
                self._held.end(rid)
                self._sibling_grants.ended(rid)
        for rid in output.finished_recving:
            self._aborting.discard(rid)
            remote = self._remote.get(rid)
            if remote is not None and remote.stage is RemoteStage.SHIPPED:
                remote.stage = RemoteStage.LOADED

    # --- end of a request ---------------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: Sequence[BlockId] | Sequence[Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, params)``; ``block_ids`` per KV-cache group (a flat
        sequence is the one group of a single-group engine)."""
        rid = request.request_id
        groups = as_group_block_ids(block_ids)
        refused = rid in self._bad
        self._bad.discard(rid)
        noted_digest = self._push_prefills.forget(rid)  # (a push prefill's, computed when it was noted)
        self._held.given(rid)
        remote = self._remote.pop(rid, None)
        if remote is not None:
            self._owners.finished(load_key(remote.params), rid)
            if remote.stage is RemoteStage.SHIPPED:
                # A read may still land in these blocks: the engine holds them
                # until every worker reported the load in done_recving, which
                # an aborted load is once none of its reads can land (base.py).
                self._pending_aborts.append(rid)
                self._aborting.add(rid)
                return False, None
            if remote.stage is RemoteStage.PENDING:
                self._pending_loads = [s for s in self._pending_loads if s.request_id != rid]
            self._release(remote)
            return False, None
        if refused:
            # Its params were refused when the engine asked about it (logged then, and
            # a lease they named released then): not parsed, logged or released again.
            return False, None
        try:
            parsed = parse_kv_transfer_params(request.kv_transfer_params, max_block_ids=request.num_prompt_tokens)
        except ConfigError as exc:
            logger.warning("request %r: invalid kv_transfer_params, not holding its KV: %s", rid, exc)
            return False, None
        if isinstance(parsed, RemotePrefillParams):
            if not self._owners.taken(load_key(parsed), rid):
                # Aborted (or rejected) before the engine ever asked us about it:
                # still tell the producer, or its blocks wait for the lease to expire.
                # (Not a lease another request here took: that one is its to release.)
                self._release(Remote(parsed))
            return False, None
        if isinstance(parsed, ConcurrentPrefill):
            return False, None  # never registered: the producer's lease ends at its TTL
        if not self._producer:
            return False, None
        if not isinstance(parsed, RemoteDecodeRequest) or not any(groups):
            return False, None
        if request.num_computed_tokens < request.num_prompt_tokens or request.aborted:
            # Aborted before its prefill completed (or after its last chunk was
            # scheduled, which counts the prompt computed): nothing to hand over,
            # and no decode will come for it (its params reach no router).
            return False, None
        if len(groups) != len(self._specs):
            logger.warning("request %r: block ids of %d KV-cache groups, this engine has %d; "
                           "not holding its KV", rid, len(groups), len(self._specs))
            return False, None
        held, offered = [], []
        for g, (spec, ids) in enumerate(zip(self._specs, groups)):
            num_blocks = -(-request.num_prompt_tokens // spec.block_size)
            # A sliding-window group keeps the blocks of the next token's window
            # only; the ones before it may already be the engine's placeholders
            # (vLLM's null block): neither held nor offered.
            first = spec.num_skipped_blocks(request.num_prompt_tokens)
            if spec.num_skipped_blocks(request.num_computed_tokens) > first:
                logger.warning("request %r: %d tokens computed beyond its %d-token prompt moved "
                               "the sliding window of KV-cache group %d past the prompt's; not "
                               "holding its KV", rid, request.num_computed_tokens,
                               request.num_prompt_tokens, g)
                return False, None
            if len(ids) < num_blocks:
                logger.warning("request %r: %d blocks for a %d-token prompt; not holding its KV",
                               rid, len(ids), request.num_prompt_tokens)
                return False, None
            held.append(ids[first:])
            offered.append(ids[first:num_blocks])
        if not self._port:
            logger.error("request %r: the side-channel port is unknown (kv_port 0 and no "
                         "set_xfer_handshake_metadata from the workers); not holding its KV", rid)
            return False, None
        settings = self._settings
        digest = noted_digest or request_prompt_digest(request)
        sibling = None if settings.mode == "push" else SiblingGrants.key(
            rid, request.num_prompt_tokens, digest, request.extra_keys)
        if sibling is not None:
            shared = self._sibling_grants.of(
                sibling, lambda owner, generation: self._held.generation(owner) == generation)
            if shared is not None and shared.remote_lease_epoch == self.epoch:
                # vLLM's child of a request with n > 1: the first finished child's lease, its
                # blocks (the same KV) held; this child's are freed now (SiblingGrants).
                self.shared_with_siblings += 1
                return False, shared.to_dict()
        generation = next(self._generations)
        binding = lease_binding(self._engine_id, settings.tp_size, request.num_prompt_tokens, tuple(offered),
                                self._registration, digest)
        params = RemotePrefillParams(
            remote_engine_id=self._engine_id,
            remote_host=settings.advertise_host,
            remote_port=self._port,
            remote_block_ids=tuple(offered),
            remote_request_id=rid,
            tp_size=settings.tp_size,
            remote_lease_epoch=self.epoch,
            remote_lease_generation=generation,
            remote_lease_token=lease_token(self._lease_key, self.epoch, generation, rid, binding),
            remote_lease_ttl_s=settings.lease_ttl_s,
            remote_num_tokens=request.num_prompt_tokens,
            remote_prompt_digest=digest,
            remote_registration=self._registration,
        )
        transfer_id = parsed.transfer_id if settings.mode == "push" else None
        self._pending_sends.append(SendSpec(rid, tuple(held), params.lease, settings.lease_ttl_s, transfer_id,
                                            request.num_prompt_tokens, digest))
        self._held.hold(rid, generation, tuple(held))
        if sibling is not None:
            self._sibling_grants.granted(sibling, rid, params)
        return True, params.to_dict()

    # --- introspection --------------------------------------------------------------------------------

    def num_tracked(self) -> int:
        """Consumer requests tracked (leak checks)."""
        return len(self._remote)

    def num_held_blocks(self) -> int:
        """Blocks held under leases granted and not yet reported finished
        (a block several leases hold, once)."""
        return self._held.num_blocks()
