"""Per-request transfer records of a worker's consumer part, the event
counters of each part, and the worker's stats summary for ``get_kv_connector_stats``.

Owns the typed records and the one way to combine them:

- :class:`LoadMeasures`: what a load measures while it runs (replaced
  stage by stage by ``consumer.RdmaConsumer`` under its lock).
- :class:`LoadRecord`: one finished load, its measures and outcome: bytes read, bytes a
  sliding window spared (``nbytes_skipped``), descriptors, ops
  posted, contiguous block runs, handshake / plan / post / transfer /
  confirm / total seconds, outcome. A field is None when the load never
  reached the stage that measures it (a load that failed in its handshake
  has no ``nbytes``). Three of them cut a load's whole life end to end:
  ``start_s`` (the step's metadata bound -> the first read posted),
  ``transfer_s`` (posted -> completed) and ``finish_s`` (the last read
  completed -> ``get_finished`` reported it, the CONFIRM round trip
  included); their sum is at most ``total_s``.
- :class:`Counters`: one owner's event counters, a frozen record with one
  field per event: :class:`ConsumerCounters` (handshakes, lease RPCs,
  failed and aborted loads) and :class:`LeaseCounters` (the producer's
  lease table). An owner counts into a :class:`Tally` of its kind.
- :class:`PushRecord`: one push a producer resolved (mode push): bytes
  written, how many of them while the prefill's forward pass still ran
  (layer-wise writes), outcome.
- :class:`Totals`: record sums, and each owner's counters as a field.
- :class:`WorkerStats`: one worker's summary since the last collection:
  the records, the totals, leases held and the resources the worker holds.

:func:`merge` combines several summaries (TP ranks, or vLLM's
aggregation) and keeps at most :data:`MAX_RECORDS` records. A dict
appears only at the boundary, where counters are flattened into their
names (``leases_granted``...): :meth:`WorkerStats.to_dict` is what
``get_kv_connector_stats()`` returns (and vLLM carries as
``KVConnectorStats.data``); ``rdma.statsparse`` parses it back, strictly.

:class:`LoadStats` is the consumer's accumulator. Not thread-safe:
the consumer calls it under its lock.

Imports the standard library only.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["GAUGE_REFRESH_S", "GAUGE_STALE_S", "MAX_RECORDS", "MEASURES", "TOTAL_NUMBERS", "ConsumerCounters",
           "Counters", "LeaseCounters", "LoadMeasures", "LoadRecord", "LoadStats", "PushCounters", "PushRecord", "Tally",
           "Totals", "WorkerStats", "held_by_rank", "merge"]

MAX_RECORDS = 10_000
"""Per-request records kept until collected, and across merges; beyond it
the oldest are dropped (the totals still count them)."""

GAUGE_REFRESH_S = 10.0
"""A worker whose gauges did not move reports them again this often, while
its engine steps (``RdmaWorker.stats``)."""
GAUGE_STALE_S = 6 * GAUGE_REFRESH_S
"""Where the gauges are exported, a rank that has not reported for this
long while another rank of its engine reported is forgotten (an engine
restarted with fewer ranks, or a rank that died): its last value no longer
counts. An engine none of whose ranks reports (idle: it does not step)
keeps every rank's last value."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadMeasures:
    """What a load has measured (None: the load has not reached the stage
    that measures it). Frozen: the consumer replaces ``LoadState.measures``
    under its lock (``add``, ``at_least``, ``with_``), so that sources
    completing on different threads cannot lose each other's counts."""

    handshake_s: float | None = None
    num_blocks: int | None = None
    block_runs: int | None = None
    plan_s: float | None = None
    """The connector's planning of a read: slot tables and index math, up to
    the transport's post call (summed over the load's sources)."""
    post_s: float | None = None
    nbytes: int | None = None
    num_descs: int | None = None
    ops_posted: int | None = None
    transfer_s: float | None = None
    confirm_s: float | None = None
    nbytes_skipped: int | None = None
    """Bytes of the prompt's KV not read because a sliding window excludes
    them (hybrid models); 0 when every layer attends to the whole prompt."""
    start_s: float | None = None
    """From the worker binding the step's metadata that carries the load to
    its first ``read_prepared`` call (the engine's forward pass when it runs
    between the two, the handshake if one was needed, ``plan_s``)."""
    finish_s: float | None = None
    """From the load's last read completing to ``get_finished`` reporting it:
    the completion callback's wake-up, ``confirm_s``, and the wait for the
    engine's next ``get_finished``."""

    def add(self, **values: float) -> LoadMeasures:
        """These measures with the named ones summed into (counts and costs
        of a load's sources)."""
        return self._evolve({name: (getattr(self, name) or 0) + value for name, value in values.items()})

    def at_least(self, **values: float) -> LoadMeasures:
        """These measures keeping the largest value of each named one (times
        of sources that run side by side)."""
        return self._evolve({name: value if getattr(self, name) is None else max(getattr(self, name), value)
                             for name, value in values.items()})

    def with_(self, **values: float) -> LoadMeasures:
        """These measures with the named ones set."""
        return self._evolve(values)

    def _evolve(self, changes: dict[str, Any]) -> LoadMeasures:
        """``dataclasses.replace(self, **changes)`` for these measures only
        (never a subclass: ``LoadRecord`` is made once, by ``of``), without
        its walk of every field's metadata: a load replaces its measures
        about six times, on the engine's thread and in completion callbacks,
        and ``replace`` cost 3.4 us a time warm, 1.9 this way."""
        if type(self) is not LoadMeasures or not changes.keys() <= _MEASURE_SET:
            return dataclasses.replace(self, **changes)  # (its TypeError names a wrong field)
        new = object.__new__(LoadMeasures)
        for name in MEASURES:
            _set(new, name, changes[name] if name in changes else getattr(self, name))
        return new

    def measured(self) -> dict[str, Any]:
        """The measures taken so far, by name."""
        return {name: getattr(self, name) for name in MEASURES if getattr(self, name) is not None}


