"""The producer's part of a worker: the lease table's owner and the side channel.

Owns :class:`RdmaProducer` -- what a prefill worker does with the KV blocks
it holds for consumers:

- the lease table (``leases``: grants, renewals, CONFIRM, release, expiry;
  its logic lives there), fed each step with the scheduler's grants and
  epoch, and emptied into ``done_sending`` by ``take_done``;
- the side-channel server (``sidechannel``), started at registration and
  stopped at shutdown, answered by :class:`ProducerHandler`.

:class:`ProducerHandler` answers what a consumer may ask: HANDSHAKE with the
agent metadata (worker address, packed remote keys) and the block geometry
-- or a refusal naming both sides' values when the KV caches are
incompatible (model shape, dtype, block size, layout). Tensor-parallel
sizes may differ: the reply names this rank's share (``wire.RankInfo``) and
the consumer plans which heads to read from it (``topology``). RENEW, CONFIRM and RELEASE act on
the lease table; in push mode PUSH_HELLO, PUSH and PUSH_QUERY go to the
``pusher``. It runs on the side channel's threads; the lease table
does its own locking. Authentication happens before any of this, in
``sidechannel``.

Imports the standard library, msgspec, the connector's ``geometry`` and ``types``,
and its ``rdma`` modules ``auth``, ``fences``, ``heldwords``, ``wire``, ``leases``, ``meta``, ``pusher``,
``settings``, ``sidechannel``, ``stats`` and ``transport_api``. Never the consumer's modules
(``rdma.consumer``) or ``worker``.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import overload

import msgspec

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import auth, fences, wire
from rdma_kv.connector.rdma.heldwords import HeldWords
from rdma_kv.connector.rdma.leases import Ending, LeaseCall, LeaseTable
from rdma_kv.connector.rdma.lograte import EventSummary
from rdma_kv.connector.rdma.meta import LayerPushSpec, SendSpec
from rdma_kv.connector.rdma.pusher import PushWriter
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.admission import raise_fd_limit
from rdma_kv.connector.rdma.sidechannel import ConnectionLimits, SideChannelServer
from rdma_kv.connector.rdma.stats import LeaseCounters, PushCounters, PushRecord
from rdma_kv.connector.rdma.transport_api import Transport
from rdma_kv.connector.types import EngineId, RequestId

__all__ = ["ProducerHandler", "RdmaProducer"]

logger = logging.getLogger(__name__)

MAX_DIFF_CHARS = 4000
"""What a refused handshake's reason says of the differences at most (its wire bound is 8192)."""


