"""Shared pieces of the lease-table tests: a settable clock, lease refs
with valid tokens, calls by one or several readers, a table with granted
leases, and a snapshot of everything a call could change."""

from __future__ import annotations

from rdma_kv.connector.rdma.leases import LeaseCall, LeaseTable
from rdma_kv.connector.rdma.params import LeaseRef, lease_binding, lease_token
from rdma_kv.connector.rdma.wire import LeaseStatus

HELD, PENDING, GONE, CLAIMED, UNKNOWN, FORGED = (LeaseStatus.HELD, LeaseStatus.PENDING, LeaseStatus.GONE,
                                                 LeaseStatus.CLAIMED, LeaseStatus.UNKNOWN, LeaseStatus.FORGED)
KEY = b"k" * 32
EPOCH = 7
A, B, C = b"A" * 16, b"B" * 16, b"C" * 16  # three consumers' claims


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def binding(blocks):
    """The binding of a lease over ``blocks`` (one group) of producer "P"."""
    return lease_binding("P", 1, 16 * len(blocks), (tuple(blocks),))


def ref(gen, rid=None, epoch=EPOCH, key=KEY, blocks=None):
    """A genuine lease ref: its token covers ``blocks`` (default: the ones
    ``table_with`` grants it)."""
    rid = rid or f"r{gen}"
    bound = binding(blocks if blocks is not None else (gen * 10, gen * 10 + 1))
    return LeaseRef(epoch, gen, rid, lease_token(key, epoch, gen, rid, bound), bound)


def call(gen, claim=A, **kw):
    return [LeaseCall(ref(gen, **kw), claim)]


def rcall(gen, reader, readers=2, claim=A):
    """A call by consumer rank ``reader`` of an engine whose ``readers`` ranks read the lease."""
    return [LeaseCall(ref(gen), claim, reader, readers)]


def table_with(*gens, ttl_s=10.0, clock=None):
    table = LeaseTable(clock or Clock())
    table.set_epoch(EPOCH, KEY)
    for gen in gens:
        table.grant(ref(gen), [gen * 10, gen * 10 + 1], ttl_s)
    return table


def state(table):
    """Everything a call could change (for "nothing was recorded")."""
    return (sorted((g, l.owner, l.expires_at, l.renewals, l.claim and (l.claim.readers, sorted(l.claim.released),
                                                                      sorted(l.claim.confirmed)))
                   for g, l in table._leases.items()),
            sorted((g, e.owner, e.released, e.confirmed) for g, e in table._early.items()),
            list(table._ended.items()), set(table._done), table._max_generation)