MEASURES = tuple(f.name for f in dataclasses.fields(LoadMeasures))
"""The names of a load's measures."""
_MEASURE_SET = frozenset(MEASURES)
_set = object.__setattr__  # (a frozen dataclass sets its fields so in __init__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LoadRecord(LoadMeasures):
    """One finished load: its measures and its outcome."""

    request_id: str
    ok: bool
    total_s: float
    """From the worker binding the step's metadata that carries the load to
    ``get_finished`` reporting it."""
    error: str | None = None

    @classmethod
    def of(cls, request_id: str, measures: LoadMeasures, *, ok: bool, total_s: float,
           error: str | None) -> LoadRecord:
        return cls(request_id=request_id, ok=ok, total_s=total_s, error=error or None, **measures.measured())

    def to_dict(self) -> dict[str, Any]:
        """The boundary form: only the fields the load measured."""
        out = self.measured()
        out.update(request_id=self.request_id, ok=self.ok, total_s=self.total_s)
        if self.error:
            out["error"] = self.error
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PushRecord:
    """One push a producer rank resolved (``pusher``): the request whose
    lease it wrote from, the outcome (``done``, ``failed``, ``aborted``,
    ``refused``), the bytes written, and of them the bytes written by layer
    writes posted while the prefill's forward pass ran: what overlapped
    the prefill (concurrent dispatch, layer-wise; 0 otherwise)."""

    request_id: str
    outcome: str
    nbytes: int = 0
    overlapped_nbytes: int = 0
    total_s: float = 0.0
    """From the decode's PUSH or registration to the push resolving."""

    @property
    def overlap(self) -> float | None:
        """The share of the bytes written that overlapped the prefill; None when nothing was written."""
        return self.overlapped_nbytes / self.nbytes if self.nbytes else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

C = TypeVar("C", bound="Counters")