class ProducerHandler:
    """Implements :class:`~rdma_kv.connector.rdma.sidehandler.PushHandler`."""

    def __init__(self, engine_id: EngineId, rank: wire.RankInfo, lease_ttl_s: float, leases: LeaseTable,
                 compat: wire.CompatInfo, agent_metadata: Callable[[], bytes],
                 geometry: KVCacheGeometry) -> None:
        self._engine_id = engine_id
        self._rank = rank
        self._lease_ttl_s = lease_ttl_s
        self._leases = leases
        self._compat = compat
        self._agent_metadata: Callable[[], bytes] | None = agent_metadata
        self._geometry = geometry
        self.registration = 1
        self.life = secrets.token_bytes(wire.INCARNATION_BYTES)
        """The life of the transport (a new one at each wake), as push answers name it (``wire.PushReply``)."""
        self.words: wire.RegionWire | None = None
        """Where this rank's held words are (``heldwords``), published in the handshake reply."""
        self.pusher: PushWriter | None = None
        """Push mode's writer (None in pull mode, and while asleep)."""
        self._refusals = EventSummary(logger, f"producer {engine_id!r}", "handshakes refused")
        """A peer may handshake again and again on one connection: a few lines per window, then a count."""

    def suspend(self) -> None:
        """The KV cache is about to be unregistered: refuse handshakes and new
        pushes. The pusher still answers PUSH_QUERY until :meth:`detach`: a
        write it posted may still land until the transport is closed, and a
        decode told "nothing is written" (UNKNOWN) meanwhile would hand its
        blocks back under that write (found by an adversarial review)."""
        self._agent_metadata = None

    def detach(self) -> None:
        """The transport is closed: no write of the pusher's can land any more."""
        self.pusher = None

    def resume(self, agent_metadata: Callable[[], bytes], geometry: KVCacheGeometry, registration: int,
               pusher: PushWriter | None = None) -> None:
        """Registered again (a new transport, new remote keys). The pusher
        is published before the metadata that opens handshakes: a decode
        that handshakes as soon as the metadata is out finds the pusher, where
        its PUSH_HELLO was refused "this producer runs mode 'push'" once."""
        self._geometry, self.registration = geometry, registration
        self.life = secrets.token_bytes(wire.INCARNATION_BYTES)
        self.attach(pusher)
        self._agent_metadata = agent_metadata

    def attach(self, pusher: PushWriter | None) -> None:
        """Publish ``pusher``, the writer of this life's transport: given the
        life first (a hello it takes is checked against it)."""
        if pusher is not None:
            pusher.life = self.life
        self.pusher = pusher

    def on_handshake(self, request: wire.Handshake) -> wire.HandshakeReply | wire.Refused:
        # One snapshot: the life, registration and geometry read before the
        # metadata, and checked after it (a sleep and wake in between would
        # answer one transport's metadata under another's life, and the
        # decode's introduction check would pass against the wrong worker).
        life, registration, geometry, words = self.life, self.registration, self._geometry, self.words
        agent_metadata = self._agent_metadata
        if agent_metadata is None:
            return wire.Refused("the producer's KV cache is not registered (the engine is asleep, vLLM "
                                "sleep mode); its KV is gone: compute locally, or retry once it woke up")
        compat = self._compat
        mismatches = compat.mismatches(request.compat, mine="producer", theirs="consumer")
        if mismatches:
            diff = "; ".join(mismatches)
            if len(diff) > MAX_DIFF_CHARS:  # the Refused reason has a bound on the wire (and logs should too)
                diff = diff[:MAX_DIFF_CHARS] + f"... ({len(diff)} characters)"
            self._refusals.event("incompatible KV caches", request.engine_id[:64],
                                 "refused handshake from consumer %r: %s", request.engine_id[:256], diff)
            hint = ("both engines must run the same model, dtype, block size and KV layout"
                    if any(not m.startswith("transfer_mode") for m in mismatches) else
                    "both engines must run the same transfer mode (kv_connector_extra_config 'mode': "
                    "'pull' or 'push')")
            return wire.Refused(f"incompatible KV caches ({diff}); {hint}")
        metadata = agent_metadata()
        if self._agent_metadata is not agent_metadata or self.life != life:
            return wire.Refused("the producer's KV cache was registered again during this handshake (the "
                                "engine slept or woke): retry")
        return wire.HandshakeReply(
            wire.PROTOCOL_VERSION, self._engine_id, self._rank, compat, compat.compat_hash(),
            metadata, wire.GeometryWire.from_geometry(geometry), registration, words, life)

    def on_renew(self, request: wire.Renew) -> wire.LeaseReply:
        if request.pin:
            statuses, pinned_s = self._leases.pin(_calls(request))
            return wire.LeaseReply(statuses, self._lease_ttl_s, pinned_s)
        return wire.LeaseReply(self._leases.renew(_calls(request)), self._lease_ttl_s)

    def on_confirm(self, request: wire.Confirm) -> wire.LeaseReply:
        return wire.LeaseReply(self._leases.confirm(_calls(request), request.release), self._lease_ttl_s)

    def on_release(self, request: wire.Release) -> wire.LeaseReply:
        return wire.LeaseReply(self._leases.release(_calls(request)), self._lease_ttl_s)

    def live(self, leases: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
        return self._leases.live(leases)

    # --- push mode (``pusher``) ------------------------------------------------------------------

    def on_push_hello(self, request: wire.PushHello) -> wire.PushReply:
        return self._to_pusher(request, lambda p: p.hello(request))

    def on_push(self, request: wire.Push) -> wire.PushReply:
        return self._to_pusher(request, lambda p: p.push(request))

    def on_push_reg(self, request: wire.PushReg) -> wire.PushReply:
        return self._to_pusher(request, lambda p: p.register(request))

    def on_push_query(self, request: wire.PushQuery) -> wire.PushReply:
        return self._to_pusher(request, lambda p: p.query(request))

    def _to_pusher(self, request: object, act: Callable[[PushWriter], wire.PushReply]) -> wire.PushReply:
        """``act``'s answer, naming the life of the transport it was given in
        (empty asleep, no transport): a decode that got no answer to a PUSH
        cannot trust another life's "never taken" (``wire.PushReply``)."""
        life = self._life()
        reply = self._push_answer(request, act)
        if self._life() != life:  # it slept or woke meanwhile: which life answered is not known
            life = b""
        return msgspec.structs.replace(reply, life=life)

    def _life(self) -> bytes:
        return self.life if self.pusher is not None else b""

    def _push_answer(self, request: object, act: Callable[[PushWriter], wire.PushReply]) -> wire.PushReply:
        pusher, query = self.pusher, isinstance(request, wire.PushQuery)
        if pusher is None:  # pull mode, or asleep: nothing is written (a query: nothing was)
            return wire.PushReply(wire.PushState.UNKNOWN if query else wire.PushState.REFUSED, self._not_pushing())
        if self._agent_metadata is None and not query:  # going to sleep: its pushes are answered, no new one
            token = getattr(request, "token", None)  # (a PUSH or PUSH_REG sent again: its state, not REFUSED)
            known = pusher.known(token) if isinstance(token, bytes) else None
            return known or wire.PushReply(wire.PushState.REFUSED, self._not_pushing())
        return act(pusher)

    def _not_pushing(self) -> str:
        if self._agent_metadata is None:
            return "the producer's KV cache is not registered (the engine is asleep): nothing is written"
        return (f"this producer runs mode {self._compat.transfer_mode!r}; push needs mode 'push' on both "
                "engines (kv_connector_extra_config)")


class WireCalls(Sequence[LeaseCall]):
    """A lease call's leases as the table reads them, each
    :class:`LeaseCall` built when it is read: the table stops verifying a
    call at its ``leases.WRONG_TOKENS_PER_CALL``-th wrong token, and the
    leases after it should cost nothing either (building 4,096 took 13 ms,
    as long as their HMACs)."""

    __slots__ = ("_leases",)

    def __init__(self, leases: list[wire.LeaseWire]) -> None:
        self._leases = leases

    def __len__(self) -> int:
        return len(self._leases)

    @overload
    def __getitem__(self, index: int) -> LeaseCall: ...

    @overload
    def __getitem__(self, index: slice) -> list[LeaseCall]: ...

    def __getitem__(self, index: int | slice) -> LeaseCall | list[LeaseCall]:
        if isinstance(index, slice):
            return [LeaseCall(w.ref(), w.claim, w.reader, w.readers) for w in self._leases[index]]
        w = self._leases[index]
        return LeaseCall(w.ref(), w.claim, w.reader, w.readers)


def _calls(request: wire.Renew | wire.Confirm | wire.Release) -> WireCalls:
    return WireCalls(request.leases)


class RdmaProducer:
    """The producer part of one worker. Built by
    :class:`~rdma_kv.connector.rdma.worker.RdmaWorker`; serves once
    :meth:`start` has given it the registered transport's metadata."""

    def __init__(self, engine_id: EngineId, settings: RdmaSettings, secret: auth.Secret | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine_id = engine_id
        self._settings = settings
        self._secret = secret
        self.leases = LeaseTable(clock, max_s=settings.lease_max_s, pin_s=settings.read_timeout_s)
        self.words: HeldWords | None = None
        """Pull mode with ``held_words``: the words the lease table keeps (``heldwords``)."""
        self.handler: ProducerHandler | None = None
        self._block_size = 0
        self.server: SideChannelServer | None = None

    def start(self, compat: wire.CompatInfo, rank: wire.RankInfo, transport: Transport,
              geometry: KVCacheGeometry) -> None:
        """Start the side-channel server (on ``side_channel_port + tp_rank``,
        or an OS-chosen port when it is 0)."""
        s = self._settings
        handler = ProducerHandler(self._engine_id, rank, s.lease_ttl_s, self.leases, compat,
                                  transport.metadata, geometry)
        handler.words = self._register_words(transport, geometry)
        self._block_size = compat.block_size
        handler.attach(self._new_pusher(transport, geometry))
        port = s.side_channel_port
        if s.side_channel_max_connections:
            raise_fd_limit(s.side_channel_max_connections)
        limits = (ConnectionLimits(max_connections=s.side_channel_max_connections)
                  if s.side_channel_max_connections else ConnectionLimits())
        self.server = SideChannelServer(handler, s.side_channel_host, port + s.tp_rank if port else 0,
                                        name=f"rdma-kv-sidechannel-{s.tp_rank}", secret=self._secret,
                                        limits=limits)
        self.handler = handler

    def on_step(self, lease_epoch: int, lease_key: bytes, sends: Iterable[SendSpec],
                reclaims: Iterable[int] = ()) -> None:
        """Apply the producer's part of one step's metadata: the epoch, new
        grants, then the leases the scheduler reclaims. Never raises."""
        if lease_epoch:
            self.leases.set_epoch(lease_epoch, lease_key)
        for send in sends:
            if send.lease.epoch != lease_epoch:  # issued before a new epoch (a wake from sleep)
                self.leases.discard(send.request_id)
                continue
            try:
                self.leases.grant(send.lease, send.block_ids, send.lease_ttl_s)
            except Exception:
                logger.exception("request %r: could not record its lease", send.request_id)
                continue
            pusher = self.pusher
            if send.transfer_id is not None and pusher is not None:
                pusher.granted(send)  # a decode registered (or will) under its transfer id
        if reclaims:
            self.leases.reclaim(reclaims)
        pusher = self.pusher
        if pusher is not None:
            pusher.reap()

    @property
    def pusher(self) -> PushWriter | None:
        """Push mode's writer (None in pull mode, before the KV cache is registered, and while asleep)."""
        return self.handler.pusher if self.handler is not None else None

    def begin_layers(self, layer_pushes: Sequence[LayerPushSpec]) -> None:
        """Before the step's forward pass (push mode: its layer-wise writes)."""
        pusher = self.pusher
        if pusher is not None:
            pusher.begin_step(layer_pushes)

    def save_layer(self, layer_name: str) -> None:
        """The engine stored ``layer_name`` for this step (push mode: write it)."""
        pusher = self.pusher
        if pusher is not None:
            pusher.write_layer(layer_name)

    def end_step(self) -> None:
        pusher = self.pusher
        if pusher is not None:
            pusher.end_step()

    def suspend(self) -> None:
        """Before the KV cache is unregistered (sleep): every lease ends, GONE
        to every later call (its consumer's load fails), and handshakes are
        refused until :meth:`resume`. A consumer reading under a read pin
        trusts its reads without a CONFIRM, so no new pin is granted from now
        on, and this first waits until every pin was released or ended (at
        most ``read_timeout_s``, the longest a pin lasts)."""
        if self.handler is not None:
            self.handler.suspend()
        self.leases.close_pins()
        deadline = time.monotonic() + self.leases.pin_s
        while (left := self.leases.pinned_for()) > 0 and time.monotonic() < deadline:
            time.sleep(min(left, 0.005))
        self.leases.end_all(Ending.SLEEP)

    def suspended(self) -> None:
        """The transport is closed (after :meth:`suspend`): the pusher's
        writes ended, landed or failed, and it stops answering."""
        if self.handler is not None:
            self.handler.detach()

    def resume(self, transport: Transport, geometry: KVCacheGeometry, registration: int) -> None:
        self.leases.open_pins()
        if self.handler is not None:
            self.handler.words = self._register_words(transport, geometry)
            self.handler.resume(transport.metadata, geometry, registration, self._new_pusher(transport, geometry))

    def _register_words(self, transport: Transport, geometry: KVCacheGeometry) -> wire.RegionWire | None:
        """Register this rank's held words with ``transport`` (pull mode,
        ``held_words``), kept by the lease table from now on; where they are."""
        if self._settings.mode != "pull" or not self._settings.held_words:
            return None
        if self.words is None or self.words.num_blocks != geometry.num_blocks:
            self.words = HeldWords(geometry.num_blocks)
        transport.register((self.words.address, self.words.nbytes), memory_type="host")
        self.leases.attach_words(self.words)
        return wire.RegionWire(self.words.address, self.words.nbytes)

    def _new_pusher(self, transport: Transport, geometry: KVCacheGeometry) -> PushWriter | None:
        if self._settings.mode != "push":
            return None
        layerwise, stream_fences = self._settings.push_layerwise, None
        if layerwise:
            try:
                stream_fences = fences.stream_fences(geometry)
            except ValueError as exc:
                logger.warning("push: layer-wise writes off, every block is written when its lease is granted: %s",
                               exc)
                layerwise = False
        return PushWriter(transport, geometry, self.leases, self._settings.read_timeout_s,
                          wait_s=self._settings.load_timeout_s, block_size=self._block_size,
                          layerwise=layerwise, fences=stream_fences)

    def take_done(self) -> set[RequestId]:
        """Requests whose lease was released or expired: their blocks may be freed."""
        return self.leases.take_done()

    def take_counters(self) -> LeaseCounters:
        """Lease events (granted, released, expired...) since the last call."""
        return self.leases.take_counters()

    def resources(self) -> dict[str, int]:
        pusher = self.pusher
        return {"leases": len(self.leases), "held_blocks": len(self.leases.held_block_ids()),
                "lease_age_max_ms": int(1000 * self.leases.oldest_age_s()),
                **({"pushes_running": pusher.running()} if pusher is not None else {})}

    def take_push_counters(self) -> PushCounters:
        """Push events since the last call (zero in pull mode)."""
        pusher = self.pusher
        return pusher.take_counters() if pusher is not None else PushCounters()

    def take_push_records(self) -> tuple[PushRecord, ...]:
        """Pushes resolved since the last call (none in pull mode)."""
        pusher = self.pusher
        return pusher.take_records() if pusher is not None else ()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
