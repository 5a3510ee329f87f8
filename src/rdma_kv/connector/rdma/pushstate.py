"""Push mode, the producer's records: a decode rank introduced, a push (one
per decode allocation), a lease granted under a transfer id, and the
helpers both halves of the writer use (``pusher``: PUSH, PUSH_QUERY and
the bookkeeping; ``pushreg``: concurrent dispatch and layer-wise writes).

Imports the standard library and the connector's ``geometry`` and ``rdma``
modules ``leases``, ``meta``, ``slots``, ``transport_api`` and ``wire``.
"""

from __future__ import annotations

import dataclasses
import hashlib

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.leases import LeaseCall
from rdma_kv.connector.rdma.meta import SendSpec, agent_name
from rdma_kv.connector.rdma.slots import HeadSlice, SlotTable
from rdma_kv.connector.rdma.transport_api import PreparedList

__all__ = ["ABORTED", "DONE", "FAILED", "FORGET_AFTER_S", "MAX_DECODES", "MAX_REMEMBERED", "PENDING", "REFUSED", "RUNNING",
           "UNKNOWN", "WAITING", "Decode", "DecodeKey", "Granted", "PushEntry", "claim", "decode_key", "decode_name", "describe", "heads"]

FORGET_AFTER_S = 600.0
"""A resolved push is remembered this long (a decode's late query reads its state)."""
MAX_REMEMBERED = 1 << 16
MAX_DECODES = 1024
"""Decode ranks a producer rank knows at once (PUSH_HELLO): past it, a new one
replaces the least recently used with no push running, or is refused. Each
holds its KV cache's geometry (a peer may send megabytes of it) and an
endpoint."""

RUNNING, WAITING, DONE, FAILED, ABORTED, REFUSED, PENDING, UNKNOWN = (
    wire.PushState.RUNNING, wire.PushState.WAITING, wire.PushState.DONE, wire.PushState.FAILED,
    wire.PushState.ABORTED, wire.PushState.REFUSED, wire.PushState.PENDING, wire.PushState.UNKNOWN)


DecodeKey = tuple[str, int, bytes]
"""(engine id, TP rank, incarnation): one decode worker, even when two
engines were given one engine id by mistake."""


def decode_key(request: wire.PushHello | wire.Push | wire.PushReg) -> DecodeKey:
    rank = request.rank.tp_rank if isinstance(request, wire.PushHello) else request.tp_rank
    return request.engine_id, rank, request.incarnation


def decode_name(key: DecodeKey) -> str:
    """The transport peer's name of decode ``key``: ``engine/tpR#incarnation``."""
    return f"{agent_name(key[0], key[1])}#{key[2].hex()}"


def describe(key: DecodeKey) -> str:
    return f"decode {key[0]!r} rank {key[1]} (incarnation {key[2].hex()})"


@dataclasses.dataclass
class Decode:
    """A decode worker's rank that introduced its KV cache (PUSH_HELLO)."""

    name: str  # the transport peer
    geometry: KVCacheGeometry
    registration: int
    key: DecodeKey
    link: str = ""  # the decode's transport peer for this rank when it introduced itself (wire.PushHello)
    ordinal: int = 0  # that link's endpoint number at the decode (wire.PushHello.ordinal)
    tables: dict[HeadSlice | None, tuple[SlotTable, PreparedList]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class PushEntry:
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
    decode: Decode | None = None
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
class Granted:
    """A lease granted under a transfer id (concurrent dispatch), for the
    decode ranks that register under it."""

    send: SendSpec
    at: float


def claim(transfer_id: str) -> bytes:
    """The claim every decode rank of one concurrent push makes on the lease:
    derived from the transfer id both legs carry."""
    return hashlib.sha256(b"rdma-kv push claim " + transfer_id.encode()).digest()[:16]


def heads(w: wire.HeadsWire | None) -> HeadSlice | None:
    return None if w is None else HeadSlice(w.first, w.count, w.of)