@dataclasses.dataclass(frozen=True, slots=True)
class Counters:
    """Event counters of one owner, one field each: summed and subtracted
    field by field, flattened into ``{prefix + name: count}`` (non-zero
    counts only) at the edge (``statsparse.parse_counters`` reads that form back)."""

    PREFIX: ClassVar[str] = ""
    """Put before each field's name in the flat form (``get_kv_connector_stats``,
    the ``event`` label of ``rdma_kv_events_total``)."""

    def _values(self) -> list[int]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def __add__(self: C, other: C) -> C:
        return type(self)(*(a + b for a, b in zip(self._values(), other._values())))

    def __sub__(self: C, other: C) -> C:
        return type(self)(*(a - b for a, b in zip(self._values(), other._values())))

    def __bool__(self) -> bool:
        return any(self._values())

    def counts(self) -> dict[str, int]:
        """The non-zero counts by field name."""
        return {f.name: v for f, v in zip(dataclasses.fields(self), self._values()) if v}

    def flat(self) -> dict[str, int]:
        """The non-zero counts by their flat names."""
        return {self.PREFIX + name: v for name, v in self.counts().items()}

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every flat name of this kind of counters."""
        return frozenset(cls.PREFIX + f.name for f in dataclasses.fields(cls))


class Tally(Generic[C]):
    """What an owner counts into, read as its frozen counters. Counting is
    a dict increment (the lease table counts every lease of every call);
    a name that is not a field of the counters is a ``KeyError``. Not
    thread-safe: its owner counts under its own lock."""

    __slots__ = ("_kind", "_counts", "_taken")

    def __init__(self, kind: type[C]) -> None:
        self._kind = kind
        self._counts = {f.name: 0 for f in dataclasses.fields(kind)}
        self._taken = kind()

    def add(self, name: str, n: int = 1) -> None:
        self._counts[name] += n

    def snapshot(self) -> C:
        """Everything counted so far."""
        return self._kind(**self._counts)

    def take(self) -> C:
        """What was counted since the last :meth:`take`."""
        now = self.snapshot()
        since, self._taken = now - self._taken, now
        return since


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerCounters(Counters):
    """A worker's consumer part (``consumer``, ``peers``, ``lease_rpc``)."""

    handshakes: int = 0
    preconnects: int = 0
    """Handshakes started before a load, from the scheduler's ``connects``."""
    peers_forgotten: int = 0
    """Producer ranks forgotten once no load had used them for the client
    pool's ``idle_s`` (their endpoint and keys removed; a later load
    handshakes again)."""
    registration_checks: int = 0
    """Handshakes asked because a load's params named a newer registration
    of a READY producer rank than its connection's (the producer slept and
    woke, or the params are made up)."""
    loads_failed: int = 0
    loads_aborted: int = 0
    renew_rpcs: int = 0
    """RENEW calls answered (whatever the answer)."""
    release_rpcs: int = 0
    pin_rpcs: int = 0
    """PIN calls (a RENEW with ``pin``, sent as a source's reads are posted) answered."""
    pin_trusted: int = 0
    """Sources whose reads landed within their pin: trusted without a CONFIRM."""
    pin_fallbacks: int = 0
    """Sources CONFIRMed although pinned: the pin was not granted (PENDING,
    the call failed) or the reads landed after it ended."""
    words_trusted: int = 0
    """Sources whose held words, read after their data, all named their
    lease (``heldwords``): trusted without a PIN or a CONFIRM."""
    words_fallbacks: int = 0
    """Sources CONFIRMed although their producer publishes held words: a
    word named no lease or another (not granted yet, ended, a block shared
    by two leases, edited params) or the words could not be read."""
    confirms_unanswered: int = 0
    """CONFIRM calls a producer did not answer in time (stalled, or starved
    of CPU): made again ``confirms.CONFIRM_RETRY_S`` later, until the
    load's deadline."""
    handshakes_unanswered: int = 0
    """HANDSHAKE calls a producer that answered before did not answer in
    time (stalled, or starved of CPU): its loads wait, and it is dialled
    again ``peers.PEER_RETRY_S`` later, until their deadline."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseCounters(Counters):
    """A producer's lease table (``leases``): what happened to its leases.
    The ways a lease ends are ``leases.Ending``'s values."""

    PREFIX: ClassVar[str] = "leases_"

    granted: int = 0
    released_early: int = 0
    """Released by every reader before its grant reached the table."""
    renewed: int = 0
    pinned: int = 0
    """Leases a consumer's PIN (a RENEW with ``pin``) pinned for its reads."""
    reclaim_after_pin: int = 0
    """Leases the scheduler reclaimed while a read pin held them: each ends
    (``reclaimed``) when its pin does, unless released first."""
    confirmed: int = 0
    refused_confirm: int = 0
    reader_released: int = 0
    """One reader of a lease released it (the lease ends with the last)."""
    refused_forged: int = 0
    refused_unknown: int = 0
    unverified: int = 0
    """Leases answered PENDING unverified: their call had already presented
    ``leases.WRONG_TOKENS_PER_CALL`` tokens that do not verify."""
    refused_claimed: int = 0
    refused_readers: int = 0
    """A call under the owner's claim with another reader count."""
    released: int = 0
    expired: int = 0
    expired_unclaimed: int = 0
    """Of ``expired``: leases no consumer had claimed (no RENEW, CONFIRM or
    RELEASE named them): the decode did not reach them within the TTL, as
    opposed to a claimed lease whose renewals stopped arriving."""
    lifetime: int = 0
    reclaimed: int = 0
    epoch: int = 0
    sleep: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class PushCounters(Counters):
    """Push mode: the producer's writer (``pusher``) and the decode's pushes
    (``consumer/pushes``). Zero in pull mode."""

    PREFIX: ClassVar[str] = "push_"

    hellos: int = 0
    """Decode ranks that introduced their KV cache (producer)."""
    decodes_forgotten: int = 0
    """Decode ranks forgotten to make room for a new one (``MAX_DECODES`` known at once; producer)."""
    done: int = 0
    """Pushes whose writes all completed remotely, notification sent (producer)."""
    failed: int = 0
    aborted: int = 0
    refused: int = 0
    """PUSH answered REFUSED: nothing written (a lease refusal, blocks outside the lease, a replay)."""
    abort_asked: int = 0
    aborted_unknown: int = 0
    """Aborts of a push this producer rank had no record of: remembered ABORTED, a late PUSH of it is refused (producer)."""
    registrations: int = 0
    """Concurrent dispatch: decode ranks that registered under a transfer id (producer)."""
    registrations_early: int = 0
    """... of which before their prefill had finished (the legs ran at the same time)."""
    layer_writes: int = 0
    """Write batches of one layer's complete blocks, posted as the layer was stored (producer)."""
    layer_steps: int = 0
    """Prefill chunks whose layers were written as they were stored (producer)."""
    layer_steps_caught_up: int = 0
    """Prefill chunks some layers of which were written only after the forward pass: the decode
    registered during it, or the engine did not hand every layer to ``save_kv_layer``."""
    written_bytes: int = 0
    """Bytes written by pushes that completed (producer)."""
    overlapped_bytes: int = 0
    """... of which written by layer writes posted while the prefill's forward pass ran (producer)."""
    loads_done: int = 0
    """Sources whose push completed (decode)."""
    loads_aborted: int = 0
    """Sources whose push this decode stopped (its request was aborted) (decode)."""
    loads_waiting: int = 0
    """Sources the producer first answered WAITING: registered before their prefill finished (decode)."""
    loads_failed: int = 0
    resent: int = 0
    """PUSHes sent again: the first got no answer and the producer had no record of it (decode)."""
    producer_gone: int = 0
    """Pushes resolved because the producer's side channel refused connections (decode)."""
    unreachable: int = 0
    """Pushes resolved only at their bound, the producer unreachable (decode)."""
    notifications_unmatched: int = 0
    """Notifications of a push the decode no longer waits for (decode)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Totals:
    """Sums over every load recorded (dropped records included) and the
    event counters of each owner. ``to_dict`` flattens them into one mapping.
    A field named as a :class:`LoadMeasures` field sums that measure; the
    others are ``loads_ok`` and the counters."""

    nbytes: int = 0
    num_descs: int = 0
    ops_posted: int = 0
    block_runs: int = 0
    num_blocks: int = 0
    loads_ok: int = 0
    transfer_s: float = 0.0
    nbytes_skipped: int = 0
    """Bytes sliding windows kept from being read (``LoadMeasures.nbytes_skipped``)."""
    consumer: ConsumerCounters = ConsumerCounters()
    leases: LeaseCounters = LeaseCounters()
    push: PushCounters = PushCounters()

    def add_record(self, record: LoadRecord) -> Totals:
        sums: dict[str, Any] = {name: getattr(self, name) + (getattr(record, name) or 0) for name in _SUMS}
        return dataclasses.replace(self, loads_ok=self.loads_ok + record.ok, **sums)

    def __add__(self, other: Totals) -> Totals:
        return Totals(*(getattr(self, f.name) + getattr(other, f.name) for f in _TOTALS_FIELDS))

    def events(self) -> dict[str, int]:
        """Every owner's non-zero counters by their flat names."""
        return {**self.consumer.flat(), **self.leases.flat(), **self.push.flat()}

    def to_dict(self) -> dict[str, Any]:
        return {**{name: getattr(self, name) for name in TOTAL_NUMBERS}, **self.events()}


