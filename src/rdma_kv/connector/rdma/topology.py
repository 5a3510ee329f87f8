"""Which producer ranks hold the KV heads a consumer rank owns.

Owns the mapping between two tensor-parallel engines of one model that may
run at different TP sizes (prefill TP=2 feeding decode TP=1, or TP=1
feeding TP=2, ...). It is computed from four numbers both sides know before
they speak: the two TP sizes, the model's number of KV heads and whether
the cache is MLA. The handshake then checks that the producer rank really
holds the heads the plan expects.

How an engine shards KV heads (vLLM's rule): with ``H`` KV heads and TP
size ``T``, rank ``r`` owns heads ``[r*H/T, (r+1)*H/T)`` when ``T <= H``;
when ``T > H`` every head is replicated on ``T/H`` consecutive ranks and
rank ``r`` owns head ``r*H//T``. One of ``H`` and ``T`` must divide the
other. An MLA cache is not split by head: every rank holds all of it.

The plan is one for every KV-cache group, so between different TP sizes
every group must shard the model's ``H`` heads: a hybrid model whose
sliding-window layers have KV heads of their own (MiMo-V2's
``swa_num_key_value_heads``) would have those read from the wrong ranks.
The consumer's groups' heads per rank are checked against ``H``; where a
rank of the smaller TP size holds a single head, a group of fewer heads
(replicated) looks the same, and a hybrid model is refused there.

The plan for consumer rank ``d``:

- **reads**: for each run of its heads that one producer rank holds, one
  :class:`Read` (that producer rank, and where the run starts on each side).
  A head replicated on several producer ranks is read once, from the
  replica ``d mod replicas`` (spreading consumer ranks over the replicas).
  An MLA cache is one whole-block read from producer rank ``d mod P``.
- **callers**: every producer rank is told by each consumer rank that reads
  it (RENEW, CONFIRM, RELEASE as reader ``d``), and counts those readers
  before it hands the blocks back. A producer rank no consumer rank reads
  (its heads are replicas read elsewhere) is released by consumer rank
  ``p mod D`` alone, so its blocks go back at once instead of at lease
  expiry (once a handshake confirmed the producer's TP size: the
  consumer's ``lease_rpc``).

Pure functions of plain integers; imports the standard library and
``rdma_kv.errors``.
"""

from __future__ import annotations

import dataclasses
import functools

from rdma_kv.errors import ConfigError

__all__ = ["RankPlan", "Read", "heads_of", "plan_ranks"]


@dataclasses.dataclass(frozen=True)
class Read:
    """Heads ``[local_first, local_first + count)`` of this consumer rank's
    block come from heads ``[remote_first, remote_first + count)`` of
    producer rank ``rank``'s block (indices within each rank's own heads)."""

    rank: int
    local_first: int
    remote_first: int
    count: int


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What consumer rank ``consumer_rank`` reads, and whom it calls."""

    consumer_rank: int
    local_heads: int
    """KV heads per consumer rank (1 for MLA)."""
    remote_heads: int
    """KV heads per producer rank (1 for MLA)."""
    reads: tuple[Read, ...]
    readers: dict[int, int]
    """Producer rank -> how many consumer ranks call it for each lease, for
    every producer rank this consumer rank calls (reads or only releases)."""

    def whole(self, read: Read) -> bool:
        """``read`` moves whole blocks on both sides (no head slicing)."""
        return read.count == self.local_heads == self.remote_heads

    @property
    def release_only(self) -> tuple[int, ...]:
        """Producer ranks this consumer rank releases without reading."""
        read = {r.rank for r in self.reads}
        return tuple(p for p in self.readers if p not in read)


def _check(tp_size: int, num_heads: int, side: str) -> None:
    if tp_size < 1:
        raise ConfigError(f"{side} tp_size {tp_size} must be at least 1")
    if num_heads % tp_size and tp_size % num_heads:
        raise ConfigError(f"{side} tp_size {tp_size} and the model's {num_heads} KV heads: one "
                          "must divide the other for tensor parallelism to shard the KV heads")


def heads_of(rank: int, tp_size: int, num_heads: int) -> range:
    """The model's KV heads that ``rank`` of a TP-``tp_size`` engine holds."""
    if tp_size <= num_heads:
        per = num_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_heads // tp_size
    return range(head, head + 1)


