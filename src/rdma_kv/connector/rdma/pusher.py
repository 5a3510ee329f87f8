"""Push mode, the producer's side: writing a lease's blocks into a decode's KV cache.

Owns :class:`PushWriter`: the decode ranks that introduced their KV cache
(PUSH_HELLO: agent metadata, geometry, registration), and the pushes (one
per decode allocation ``token``): PUSH checks the lease, writes, and the
transport notifies the decode once every write is remotely complete;
PUSH_QUERY answers where a push is, or aborts it.

What a push may write, and when (the never-silent argument in full:
docs/rdma-connector.md, "Push mode"):

- **Only the lease's blocks, only into the allocation named.** PUSH carries
  the lease as RENEW/CONFIRM do (token, binding, claim): FORGED, UNKNOWN,
  GONE or CLAIMED write nothing. The producer block ids must be among the
  lease's (per group); the decode block ids are the decode's allocation for
  this request, and its ``token`` is random per allocation. One push per
  lease and decode rank: a second PUSH under the same lease from the same
  rank (a replay, a stale registration) is refused.
- **From blocks that stay held.** The lease is pinned while its writes are
  in flight (``LeaseTable.pin_for_push``): no expiry or reclaim frees the
  source blocks under a write.
- **Completion is never early.** The writes are posted with the decode's
  token as their notification: the transport flushes every endpoint that
  carried a part before it sends the notification (``csrc/post.c``), so the
  decode sees the token only after every byte landed.
- **Bounded.** Every write batch has the transfer timeout
  (``read_timeout_s``, the pull reads' own); ``writes_end_within_s`` in the
  answer says so. Once a push resolved (DONE, FAILED, ABORTED), nothing for
  it is posted again, and the lease is released (its blocks go back to the
  prefill engine through ``done_sending``).

Runs on the side channel's loop thread (posting does not block) and the
transport's progress thread (completions). Imports numpy, the standard
library, the connector's ``geometry`` and ``types``, and its ``rdma``
modules ``leases``, ``slots``, ``stats``, ``transport_api`` and ``wire``.
Never the consumer's modules.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.leases import LeaseCall, LeaseTable
from rdma_kv.connector.rdma.meta import LayerPushSpec, SendSpec
from rdma_kv.connector.rdma.slots import HeadSlice, SlotTable
from rdma_kv.connector.rdma.stats import MAX_RECORDS, PushCounters, PushRecord, Tally
from rdma_kv.connector.rdma.transport_api import PreparedList, TransferHandle, Transport

__all__ = ["PUSH_NOTIFY_PREFIX", "PushWriter"]

logger = logging.getLogger(__name__)

PUSH_NOTIFY_PREFIX = wire.PUSH_NOTIFY_PREFIX

FORGET_AFTER_S = 600.0
"""A resolved push is remembered this long (a decode's late query reads its state)."""
MAX_REMEMBERED = 1 << 16

RUNNING, WAITING, DONE, FAILED, ABORTED, REFUSED, PENDING, UNKNOWN = (
    wire.PushState.RUNNING, wire.PushState.WAITING, wire.PushState.DONE, wire.PushState.FAILED,
    wire.PushState.ABORTED, wire.PushState.REFUSED, wire.PushState.PENDING, wire.PushState.UNKNOWN)


@dataclasses.dataclass
class _Decode:
    """A decode rank that introduced its KV cache (PUSH_HELLO)."""

    name: str  # the transport peer
    geometry: KVCacheGeometry
    registration: int
    key: tuple[str, int]  # (engine id, TP rank)
    tables: dict[HeadSlice | None, tuple[SlotTable, PreparedList]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class _Push:
    call: LeaseCall | None
    """The lease it writes from (pinned while it writes); None while WAITING."""
    state: wire.PushState = RUNNING
    detail: str = ""
    aborted: bool = False
    nbytes: int = 0
    overlapped_nbytes: int = 0
    """Of ``nbytes``, written by layer writes posted while the prefill's forward pass ran."""
    resolved_at: float | None = None
    reg: wire.PushReg | None = None
    """Concurrent dispatch: the registration, until its prefill's lease is granted."""
    token: bytes = b""
    wait_until: float = 0.0
    started_at: float = 0.0
    decode: _Decode | None = None
    """The decode rank written to (as introduced): forgotten if the push fails."""
    # Layer-wise writes (concurrent dispatch, while the prefill computes):
    written_upto: int = -1
    """Blocks (prompt block index, exclusive) every layer of which was written; -1: none yet."""
    producer_blocks: tuple[int, ...] = ()
    """The prefill's blocks the layer-wise writes read (checked against its lease at the seal)."""
    outstanding: int = 0
    """Write batches posted for it and not yet completed."""
    error: str | None = None
    sealing: bool = False
    expired: bool = False
    finishing: bool = False  # its final flush is posted


@dataclasses.dataclass(frozen=True)
class _Granted:
    """A lease granted under a transfer id (concurrent dispatch), for the
    decode ranks that register under it."""

    send: SendSpec
    at: float


class PushWriter:
    """The producer rank's pushes."""

    def __init__(self, transport: Transport, geometry: KVCacheGeometry, leases: LeaseTable,
                 write_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 wait_s: float = 30.0, block_size: int = 0, layerwise: bool = True) -> None:
        self._transport = transport
        self._geometry = geometry
        self._leases = leases
        self._write_timeout_s = write_timeout_s
        self._wait_s = wait_s
        """How long a registration waits for its prefill (concurrent dispatch)."""
        self._block_size = block_size  # tokens per block (concurrent dispatch maps tokens to blocks)
        self._waiting: dict[str, list[bytes]] = collections.defaultdict(list)  # transfer id -> tokens
        self.layerwise = layerwise
        """Write each layer as it is stored (host KV caches: a CUDA cache would
        need the layer's stream synchronised first; it is written at the seal)."""
        self._active: list[tuple[_Push, LayerPushSpec, int, int, set[int]]] = []
        """This step's layer-wise writes: (push, chunk, first block, end block, the layers posted)."""
        self._step: tuple[LayerPushSpec, ...] = ()
        self._stored: list[str] = []  # layers stored so far this step
        self._reg_seq = 0  # registrations so far (PUSH_REG, side channel thread)
        self._joined_seq = 0  # ... when the engine thread last took them
        self._granted: collections.OrderedDict[str, _Granted] = collections.OrderedDict()
        self._clock = clock
        self._lock = threading.Lock()
        self._decodes: dict[tuple[str, int], _Decode] = {}
        self._pushes: collections.OrderedDict[bytes, _Push] = collections.OrderedDict()
        self._generations: set[tuple[int, int]] = set()  # (lease, reader) pushed: a second PUSH is refused
        self._own: dict[HeadSlice | None, tuple[SlotTable, PreparedList]] = {}
        self._counts = Tally(PushCounters)  # counted under self._lock
        self._records: collections.deque[PushRecord] = collections.deque(maxlen=MAX_RECORDS)  # under the lock

    # --- PUSH_HELLO ------------------------------------------------------------------------

    def hello(self, request: wire.PushHello) -> wire.PushReply:
        key = (request.engine_id, request.rank.tp_rank)
        geometry = request.geometry.to_geometry()
        with self._lock:
            old = self._decodes.get(key)
        if old is not None and old.registration == request.registration:
            return wire.PushReply(DONE, "known")
        name = self._transport.add_peer(request.agent_metadata)  # replaces an older incarnation
        with self._lock:
            self._decodes[key] = _Decode(name, geometry, request.registration, key)
            self._counts.add("hellos")
        return wire.PushReply(DONE, "introduced")

    # --- PUSH --------------------------------------------------------------------------------

    def push(self, request: wire.Push) -> wire.PushReply:
        token = request.token
        found = self._introduced(request)
        if isinstance(found, wire.PushReply):
            return found
        decode = found
        with self._lock:
            replayed = (request.lease.generation, request.lease.reader) in self._generations
        if replayed:
            self._count("refused")
            return wire.PushReply(REFUSED, f"lease {request.lease.generation} was already pushed to decode rank "
                                           f"{request.lease.reader}: a replayed or stale registration writes nothing")
        w = request.lease
        call = LeaseCall(w.ref(), w.claim, w.reader, w.readers)
        status, lease_blocks = self._leases.pin_for_push(call)
        if status is wire.LeaseStatus.PENDING:
            return wire.PushReply(PENDING, "the lease's grant has not reached this worker yet")
        if status is not wire.LeaseStatus.HELD:
            self._count("refused")
            return wire.PushReply(REFUSED, f"lease {status.name}")
        entry = _Push(call, token=token, started_at=self._clock(), decode=decode)
        try:
            planned = self._plan(request.remote_block_ids, request.local_block_ids, request.remote_heads,
                                 request.local_heads, decode, lease_blocks)
        except ValueError as exc:
            self._leases.unpin(w.generation)
            self._count("refused")
            return wire.PushReply(REFUSED, str(exc))
        with self._lock:
            self._generations.add((w.generation, w.reader))
            self._remember(token, entry)
        self._write(entry, planned, request.engine_id)
        with self._lock:
            return self._answer(entry)

    def _introduced(self, request: wire.Push | wire.PushReg) -> _Decode | wire.PushReply:
        """The decode rank ``request`` comes from, introduced under its
        registration; else the answer: the push's state when its token is
        known (the decode asking again), REFUSED when the decode is unknown."""
        with self._lock:
            known = self._pushes.get(request.token)
            if known is not None:
                return self._answer(known)
            decode = self._decodes.get((request.engine_id, request.tp_rank))
        if decode is None or decode.registration != request.registration:
            return wire.PushReply(REFUSED, f"decode {request.engine_id!r} rank {request.tp_rank} registration "
                                           f"{request.registration} did not introduce its KV cache (PUSH_HELLO) "
                                           "to this producer rank")
        return decode

    def _write(self, entry: _Push, planned: tuple[np.ndarray, np.ndarray, PreparedList, PreparedList],
               decode: str) -> None:
        """Post ``entry``'s writes, notified with its token once remotely complete."""
        src, dst, own_prep, dst_prep = planned
        try:
            xfer = self._transport.write_prepared(own_prep, src, dst_prep, dst,
                                                  notify=PUSH_NOTIFY_PREFIX + entry.token,
                                                  timeout_s=self._write_timeout_s)
        except Exception as exc:  # nothing posted: a post that raises leaves nothing in flight
            rid = entry.call.ref.request_id if entry.call is not None else "?"
            logger.warning("push of %r to %r: posting the writes failed: %s", rid, decode, exc)
            self._resolve(entry, None, f"posting the writes failed: {exc}")
            return
        entry.nbytes = xfer.nbytes
        xfer.add_done_callback(lambda x: self._resolve(entry, x, None))

    def _plan(self, remote_ids: list[list[int]], local_ids: list[list[int]], remote_heads: wire.HeadsWire | None,
              local_heads: wire.HeadsWire | None, decode: _Decode, lease_blocks: tuple[tuple[int, ...], ...]
              ) -> tuple[np.ndarray, np.ndarray, PreparedList, PreparedList]:
        """(source slots, destination slots, their prepared lists); ValueError
        naming what is wrong (nothing posted then)."""
        remote = [np.asarray(g, dtype=np.int64) for g in remote_ids]
        local = [np.asarray(g, dtype=np.int64) for g in local_ids]
        if len(remote) != len(lease_blocks) or len(local) != len(lease_blocks):
            raise ValueError(f"{len(remote)} and {len(local)} groups of block ids for a lease of "
                             f"{len(lease_blocks)} groups")
        for i, (mine, held) in enumerate(zip(remote, lease_blocks)):
            outside = np.setdiff1d(mine, np.asarray(held, dtype=np.int64))
            if outside.size:
                raise ValueError(f"producer block(s) {outside[:8].tolist()} of group {i} are not the lease's: "
                                 "a push writes only the blocks its lease holds")
            if mine.size != local[i].size:
                raise ValueError(f"group {i}: {mine.size} producer blocks for {local[i].size} decode blocks")
        own, dst = self._tables(decode, remote_heads, local_heads)
        return own[0].indices(remote, "producer"), dst[0].indices(local, "decode"), own[1], dst[1]

    def _tables(self, decode: _Decode, remote_heads: wire.HeadsWire | None, local_heads: wire.HeadsWire | None
                ) -> tuple[tuple[SlotTable, PreparedList], tuple[SlotTable, PreparedList]]:
        """This rank's and the decode's slot tables, prepared (made once per head slice)."""
        own_heads = _heads(remote_heads)
        dst_heads = _heads(local_heads)
        with self._lock:
            own = self._own.get(own_heads)
            dst = decode.tables.get(dst_heads)
        if own is None:
            table = SlotTable(self._geometry, own_heads)
            own = (table, self._transport.prep_local(table.descs))
            with self._lock:
                self._own[own_heads] = own
        if dst is None:
            table = SlotTable(decode.geometry, dst_heads)
            if not np.array_equal(table.row_nbytes, own[0].row_nbytes):
                raise ValueError("the decode's and this producer's slot tables differ in bytes per block "
                                 "(KV layouts or head slices do not match)")
            dst = (table, self._transport.prep_remote(decode.name, table.descs))
            with self._lock:
                decode.tables[dst_heads] = dst
        return own, dst

    def _resolve(self, entry: _Push, xfer: TransferHandle | None, error: str | None) -> None:
        """The push's writes resolved (``xfer`` done or failed), or were never
        posted (``error``): nothing more is written for it; unpin and release
        the lease (its blocks go back to the engine)."""
        failure = error if error is not None else (None if xfer is None or xfer.error is None
                                                  else f"writes failed: {xfer.error}")
        with self._lock:
            if entry.state not in (RUNNING, WAITING):
                return  # resolved already
            if failure is not None:  # even if aborted: the decode must know the batch broke (pushes.py)
                entry.state, entry.detail = FAILED, failure
            elif entry.aborted:
                entry.state, entry.detail = ABORTED, "aborted by the decode (its writes had completed)"
            elif entry.expired:
                entry.state = REFUSED  # its layer-wise writes are flushed; no prefill finished in time
                entry.detail = (f"no prefill under transfer id {entry.reg.transfer_id if entry.reg else '?'!r} "
                                f"finished on this producer within {self._wait_s:g} s")
            else:
                entry.state = DONE
            entry.resolved_at = self._clock()
            self._counts.add(entry.state.value)
            if entry.state is FAILED and entry.decode is not None:
                # A failed write may have failed the transport's endpoint to the decode (a deadline
                # closes it): forget the decode, so that its next PUSH is answered "introduce your KV
                # cache" and its PUSH_HELLO imports its metadata afresh (else every later push to it
                # fails against the dead endpoint). A newer introduction is kept.
                if self._decodes.get(entry.decode.key) is entry.decode:
                    del self._decodes[entry.decode.key]
            if entry.state is DONE:
                self._counts.add("written_bytes", entry.nbytes)
                self._counts.add("overlapped_bytes", entry.overlapped_nbytes)
            self._record(entry)
        if entry.call is not None:
            self._leases.unpin(entry.call.ref.generation)
            self._leases.release([entry.call])

    # --- PUSH_REG: concurrent dispatch -----------------------------------------------------------

    def register(self, request: wire.PushReg) -> wire.PushReply:
        """A decode's blocks under a transfer id: written once (or as soon as)
        the prefill under that id finished; WAITING until then, REFUSED if no
        such prefill finishes within ``wait_s``."""
        self.reap()
        token = request.token
        found = self._introduced(request)
        if isinstance(found, wire.PushReply):
            return found
        if len(request.local_block_ids) != 1:
            return wire.PushReply(REFUSED, "concurrent dispatch serves models with one KV-cache group")
        now = self._clock()
        entry = _Push(None, WAITING, token=token, reg=request, wait_until=now + self._wait_s, started_at=now)
        with self._lock:
            self._remember(token, entry)
            self._waiting[request.transfer_id].append(token)
            self._reg_seq += 1
            granted = self._granted.get(request.transfer_id)
            self._counts.add("registrations")
            if granted is None:
                self._counts.add("registrations_early")
        if granted is not None:
            self._start_registered(entry, granted.send)
        with self._lock:
            return self._answer(entry)

    def granted(self, send: SendSpec) -> None:
        """The prefill under ``send.transfer_id`` finished and its lease was
        granted (producer worker, step metadata): write every registration
        waiting for it; later ones are written when they come."""
        assert send.transfer_id is not None
        with self._lock:
            self._granted[send.transfer_id] = _Granted(send, self._clock())
            while len(self._granted) > MAX_REMEMBERED:
                self._granted.popitem(last=False)
            tokens = self._waiting.pop(send.transfer_id, [])
            entries = [self._pushes[t] for t in tokens if t in self._pushes]
        for entry in entries:
            self._start_registered(entry, send)

    def _start_registered(self, entry: _Push, send: SendSpec) -> None:
        """Pin ``send``'s lease for ``entry``'s decode rank and write."""
        reg = entry.reg
        assert reg is not None
        with self._lock:
            if entry.state is not WAITING:
                return  # aborted or expired meanwhile
            decode = self._decodes.get((reg.engine_id, reg.tp_rank))
            entry.state = RUNNING  # taken: no second start
            entry.decode = entry.decode or decode
        problem = None
        bs = self._block_size
        first = reg.first_token // bs if bs else 0
        ids = send.block_ids[0] if send.block_ids else ()
        local = list(reg.local_block_ids[0])
        if decode is None:
            problem = "the decode forgot its KV cache (re-registered)"
        elif not bs or reg.first_token % bs:
            problem = f"first token {reg.first_token} is not at a block boundary (block size {bs})"
        elif send.num_tokens != reg.num_tokens:
            problem = (f"the prefill under transfer id {reg.transfer_id!r} has {send.num_tokens} prompt tokens, "
                       f"the decode {reg.num_tokens}: a router must send both legs the same prompt")
        elif first + len(local) > len(ids):
            problem = f"the decode registered {len(local)} blocks from block {first}; the prefill holds {len(ids)}"
        call = LeaseCall(send.lease, _claim(reg.transfer_id), reg.reader, reg.readers)
        if problem is None:
            status, lease_blocks = self._leases.pin_for_push(call)
            if status is not wire.LeaseStatus.HELD:
                problem = f"the prefill's lease is {status.name}"
        if problem is not None:
            with self._lock:
                entry.state, entry.detail, entry.resolved_at = REFUSED, problem, self._clock()
                self._counts.add("refused")
                self._record(entry)
            return
        entry.call = call
        done = max(entry.written_upto, first)  # blocks the layer-wise writes covered
        if done > first and tuple(ids[first:done]) != tuple(entry.producer_blocks[first:done]):
            entry.error = "the prefill's blocks changed under its layer-wise writes (preempted)"
        try:
            assert decode is not None
            planned = self._plan([list(ids[done:first + len(local)])], [local[done - first:]], reg.remote_heads,
                                 reg.local_heads, decode, lease_blocks)
        except ValueError as exc:
            if done == first:  # nothing was posted: nothing can land
                self._leases.unpin(send.lease.generation)
                with self._lock:
                    entry.state, entry.detail, entry.resolved_at = REFUSED, str(exc), self._clock()
                    self._counts.add("refused")
                    self._record(entry)
                return
            entry.error = str(exc)
            planned = None
        if done == first and entry.outstanding == 0 and planned is not None:
            self._write(entry, planned, reg.engine_id)  # every block at once, notified after its flush
            return
        # Layer-wise writes went out: write the rest, then a flush that notifies (_finish_layerwise).
        if planned is not None and len(planned[0]) and entry.error is None and decode is not None:
            self._post_layer(entry, planned, decode)
        with self._lock:
            entry.sealing = True
        self._finish_layerwise(entry)

    # --- layer-wise writes (concurrent dispatch) -----------------------------------------------------

    def begin_step(self, specs: Sequence[LayerPushSpec]) -> None:
        """This step's prefill chunks under a transfer id: every layer's blocks
        complete by the chunk's end go to the decodes registered for them, as
        each layer is stored (:meth:`write_layer`). A decode that registers
        while the step runs joins at the next layer stored."""
        self._active = []
        self._stored = []
        self._step = tuple(specs) if self.layerwise and self._block_size else ()
        if self._step:
            self._join()

    def _join(self) -> int:
        """Take this step's registrations not yet taken (engine thread); how
        many entries were active before (the new ones follow them)."""
        bs = self._block_size
        before = len(self._active)
        taken = {id(a[0]) for a in self._active}
        with self._lock:
            self._joined_seq = self._reg_seq
            for spec in self._step:
                for token in self._waiting.get(spec.transfer_id, ()):
                    entry = self._pushes.get(token)
                    reg = entry.reg if entry is not None else None
                    if entry is None or reg is None or id(entry) in taken or entry.state is not WAITING or \
                            entry.aborted or entry.expired or reg.local_heads is not None or \
                            reg.remote_heads is not None:
                        continue
                    first, count = reg.first_token // bs, len(reg.local_block_ids[0])
                    if entry.written_upto < 0:
                        entry.written_upto = first
                    elif tuple(spec.block_ids[:entry.written_upto]) != entry.producer_blocks[:entry.written_upto]:
                        entry.error = "the prefill's blocks changed between its chunks (preempted)"
                        continue
                    lo, hi = entry.written_upto, min(spec.end // bs, first + count, len(spec.block_ids))
                    entry.producer_blocks = spec.block_ids
                    if hi > lo:
                        self._active.append((entry, spec, lo, hi, set()))
        return before

    def write_layer(self, layer_name: str) -> None:
        """The engine stored ``layer_name`` for this step: post its rows of
        the blocks complete so far (no notification: the seal flushes)."""
        if not self._step:
            return
        self._stored.append(layer_name)
        joined = len(self._active)
        if self._reg_seq != self._joined_seq:  # a decode registered during the step (read without the lock:
            joined = self._join()              # one missed here is taken at the next layer, or at the end)
        for i, (entry, spec, lo, hi, posted) in enumerate(self._active):
            # One that joined now also gets the layers stored before it came.
            names = [layer_name] if i < joined else self._stored
            self._post_rows(entry, spec, lo, hi, posted, names, overlapped=True)

    def end_step(self) -> None:
        """The step's forward pass ended: every layer of it is in the (host)
        KV cache. Entries that joined late, or whose layers the engine did
        not all hand to ``save_kv_layer`` (vLLM skips it where a layer has
        no attention metadata), get their missing layers now; a chunk's
        blocks count as written only once every layer of them was posted.
        (Counting them written anyway sent a decode blocks never written:
        completions differed from a plain engine's, silently.)"""
        if self._step and self._reg_seq != self._joined_seq:
            self._join()
        num_layers = len(self._geometry.layers)
        names = [layer.name for layer in self._geometry.layers]
        for entry, spec, lo, hi, posted in self._active:
            missing = [n for i, n in enumerate(names) if i not in posted]
            caught_up = bool(missing) and entry.error is None and \
                self._post_rows(entry, spec, lo, hi, posted, missing, overlapped=False)
            with self._lock:
                if entry.error is None and len(posted) == num_layers:
                    entry.written_upto = max(entry.written_upto, hi)
                    self._counts.add("layer_steps_caught_up" if caught_up else "layer_steps")
        self._active = []
        self._stored = []
        self._step = ()

    def _post_rows(self, entry: _Push, spec: LayerPushSpec, lo: int, hi: int, posted: set[int],
                   layer_names: Sequence[str], overlapped: bool) -> bool:
        """Post ``layer_names``' rows of the chunk's blocks ``[lo, hi)`` to
        ``entry``'s decode (one batch); the layers go into ``posted``."""
        reg = entry.reg
        assert reg is not None
        with self._lock:
            decode = self._decodes.get((reg.engine_id, reg.tp_rank))
            if decode is None or entry.state is not WAITING or entry.aborted or entry.error:
                return False
        try:
            own, dst = self._tables(decode, None, None)
            layers = [own[0].layer_index[name] for name in layer_names]
            rows = np.flatnonzero(np.isin(own[0].row_layer, layers))
            first = reg.first_token // self._block_size
            mine = np.asarray(spec.block_ids[lo:hi], dtype=np.int64)
            theirs = np.asarray(reg.local_block_ids[0][lo - first:hi - first], dtype=np.int64)
            src = (own[0].row_base[rows][:, None] + mine[None, :]).ravel()
            dst_idx = (dst[0].row_base[rows][:, None] + theirs[None, :]).ravel()
        except (KeyError, ValueError) as exc:
            with self._lock:
                entry.error = f"layer(s) {list(layer_names)!r}: {exc}"
            return False
        if not self._post_layer(entry, (src, dst_idx, own[1], dst[1]), decode, overlapped):
            return False
        posted.update(layers)
        return True

    def _post_layer(self, entry: _Push, planned: tuple[np.ndarray, np.ndarray, PreparedList, PreparedList],
                    decode: _Decode, overlapped: bool = False) -> bool:
        src, dst, own_prep, dst_prep = planned
        with self._lock:
            entry.outstanding += 1
            entry.decode = entry.decode or decode
        try:
            xfer = self._transport.write_prepared(own_prep, src, dst_prep, dst, timeout_s=self._write_timeout_s)
        except Exception as exc:
            with self._lock:
                entry.outstanding -= 1
                entry.error = entry.error or f"posting layer writes failed: {exc}"
            self._finish_layerwise(entry)
            return False
        with self._lock:
            self._counts.add("layer_writes")
        xfer.add_done_callback(lambda x: self._layer_done(entry, x, overlapped))
        return True

    def _layer_done(self, entry: _Push, xfer: TransferHandle, overlapped: bool) -> None:
        with self._lock:
            entry.outstanding -= 1
            if xfer.error is not None:
                entry.error = entry.error or f"layer writes failed: {xfer.error}"
            entry.nbytes += xfer.nbytes if xfer.error is None else 0
            if overlapped and xfer.error is None:
                entry.overlapped_nbytes += xfer.nbytes
        self._finish_layerwise(entry)

    def _finish_layerwise(self, entry: _Push) -> None:
        """Once nothing is outstanding: a sealed push flushes every endpoint
        and notifies (DONE after it); a failed, aborted or expired one flushes
        without notifying, then answers (nothing of it can land after)."""
        reg = entry.reg
        assert reg is not None
        with self._lock:
            ended = entry.aborted or entry.expired or entry.error is not None
            if entry.outstanding or entry.finishing or not (entry.sealing or ended):
                return
            if entry.state not in (WAITING, RUNNING):
                return
            entry.finishing = True
            decode = self._decodes.get((reg.engine_id, reg.tp_rank))
        notify = PUSH_NOTIFY_PREFIX + entry.token if not ended else None
        try:
            if decode is None:
                raise RuntimeError("the decode forgot its KV cache")
            flush = self._transport.flush(decode.name, notify=notify, timeout_s=self._write_timeout_s)
        except Exception as exc:
            self._resolve(entry, None, entry.error or f"flushing the layer writes failed: {exc}")
            return
        flush.add_done_callback(lambda x: self._resolve(entry, x, entry.error))

    def reap(self) -> None:
        """Registrations whose prefill did not finish within ``wait_s``: REFUSED
        (the decode's load fails and it recomputes); nothing was posted."""
        now = self._clock()
        expired_written: list[_Push] = []
        with self._lock:
            for transfer_id, tokens in list(self._waiting.items()):
                keep = []
                for t in tokens:
                    entry = self._pushes.get(t)
                    if entry is None or entry.state is not WAITING:
                        continue
                    if now >= entry.wait_until and entry.written_upto >= 0 or entry.outstanding:
                        if now >= entry.wait_until:
                            entry.expired = True  # layer-wise writes went out: flushed before it answers
                            expired_written.append(entry)
                        else:
                            keep.append(t)
                    elif now >= entry.wait_until:
                        entry.state, entry.resolved_at = REFUSED, now
                        entry.detail = (f"no prefill under transfer id {transfer_id!r} finished on this producer "
                                        f"within {self._wait_s:g} s")
                        self._counts.add("refused")
                        self._record(entry)
                    else:
                        keep.append(t)
                if keep:
                    self._waiting[transfer_id] = keep
                else:
                    del self._waiting[transfer_id]
            while self._granted and now - next(iter(self._granted.values())).at > self._leases.max_s:
                self._granted.popitem(last=False)
        for entry in expired_written:
            self._finish_layerwise(entry)

    # --- PUSH_QUERY ----------------------------------------------------------------------------

    def query(self, request: wire.PushQuery) -> wire.PushReply:
        self.reap()
        with self._lock:
            entry = self._pushes.get(request.token)
            if entry is None:
                return wire.PushReply(UNKNOWN, "no push of this token on this producer rank")
            if request.abort and entry.state is WAITING and entry.written_upto < 0 and not entry.outstanding:
                entry.state, entry.detail, entry.resolved_at = ABORTED, "aborted before anything was posted", \
                    self._clock()
                self._counts.add("aborted")
                self._record(entry)
                return self._answer(entry)
            if request.abort and entry.state is WAITING and not entry.aborted:
                entry.aborted = True  # layer-wise writes went out: flushed before it answers ABORTED
                flush_now = entry
            else:
                flush_now = None
            if request.abort and entry.state is RUNNING and not entry.aborted:
                # Posted writes cannot be recalled: they resolve within the
                # timeout; the decode waits for that answer before reusing its blocks.
                entry.aborted = True
                self._counts.add("abort_asked")
            answer = self._answer(entry)
        if flush_now is not None:
            self._finish_layerwise(flush_now)
            with self._lock:
                answer = self._answer(flush_now)
        return answer

    # --- bookkeeping (lock held) ---------------------------------------------------------------

    def _answer(self, entry: _Push) -> wire.PushReply:
        within = {RUNNING: self._write_timeout_s,
                  WAITING: max(0.0, entry.wait_until - self._clock()) + self._write_timeout_s}.get(entry.state, 0.0)
        return wire.PushReply(entry.state, entry.detail, within)

    def _remember(self, token: bytes, entry: _Push) -> None:
        self._pushes[token] = entry
        now = self._clock()
        while self._pushes:
            old = next(iter(self._pushes.values()))
            forget = len(self._pushes) > MAX_REMEMBERED or (
                old.resolved_at is not None and now - old.resolved_at > FORGET_AFTER_S)
            if not forget or old.state in (RUNNING, WAITING):
                break
            self._pushes.popitem(last=False)
            if old.call is not None:
                self._generations.discard((old.call.ref.generation, old.call.reader))

    def _record(self, entry: _Push) -> None:
        """``entry`` resolved: its per-request record."""
        if entry.call is not None:
            rid = str(entry.call.ref.request_id)
        else:
            rid = f"transfer:{entry.reg.transfer_id}" if entry.reg is not None else "?"
        end = entry.resolved_at if entry.resolved_at is not None else self._clock()
        self._records.append(PushRecord(request_id=rid, outcome=entry.state.value, nbytes=entry.nbytes,
                                        overlapped_nbytes=entry.overlapped_nbytes,
                                        total_s=max(0.0, end - entry.started_at)))

    def running(self) -> int:
        with self._lock:
            return sum(p.state in (RUNNING, WAITING) for p in self._pushes.values())

    def take_counters(self) -> PushCounters:
        """Push events since the last call."""
        with self._lock:
            return self._counts.take()

    def take_records(self) -> tuple[PushRecord, ...]:
        """Pushes resolved since the last call."""
        with self._lock:
            out = tuple(self._records)
            self._records.clear()
            return out

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts.add(name)


def _claim(transfer_id: str) -> bytes:
    """The claim every decode rank of one concurrent push makes on the lease:
    derived from the transfer id both legs carry."""
    return hashlib.sha256(b"rdma-kv push claim " + transfer_id.encode()).digest()[:16]


def _heads(w: wire.HeadsWire | None) -> HeadSlice | None:
    return None if w is None else HeadSlice(w.first, w.count, w.of)