_TOTALS_FIELDS = dataclasses.fields(Totals)
_SUMS = tuple(f.name for f in _TOTALS_FIELDS if f.name in MEASURES)
"""The measures a record adds to the totals (nbytes, transfer_s...)."""
TOTAL_NUMBERS = (*_SUMS, "loads_ok")
"""The totals that are numbers (the others are counters)."""


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker's (or several merged workers') stats since the last collection."""

    requests: tuple[LoadRecord, ...] = ()
    totals: Totals = Totals()
    leases_held: int = 0
    resources: Mapping[str, int] | None = None
    pushes: tuple[PushRecord, ...] = ()
    """Pushes this producer rank resolved (mode push)."""
    by_rank: Mapping[int, Mapping[str, int]] | None = None
    """The gauges (``leases_held`` and the resources) of each worker this
    summary covers, by its TP rank, as the rank last reported them. A worker
    reports them with every summary it returns; ``leases_held`` and
    ``resources`` are their sums. A gauge is a value now, not a count: a
    merge keeps each rank's latest (the later part's), and whoever exports
    it keeps the last value of every rank, since a rank whose gauges did not
    move returns no stats (:func:`held_by_rank`), or none for
    :data:`GAUGE_REFRESH_S`: a worker reports its gauges at least that often
    while its engine steps, so that a rank gone silent that long while its
    engine's other ranks report is a rank that is gone
    (:data:`GAUGE_STALE_S`)."""
    incarnations: Mapping[int, str] | None = None
    """Of each rank in ``by_rank``, its worker's incarnation (hex): a rank
    reporting another one than before was made again (its engine
    restarted), and the ranks of the engine before that this report does
    not carry are forgotten where the gauges are exported."""

    def to_dict(self) -> dict[str, Any]:
        """``{"requests": [...], "totals": {...}, "leases_held": n[, "resources": {...}][, "pushes": [...]]
        [, "by_rank": {"<tp_rank>": {"leases_held": n, <resource>: n, ...}}]}``:
        what ``get_kv_connector_stats()`` returns and vLLM carries."""
        out: dict[str, Any] = {"requests": [r.to_dict() for r in self.requests],
                               "totals": self.totals.to_dict(), "leases_held": self.leases_held}
        if self.resources is not None:
            out["resources"] = dict(self.resources)
        if self.pushes:
            out["pushes"] = [p.to_dict() for p in self.pushes]
        if self.by_rank is not None:
            out["by_rank"] = {str(rank): dict(held) for rank, held in self.by_rank.items()}
        if self.incarnations is not None:
            out["incarnations"] = {str(rank): incarnation for rank, incarnation in self.incarnations.items()}
        return out

    def carries_gauges(self) -> bool:
        """Whether this summary reports gauges (a worker's always does, even all zero)."""
        return bool(self.by_rank) or self.resources is not None or self.leases_held != 0


def held_by_rank(by_rank: Mapping[int, Mapping[str, int]]) -> tuple[int, dict[str, int]]:
    """Leases held and resources summed over the ranks' gauges (a resource a
    rank does not report counts 0 for it)."""
    resources: collections.Counter[str] = collections.Counter()
    for held in by_rank.values():
        resources.update({name: n for name, n in held.items() if name != "leases_held"})
    return sum(held.get("leases_held", 0) for held in by_rank.values()), dict(resources)


def merge(parts: Iterable[WorkerStats | None]) -> WorkerStats | None:
    """Several summaries as one: records concatenated (each keeps its own
    request id and timings; the newest :data:`MAX_RECORDS` kept), totals
    summed; gauges (:attr:`WorkerStats.by_rank`) kept per rank, the later
    part's for a rank in both (a later interval), and leases held and
    resources their sum over the ranks. None when every part is None."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    records = [r for p in present for r in p.requests]
    totals = Totals()
    resources: collections.Counter[str] | None = None
    leases_held = 0
    by_rank: dict[int, Mapping[str, int]] | None = None
    incarnations: dict[int, str] | None = None
    for p in present:
        totals = totals + p.totals
        if p.incarnations is not None:
            incarnations = {**(incarnations or {}), **p.incarnations}
        if p.by_rank is not None:  # gauges by rank: each rank's latest, summed below
            by_rank = {**(by_rank or {}), **p.by_rank}
            continue
        leases_held += p.leases_held  # a summary without ranks (built by hand): summed as it is
        if p.resources is not None:
            resources = resources or collections.Counter()
            resources.update(p.resources)
    if by_rank is not None:
        held, by_rank_resources = held_by_rank(by_rank)
        leases_held += held
        resources = resources or collections.Counter()
        resources.update(by_rank_resources)
    pushes = [r for p in present for r in p.pushes]
    return WorkerStats(tuple(records[-MAX_RECORDS:]), totals, leases_held,
                       None if resources is None else dict(resources), tuple(pushes[-MAX_RECORDS:]), by_rank,
                       incarnations)


class LoadStats:
    """The consumer's records since the last :meth:`take`."""

    def __init__(self) -> None:
        self.records: collections.deque[LoadRecord] = collections.deque(maxlen=MAX_RECORDS)
        self.totals = Totals()

    def record(self, request_id: str, measures: LoadMeasures, *, ok: bool, total_s: float,
               error: str | None) -> None:
        record = LoadRecord.of(request_id, measures, ok=ok, total_s=total_s, error=error)
        self.records.append(record)
        self.totals = self.totals.add_record(record)

    def take(self) -> tuple[tuple[LoadRecord, ...], Totals]:
        """Hand over what was recorded since the last call, and reset."""
        out = tuple(self.records), self.totals
        self.records.clear()
        self.totals = Totals()
        return out
