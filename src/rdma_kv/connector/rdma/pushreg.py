"""Push mode, the producer's side, concurrent dispatch: registrations under
a router's transfer id, the prefill's lease granted under it, and the
layer-wise writes of a prefill while its forward pass runs.

:class:`ConcurrentDispatch` is the half of :class:`pusher.PushWriter` that
serves a router sending both legs at once (vllm-router's moriio mode):

- PUSH_REG (side channel thread): the decode's blocks under a transfer id,
  WAITING until the prefill under that id is granted its lease (``granted``,
  the producer's step metadata), REFUSED if none is within ``wait_s``
  (``reap``).
- The prefill's forward pass (engine thread): ``begin_step`` (from
  ``bind_connector_metadata``, before the pass: vLLM 0.32 calls
  ``start_load_kv`` after it), ``write_layer`` per ``save_kv_layer``
  (a registration that arrives during the pass joins at the next layer,
  with the layers stored before it), ``end_step`` (``wait_for_save``: the
  layers a registration missed). Only blocks complete at the chunk's end
  are written, and a chunk counts as written once every layer of it was
  posted. On a CUDA KV cache a layer is posted only once its fence passed
  (``fences``): at a later layer if the GPU got that far, else at
  ``end_step``, which waits for the forward pass first.
- The seal (the lease granted): pin it, check the layer-wise writes read
  the blocks it holds, write the rest, wait for every batch, then one
  flush of every endpoint that notifies the decode (``_finish_layerwise``).

The writer's state (its lock, pushes, decodes, counters) and the
primitives of every push (``_tables``, ``_plan``, ``_write``,
``_resolve``, ``_answer``, ``_remember``, ``_record``, ``_introduced``)
are :class:`pusher.PushWriter`'s; this class declares what it uses.
Imports numpy, the standard library and the connector's ``geometry`` and
``rdma`` modules ``fences``, ``leases``, ``meta``, ``pushstate``, ``slots``, ``stats``,
``transport_api`` and ``wire``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import numpy as np

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.fences import Fence, FenceFactory
from rdma_kv.connector.rdma.leases import LeaseCall, LeaseTable
from rdma_kv.connector.rdma.meta import LayerPushSpec, SendSpec
from rdma_kv.connector.rdma.pushstate import (
    MAX_REMEMBERED,
    REFUSED,
    RUNNING,
    WAITING,
    Decode,
    DecodeKey,
    Granted,
    PushEntry,
    claim,
    decode_key,
    describe,
)
from rdma_kv.connector.rdma.slots import SlotTable
from rdma_kv.connector.rdma.stats import PushCounters, Tally
from rdma_kv.connector.rdma.transport_api import PreparedList, TransferHandle, Transport

__all__ = ["ConcurrentDispatch"]

PUSH_NOTIFY_PREFIX = wire.PUSH_NOTIFY_PREFIX

Planned = tuple[np.ndarray, np.ndarray, PreparedList, PreparedList]
"""(source slots, destination slots, their prepared lists)."""


class ConcurrentDispatch:
    """Registrations, grants and layer-wise writes (see the module)."""

    # The writer's state (pusher.PushWriter.__init__).
    _transport: Transport
    _geometry: KVCacheGeometry
    _leases: LeaseTable
    _write_timeout_s: float
    _wait_s: float
    _block_size: int
    _clock: Callable[[], float]
    _lock: threading.Lock
    _decodes: dict[DecodeKey, Decode]
    _pushes: collections.OrderedDict[bytes, PushEntry]
    _counts: Tally[PushCounters]
    layerwise: bool
    _fences: FenceFactory | None

    def _introduced_as(self, reg: wire.Push | wire.PushReg) -> Decode | None:
        """The decode ``reg`` names blocks of, under the lock: None when unknown,
        once it re-registered its KV cache (the blocks named are of the old
        one), or once it introduced itself on another link than ``reg``'s: this
        rank's import of it is then the new link's, and a write over it would
        be out of reach of the fence the decode applies when ``reg`` fails
        (it fences the link ``reg`` was sent on)."""
        decode = self._decodes.get(decode_key(reg))
        if decode is None or decode.registration != reg.registration or reg.link and reg.link != decode.link:
            return None
        return decode

    def _init_concurrent(self) -> None:
        self._waiting: dict[str, list[bytes]] = collections.defaultdict(list)  # transfer id -> tokens
        self._granted: collections.OrderedDict[str, Granted] = collections.OrderedDict()
        self._reg_owners: collections.OrderedDict[str, tuple[str, int, dict[int, tuple[DecodeKey, bytes]]]] = \
            collections.OrderedDict()
        """Transfer id -> (its decode engine id, reader count, each reader's worker and last token):
        ``_take_transfer_id``."""
        self._active: list[tuple[PushEntry, LayerPushSpec, int, int, set[int]]] = []
        """This step's layer-wise writes: (push, chunk, first block, end block, the layers posted)."""
        self._step: tuple[LayerPushSpec, ...] = ()
        self._stored: list[str] = []  # layers stored so far this step
        self._fenced: collections.deque[tuple[str, Fence]] = collections.deque()
        """Layers handed over this step whose fence has not passed yet (CUDA), in stream order."""
        self._reg_seq = 0  # registrations so far (PUSH_REG, side channel thread)
        self._joined_seq = 0  # ... when the engine thread last took them

    # The writer's primitives (pusher.PushWriter).
    def _introduced(self, request: wire.Push | wire.PushReg) -> Decode | wire.PushReply:
        raise NotImplementedError

    def _plan(self, remote_ids: list[list[int]], local_ids: list[list[int]], remote_heads: wire.HeadsWire | None,
              local_heads: wire.HeadsWire | None, decode: Decode, lease_blocks: tuple[tuple[int, ...], ...]
              ) -> Planned:
        raise NotImplementedError

    def _tables(self, decode: Decode, remote_heads: wire.HeadsWire | None, local_heads: wire.HeadsWire | None
                ) -> tuple[tuple[SlotTable, PreparedList], tuple[SlotTable, PreparedList]]:
        raise NotImplementedError

    def _write(self, entry: PushEntry, planned: Planned, decode: str) -> None:
        raise NotImplementedError

    def _resolve(self, entry: PushEntry, xfer: TransferHandle | None, error: str | None) -> None:
        raise NotImplementedError

    def _answer(self, entry: PushEntry) -> wire.PushReply:
        raise NotImplementedError

    def _remember(self, token: bytes, entry: PushEntry) -> None:
        raise NotImplementedError

    def _record(self, entry: PushEntry) -> None:
        raise NotImplementedError

    # --- PUSH_REG -----------------------------------------------------------------------------------

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
        ids, num_blocks = request.local_block_ids[0], found.geometry.num_blocks
        if ids and max(ids) >= num_blocks:  # (the schema keeps them >= 0) checked before any layer is written:
            # a layer's writes go out as the prefill runs, long before the seal
            # plans the whole push, and an id past a row is another layer's block
            bad = [b for b in ids if b >= num_blocks][:8]
            return wire.PushReply(REFUSED, f"decode block ids {bad} are outside [0, {num_blocks}) of the KV cache "
                                           f"{describe(found.key)} introduced (registration {request.registration})")
        now = self._clock()
        entry = PushEntry(None, WAITING, token=token, reg=request, wait_until=now + self._wait_s, started_at=now)
        with self._lock:
            taken = self._take_transfer_id(request)
            if taken is not None:
                self._counts.add("refused")
                return wire.PushReply(REFUSED, taken)
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

    def _take_transfer_id(self, request: wire.PushReg) -> str | None:
        """Under the lock: record ``request`` as its reader's registration
        under its transfer id; why not when the id is another engine's (or
        the same engine's with another reader count), the reader is another
        decode worker's, or the reader's registration is still waiting or
        running. The first registration under a transfer id owns it, and
        each reader is the worker's (engine, rank, incarnation) that first
        registered it: the claim on the prefill's lease comes from the
        transfer id alone, and every registration under it used to be
        written (a second engine that learnt the id got the prefill's KV:
        found by an adversarial review; a worker that only claimed the
        owner's engine id is another worker). The same worker may register
        its reader again once its registration resolved (a decode leg the
        client hung up on, retried on the same engine); a router retrying
        the decode leg on another engine gets REFUSED, and that decode
        computes the prompt itself. An owner is forgotten only once none of
        its registrations waits or runs."""
        tid = request.transfer_id
        owner = self._reg_owners.get(tid)
        if owner is None:
            owner = self._reg_owners[tid] = (request.engine_id, request.readers, {})
            while len(self._reg_owners) > MAX_REMEMBERED:
                oldest = next(iter(self._reg_owners.values()))
                if any(self._under_way(token) for _, token in oldest[2].values()):
                    break  # (as _remember: bounded by the registrations under way, each within wait_s)
                self._reg_owners.popitem(last=False)
        engine_id, readers, slots = owner
        if engine_id != request.engine_id or readers != request.readers:
            return (f"transfer id {tid!r} is registered by decode engine {engine_id[:64]!r} with {readers} "
                    f"reader(s); a transfer id serves one decode engine: nothing is written for this one")
        worker = decode_key(request)
        slot = slots.get(request.reader)
        if slot is not None and slot[0] != worker:
            return (f"decode reader {request.reader} of {readers} under transfer id {tid!r} was registered by "
                    f"another worker than {describe(worker)}: nothing is written for this one")
        if slot is not None and self._under_way(slot[1]):
            return (f"decode reader {request.reader} of {readers} has a registration under transfer id {tid!r} "
                    "under way (another token): one at a time per reader; nothing is written for this one")
        slots[request.reader] = (worker, request.token)
        return None

    def _under_way(self, token: bytes) -> bool:
        entry = self._pushes.get(token)
        return entry is not None and entry.state in (WAITING, RUNNING)

    def granted(self, send: SendSpec) -> None:
        """The prefill under ``send.transfer_id`` finished and its lease was
        granted (producer worker, step metadata): write every registration
        waiting for it; later ones are written when they come."""
        assert send.transfer_id is not None
        # Registrations past their wait first: their WAITING answer bounded the decode's wait
        # by it (plus the write timeout), and a decode that cannot reach this side channel
        # hands its blocks back then; nothing of theirs may be posted after it.
        self.reap()
        with self._lock:
            self._granted[send.transfer_id] = Granted(send, self._clock())
            while len(self._granted) > MAX_REMEMBERED:
                self._granted.popitem(last=False)
            tokens = self._waiting.pop(send.transfer_id, [])
            entries = [self._pushes[t] for t in tokens if t in self._pushes]
        for entry in entries:
            self._start_registered(entry, send)

    def _start_registered(self, entry: PushEntry, send: SendSpec) -> None:
        """Pin ``send``'s lease for ``entry``'s decode rank and write."""
        reg = entry.reg
        assert reg is not None
        with self._lock:
            if entry.state is not WAITING or entry.aborted or entry.expired or entry.finishing:
                # Aborted or expired meanwhile; one with layer-wise writes is still
                # WAITING while its flush is on the wire, and that flush answers it
                # (taken here, its whole write went out after the answer: a review).
                return
            decode = self._introduced_as(reg)
            entry.state = RUNNING  # taken: no second start
            entry.decode = entry.decode or decode
        problem, other_prompt = None, False
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
        elif reg.prompt_digest != send.prompt_digest:
            other_prompt = True
            problem = (f"the prefill under transfer id {reg.transfer_id!r} computed another prompt than the "
                       f"decode's (prompt digest {send.prompt_digest.hex()} vs {reg.prompt_digest.hex() or 'none'}, "
                       f"{reg.num_tokens} tokens each): a router must send both legs the same prompt under a "
                       "transfer id of their own; the decode computes its prompt itself")
        elif first + len(local) > len(ids):
            problem = f"the decode registered {len(local)} blocks from block {first}; the prefill holds {len(ids)}"
        call = LeaseCall(send.lease, claim(reg.transfer_id), reg.reader, reg.readers)
        if problem is None:
            status, lease_blocks = self._leases.pin_for_push(call)
            if status is not wire.LeaseStatus.HELD:
                problem = f"the prefill's lease is {status.name}"
        if other_prompt:
            # No decode of this prefill's prompt registered under its id (the
            # transfer id serves one decode engine): its lease would only wait
            # for its expiry, holding the blocks.
            self._leases.release([call])
        if problem is not None and (entry.written_upto >= 0 or entry.outstanding):
            # Layer-wise writes of it went out: nothing is answered before
            # they are flushed (FAILED then). Answered REFUSED at once, the
            # decode handed its blocks back with those writes on the wire.
            with self._lock:
                entry.error = entry.error or problem
            self._finish_layerwise(entry)
            return
        if problem is not None:
            with self._lock:
                entry.state, entry.detail, entry.resolved_at = REFUSED, problem, self._clock()
                self._counts.add("refused")
                self._record(entry)
            return
        with self._lock:
            # The decode's abort and the last layer batch may have resolved it while
            # the lease was pinned (its resolution saw no lease to unpin): the pin is ours.
            ended = entry.state is not RUNNING or entry.finishing
            if not ended:
                entry.call = call
        if ended:
            self._leases.unpin(send.lease.generation)
            self._leases.release([call])
            return
        done = max(entry.written_upto, first)  # blocks the layer-wise writes covered
        if done > first and tuple(ids[first:done]) != tuple(entry.producer_blocks[first:done]):
            entry.error = "the prefill's blocks changed under its layer-wise writes (preempted)"
        assert decode is not None  # else a problem above
        try:
            planned = self._plan([list(ids[done:first + len(local)])], [local[done - first:]], reg.remote_heads,
                                 reg.local_heads, decode, lease_blocks)
        except ValueError as exc:
            if entry.written_upto < 0 and not entry.outstanding:  # nothing was posted: nothing can land
                # (not ``done == first``: layer batches may have gone out whose step never
                # counted every layer; those are flushed, FAILED, below)
                self._leases.unpin(send.lease.generation)
                with self._lock:
                    entry.state, entry.detail, entry.resolved_at = REFUSED, str(exc), self._clock()
                    self._counts.add("refused")
                    self._record(entry)
                return
            entry.error = str(exc)
            planned = None
        with self._lock:
            whole = done == first and entry.outstanding == 0 and planned is not None and not entry.finishing
            if whole:
                entry.finishing = True  # its write notifies: nothing is posted or flushed after it
        if whole:
            assert planned is not None
            self._write(entry, planned, decode.name)  # every block at once, notified after its flush
            return
        # Layer-wise writes went out: write the rest, then a flush that notifies (_finish_layerwise).
        if planned is not None and len(planned[0]) and entry.error is None:
            self._post_layer(entry, planned, decode)
        with self._lock:
            entry.sealing = True
        self._finish_layerwise(entry)

    # --- layer-wise writes (engine thread) ------------------------------------------------------------

    def begin_step(self, specs: Sequence[LayerPushSpec]) -> None:
        """This step's prefill chunks under a transfer id: every layer's blocks
        complete by the chunk's end go to the decodes registered for them, as
        each layer is stored (:meth:`write_layer`). A decode that registers
        while the step runs joins at the next layer stored."""
        self._clear_step()
        self._step = tuple(specs) if self.layerwise and self._block_size else ()
        if self._step:
            self._join()

    def _clear_step(self) -> None:
        """No step under way: its entries, stored and fenced layers dropped."""
        self._active, self._stored, self._step = [], [], ()
        self._fenced.clear()

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
                            reg.remote_heads is not None or reg.prompt_digest != spec.prompt_digest:
                        continue  # (another prompt's registration: refused at the grant, none of it written)
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
        """The engine handed over ``layer_name`` for this step: post its rows
        of the blocks complete so far (no notification: the seal flushes).
        On CUDA, once its fence passed: here the layers whose fences have."""
        if not self._step:
            return
        if self._fences is None:
            self._layer_stored(layer_name, overlapped=True)
            return
        self._fenced.append((layer_name, self._fences()))
        while self._fenced and self._fenced[0][1].query():  # stream order: the first not passed stops it
            self._layer_stored(self._fenced.popleft()[0], overlapped=True)

    def _layer_stored(self, layer_name: str, overlapped: bool) -> None:
        """``layer_name``'s KV is in memory: post it to this step's entries."""
        self._stored.append(layer_name)
        joined = len(self._active)
        if self._reg_seq != self._joined_seq:  # a decode registered during the step (read without the lock:
            joined = self._join()              # one missed here is taken at the next layer, or at the end)
        for i, (entry, spec, lo, hi, posted) in enumerate(self._active):
            # One that joined now also gets the layers stored before it came.
            names = [layer_name] if i < joined else self._stored
            self._post_rows(entry, spec, lo, hi, posted, names, overlapped=overlapped)

    def end_step(self) -> None:
        """The step's forward pass ended: every layer of it is in the (host)
        KV cache. Entries that joined late, or whose layers the engine did
        not all hand to ``save_kv_layer`` (vLLM skips it where a layer has
        no attention metadata), get their missing layers now; a chunk's
        blocks count as written only once every layer of them was posted.
        (Counting them written anyway sent a decode blocks never written:
        completions differed from a plain engine's, silently.) On CUDA, with
        writes to make, it first waits for the forward pass (one fence
        behind it), then posts the layers whose fences had not passed; a
        step with none waits for nothing."""
        if self._step and self._reg_seq != self._joined_seq:
            self._join()
        if self._active and self._fences is not None:
            self._fence_step(self._fences)
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
        self._clear_step()

    def _fence_step(self, fences: FenceFactory) -> None:
        """Wait for the step's forward pass, then post the layers still
        behind their fences (no longer overlapping it). If the stream cannot
        be waited for, this step's entries fail (their decodes recompute),
        nothing more of the step is posted, and the error is raised."""
        try:
            fences().synchronize()
        except Exception as exc:
            failed = [a[0] for a in self._active]
            with self._lock:
                for entry in failed:
                    entry.error = entry.error or f"waiting for the forward pass's stream failed: {exc}"
            self._clear_step()
            for entry in failed:
                self._finish_layerwise(entry)
            raise
        while self._fenced:
            self._layer_stored(self._fenced.popleft()[0], overlapped=False)

    def _post_rows(self, entry: PushEntry, spec: LayerPushSpec, lo: int, hi: int, posted: set[int],
                   layer_names: Sequence[str], overlapped: bool) -> bool:
        """Post ``layer_names``' rows of the chunk's blocks ``[lo, hi)`` to
        ``entry``'s decode (one batch); the layers go into ``posted``."""
        reg = entry.reg
        assert reg is not None
        with self._lock:
            decode = self._introduced_as(reg)
            if decode is None or entry.state is not WAITING or entry.aborted or entry.expired or entry.error or \
                    self._clock() >= entry.wait_until:  # past the bound its answer gave (the next reap expires it)
                return False
        try:
            own, dst = self._tables(decode, None, None)
            layers = [own[0].layer_index[name] for name in layer_names]
            rows = np.flatnonzero(np.isin(own[0].row_layer, layers))
            first = reg.first_token // self._block_size
            mine = np.asarray(spec.block_ids[lo:hi], dtype=np.int64)
            theirs = np.asarray(reg.local_block_ids[0][lo - first:hi - first], dtype=np.int64)
            own[0].check_ids(mine, "local")  # (DescriptorError: a ValueError)
            dst[0].check_ids(theirs, "remote")
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

    # --- posting, completion, the seal's flush -----------------------------------------------------------

    def _post_layer(self, entry: PushEntry, planned: Planned,
                    decode: Decode, overlapped: bool = False) -> bool:
        src, dst, own_prep, dst_prep = planned
        with self._lock:
            if entry.finishing or entry.state not in (WAITING, RUNNING):
                # Its last flush is posted (aborted, expired, failed: the
                # answer follows that flush) or it resolved: nothing may be
                # posted after it. Checked with the count taken, so the two
                # cannot interleave (a decode's abort used to be answered
                # between the check above and this post, and the post landed).
                return False
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

    def _layer_done(self, entry: PushEntry, xfer: TransferHandle, overlapped: bool) -> None:
        with self._lock:
            entry.outstanding -= 1
            if xfer.error is not None:
                entry.error = entry.error or f"layer writes failed: {xfer.error}"
            entry.nbytes += xfer.nbytes if xfer.error is None else 0
            if overlapped and xfer.error is None:
                entry.overlapped_nbytes += xfer.nbytes
        self._finish_layerwise(entry)

    def _finish_layerwise(self, entry: PushEntry) -> None:
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
            decode = self._introduced_as(reg)
        notify = PUSH_NOTIFY_PREFIX + entry.token if not ended else None
        try:
            if decode is None:
                raise RuntimeError("the decode forgot its KV cache")
            flush = self._transport.flush(decode.name, notify=notify, timeout_s=self._write_timeout_s)
        except Exception as exc:
            self._resolve(entry, None, entry.error or f"flushing the layer writes failed: {exc}")
            return
        flush.add_done_callback(lambda x: self._resolve(entry, x, entry.error))

    # --- registrations no prefill matched ---------------------------------------------------------------

    def reap(self) -> None:
        """Registrations whose prefill did not finish within ``wait_s``: REFUSED
        (the decode's load fails and it recomputes); nothing was posted."""
        now = self._clock()
        expired_written: list[PushEntry] = []
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