def _reads(d: int, consumer_tp: int, producer_tp: int, num_heads: int, mla: bool) -> tuple[Read, ...]:
    if mla:
        return (Read(d % producer_tp, 0, 0, 1),)
    mine = heads_of(d, consumer_tp, num_heads)
    replicas = max(1, producer_tp // num_heads)
    reads: list[Read] = []
    for h in mine:
        if producer_tp <= num_heads:
            p = h // (num_heads // producer_tp)
        else:
            p = h * replicas + d % replicas
        last = reads[-1] if reads else None
        if last is not None and last.rank == p:
            reads[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            reads.append(Read(p, h - mine.start, h - heads_of(p, producer_tp, num_heads).start, 1))
    return tuple(reads)


def _check_groups(group_heads: tuple[int, ...], consumer_tp: int, producer_tp: int, num_heads: int) -> None:
    """Between different TP sizes, every KV-cache group must hold the heads
    the plan gives a consumer rank, and be known to shard the same heads."""
    per = max(1, num_heads // consumer_tp)
    for g, heads in enumerate(group_heads):
        if heads != per:
            raise ConfigError(
                f"KV-cache group {g} holds {heads} KV heads per rank, but the model's {num_heads} KV heads "
                f"give {per} at tp_size {consumer_tp}: its layers have KV heads of their own, and one rank "
                f"plan cannot serve them; run prefill and decode at equal tensor-parallel sizes")
    if len(group_heads) > 1 and num_heads < 2 * min(consumer_tp, producer_tp):
        raise ConfigError(
            f"tp_size {min(consumer_tp, producer_tp)} leaves one of the model's {num_heads} KV heads per rank, "
            f"so it cannot be checked that each of the {len(group_heads)} KV-cache groups shards those heads "
            "(a group with fewer KV heads of its own is replicated over other ranks, and would be read from "
            "the wrong ones); a hybrid model is moved between these TP sizes only when they are equal")


@functools.lru_cache(maxsize=256)
def plan_ranks(consumer_rank: int, consumer_tp: int, producer_tp: int, num_heads: int,
               mla: bool = False, group_heads: tuple[int, ...] = ()) -> RankPlan:
    """The reads and calls of ``consumer_rank``. Raises :class:`ConfigError`
    when a TP size cannot shard ``num_heads`` KV heads, or (TP sizes
    differing) when the consumer's KV-cache groups, holding ``group_heads``
    KV heads per rank, may not all shard them (module doc)."""
    if num_heads < 1:
        raise ConfigError(f"the model has {num_heads} KV heads; at least 1 is needed")
    if not 0 <= consumer_rank < consumer_tp:
        raise ConfigError(f"consumer rank {consumer_rank} is outside tp_size {consumer_tp}")
    if not mla:
        _check(consumer_tp, num_heads, "consumer")
        _check(producer_tp, num_heads, "producer")
        if consumer_tp != producer_tp:  # (equal sizes: rank r reads rank r's whole blocks)
            _check_groups(group_heads, consumer_tp, producer_tp, num_heads)
    elif producer_tp < 1:
        raise ConfigError(f"producer tp_size {producer_tp} must be at least 1")
    every = [_reads(d, consumer_tp, producer_tp, num_heads, mla) for d in range(consumer_tp)]
    callers: dict[int, set[int]] = {p: set() for p in range(producer_tp)}
    for d, reads in enumerate(every):
        for read in reads:
            callers[read.rank].add(d)
    for p, who in callers.items():
        if not who:
            who.add(p % consumer_tp)
    per_rank = (lambda tp: 1) if mla else (lambda tp: max(1, num_heads // tp))
    return RankPlan(
        consumer_rank=consumer_rank,
        local_heads=per_rank(consumer_tp),
        remote_heads=per_rank(producer_tp),
        reads=every[consumer_rank],
        readers={p: len(who) for p, who in sorted(callers.items()) if consumer_rank in who},
    )
