"""Where a consumer rank's reads come from, and whom its lease calls go to.

A helper of :class:`~rdma_kv.connector.rdma.consumer.RdmaConsumer`. Owns,
for one consumer rank:

- the **rank plan** for a producer engine (``topology.plan_ranks``, from
  this rank's share, the producer's TP size and the model's KV heads);
- the **slot tables** it reads with, prepared with the transport once per
  head slice: this rank's own (local) and each producer rank's (remote);
  whole blocks when both sides hold the same heads;
- the **lease targets**: a RENEW or RELEASE made for a whole request goes,
  as reader ``tp_rank``, to every producer rank this rank calls, each with
  the number of consumer ranks that call it (so the producer counts its
  readers before it hands the blocks back).

Its table cache has a lock of its own, held while it prepares tables with
the transport: never the consumer's lock, which the transport's completion
callbacks take (holding it here deadlocked a load with two sources).

Imports the standard library, numpy and the connector's ``geometry``, ``rdma.meta``,
``rdma.loads``, ``rdma.planning``, ``rdma.topology``, ``rdma.transport_api``,
``rdma.wire`` and ``rdma_kv.errors``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.loads import LoadState, PeerState, Source
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.planning import HeadSlice, SlotTable
from rdma_kv.connector.rdma.topology import Read, RankPlan, plan_ranks
from rdma_kv.connector.rdma.transport_api import Transport
from rdma_kv.errors import ConfigError, NotInitializedError

__all__ = ["Sources", "Targeted"]

Targeted = tuple[int, RemoteLease]
"""(producer rank, the lease as this reader names it)."""

Table = tuple[SlotTable, Any]  # slot table, and its prepared descriptor list


class Sources:
    """The reading side of one consumer rank, once its KV caches are registered."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        self.tp_rank, self._tp_size = tp_rank, tp_size
        self._transport: Transport | None = None
        self._geometry: KVCacheGeometry | None = None
        self._tables: dict[HeadSlice | None, Table] = {}
        self._tables_lock = threading.Lock()
        self.compat: wire.CompatInfo | None = None
        self.rank: wire.RankInfo | None = None

    def attach(self, transport: Transport, geometry: KVCacheGeometry, slots: SlotTable, local_prep: Any,
               compat: wire.CompatInfo, rank: wire.RankInfo) -> None:
        self._transport, self._geometry, self.compat, self.rank = transport, geometry, compat, rank
        self._tables = {None: (slots, local_prep)}

    def require(self) -> tuple[wire.CompatInfo, wire.RankInfo]:
        if self.compat is None or self.rank is None:
            raise NotInitializedError("the RDMA connector's worker has no KV caches; the engine "
                                      "must call register_kv_caches() at startup")
        return self.compat, self.rank

    def plan(self, address: PeerAddress) -> RankPlan:
        """What this rank reads from the producer at ``address``; raises
        :class:`ConfigError` when the two TP sizes cannot share the model's heads."""
        compat, rank = self.require()
        return plan_ranks(self.tp_rank, rank.tp_size, address.tp_size, max(1, compat.total_kv_heads),
                          compat.kv_layout == "MLA")

    def targets(self, lease: RemoteLease) -> list[Targeted]:
        """Where this rank sends a RENEW or RELEASE made for a whole request."""
        try:
            readers = self.plan(lease.peer).readers
        except (ConfigError, NotInitializedError):
            # No load can run: each producer rank is released by one consumer rank.
            readers = {p: 1 for p in range(lease.peer.tp_size) if p % self._tp_size == self.tp_rank}
        return [(p, dataclasses.replace(lease, reader=self.tp_rank, readers=n)) for p, n in readers.items()]

    def of(self, load: LoadState, src: Source) -> Targeted:
        """The lease call of ``load`` to its source ``src``."""
        return src.read.rank, dataclasses.replace(load.spec.remote_lease, reader=self.tp_rank,
                                                  readers=src.readers)

    def tables(self, plan: RankPlan, read: Read, peer: PeerState) -> tuple[Table, Table]:
        """(local, remote) prepared slot tables for ``read`` from ``peer``;
        raises ``ValueError`` (once, when the remote table is first made)
        if their rows differ in bytes per block."""
        whole = plan.whole(read)
        local = None if whole else HeadSlice(read.local_first, read.count, plan.local_heads)
        remote = None if whole else HeadSlice(read.remote_first, read.count, plan.remote_heads)
        with self._tables_lock:
            return self._prepared(local, remote, read, peer)

    def _prepared(self, local: HeadSlice | None, remote: HeadSlice | None, read: Read,
                  peer: PeerState) -> tuple[Table, Table]:
        assert self._transport is not None and self._geometry is not None
        mine = self._tables.get(local)
        if mine is None:
            slots = SlotTable(self._geometry, local)
            mine = self._tables[local] = (slots, self._transport.prep_local(slots.descs))
        theirs = peer.tables.get(remote)
        if theirs is None:
            assert peer.geometry is not None and peer.name is not None
            slots = SlotTable(peer.geometry, remote)
            if not np.array_equal(mine[0].row_nbytes, slots.row_nbytes):
                raise ValueError(f"the local and producer rank {read.rank} slot tables differ in "
                                 "bytes per block; the KV layouts do not match")
            theirs = peer.tables[remote] = (slots, self._transport.prep_remote(peer.name, slots.descs))
        return mine, theirs
