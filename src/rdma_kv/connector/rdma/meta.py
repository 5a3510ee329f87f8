"""What the RDMA connector's scheduler side hands its workers each step,
and what a worker publishes at startup.

Owns :class:`RdmaConnectorMetadata` (loads with their remote block
descriptors, producers to connect to ahead of a load, lease grants,
releases, renewals and aborts) and
:class:`RdmaHandshakeMetadata`. Frozen dataclasses of plain values, so an
engine may serialise them between processes.

Imports the standard library and the connector's ``base``, ``types``,
``rdma.params`` and ``rdma.wire`` (for the reader bounds).
"""

from __future__ import annotations

import dataclasses

from rdma_kv.connector.base import KVConnectorHandshakeMetadata, KVConnectorMetadata
from rdma_kv.connector.rdma.params import LeaseRef, RemotePrefillParams
from rdma_kv.connector.rdma.wire import LeaseWire, check_reader
from rdma_kv.connector.types import BlockId, EngineId, GroupBlockIds, RequestId, as_group_block_ids

__all__ = [
    "LoadSpec",
    "agent_name",
    "PeerAddress",
    "RdmaConnectorMetadata",
    "RdmaHandshakeMetadata",
    "RemoteLease",
    "SendSpec",
]


def agent_name(engine_id: str, tp_rank: int) -> str:
    """The transport agent name of rank ``tp_rank`` of engine ``engine_id``."""
    return f"{engine_id}/tp{tp_rank}"


@dataclasses.dataclass(frozen=True)
class PeerAddress:
    """A producer engine's side channel (rank 0's port; rank ``r`` adds ``r``)."""

    engine_id: EngineId
    host: str
    port: int
    tp_size: int

    @classmethod
    def of(cls, params: RemotePrefillParams) -> PeerAddress:
        return cls(params.remote_engine_id, params.remote_host, params.remote_port, params.tp_size)

    def rank_address(self, rank: int) -> tuple[str, int]:
        """The side channel of producer rank ``rank``: host, base port + rank."""
        return self.host, self.port + rank

    def rank_key(self, rank: int) -> tuple[str, str, int]:
        """Producer rank ``rank`` as a consumer keys it (``PeerKey``): engine id, host, port."""
        return (self.engine_id, *self.rank_address(rank))


@dataclasses.dataclass(frozen=True)
class RemoteLease:
    """A lease on ``peer`` (for RENEW and RELEASE), and this consumer's
    ``claim`` on it: a random key the consumer scheduler draws once per
    request. The first claim a producer sees for a lease owns it; every
    lease call of this request carries the same claim (and so a retried
    CONFIRM is recognised by it). ``reader`` is the consumer rank making the
    call and ``readers`` how many consumer ranks read this producer rank
    under the lease: the producer ends the lease only once that many
    distinct readers released it."""

    peer: PeerAddress
    lease: LeaseRef
    claim: bytes = dataclasses.field(repr=False)
    reader: int = 0
    readers: int = 1

    def __post_init__(self) -> None:
        check_reader(self.reader, self.readers)

    def to_wire(self) -> LeaseWire:
        """The lease as a lease call carries it (RENEW, RELEASE, CONFIRM)."""
        return LeaseWire.of(self.lease, self.claim, self.reader, self.readers)


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """Read ``remote_block_ids[g][i]`` of ``peer`` into ``local_block_ids[g][i]``
    for every KV-cache group ``g`` (a flat sequence is taken as one group).
    ``error`` set: do not read; report the blocks as load errors."""

    request_id: RequestId
    local_block_ids: GroupBlockIds
    remote_block_ids: GroupBlockIds
    peer: PeerAddress
    lease: LeaseRef
    lease_ttl_s: float
    claim: bytes = dataclasses.field(repr=False)
    """This request's claim on ``lease`` (see :class:`RemoteLease`)."""
    error: str | None = None
    num_skipped_blocks: tuple[int, ...] = ()
    """Per group, the prompt's blocks not read because they lie outside a
    sliding window (the decoder never attends to them); for the stats."""
    registration: int = 1
    """The producer's KV-cache registration the remote block ids index."""
    transfer_id: str | None = None
    """Concurrent dispatch (push mode): the router's id of the pair; there is
    no lease (``lease`` is a placeholder, no lease call is made) and no
    producer block ids: the producer writes its blocks from token
    ``first_token`` on into ``local_block_ids``."""
    first_token: int = 0
    num_tokens: int = 0
    """Concurrent dispatch: the prompt's tokens (the producer checks its own)."""
    prompt_digest: bytes = b""
    """Concurrent dispatch: ``params.prompt_digest`` of the prompt (the
    producer writes only the KV of a prefill of this digest)."""

    @property
    def concurrent(self) -> bool:
        return self.transfer_id is not None

    def __post_init__(self) -> None:
        # Not range-checked here: the worker checks them against both KV caches.
        object.__setattr__(self, "local_block_ids", as_group_block_ids(self.local_block_ids, check=False))
        object.__setattr__(self, "remote_block_ids", as_group_block_ids(self.remote_block_ids, check=False))

    @property
    def remote_lease(self) -> RemoteLease:
        return RemoteLease(self.peer, self.lease, self.claim)

    @property
    def all_local_block_ids(self) -> tuple[BlockId, ...]:
        """Every local block of the load, all groups together."""
        return tuple(b for group in self.local_block_ids for b in group)


@dataclasses.dataclass(frozen=True)
class SendSpec:
    """A producer-side lease to hold: ``block_ids`` (per group; a flat
    sequence is one group) stay allocated until the lease is released or
    expires."""

    request_id: RequestId
    block_ids: GroupBlockIds
    lease: LeaseRef
    lease_ttl_s: float
    transfer_id: str | None = None
    """Push mode, concurrent dispatch: the router's id of the pair, under
    which the decode registers its blocks (``pusher``)."""
    num_tokens: int = 0
    prompt_digest: bytes = b""
    """``params.prompt_digest`` of the prompt whose KV the blocks hold
    (concurrent dispatch: compared with the registration's)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", as_group_block_ids(self.block_ids))


@dataclasses.dataclass(frozen=True)
class LayerPushSpec:
    """Push mode, concurrent dispatch: a prefill under ``transfer_id`` that
    computes tokens ``[start, end)`` in this step, with ``block_ids`` (its one
    KV-cache group's blocks so far): the producer's workers write each
    layer's complete blocks to the decode registered under the id as the
    layer is stored (``pusher``)."""

    transfer_id: str
    request_id: RequestId
    block_ids: tuple[int, ...]
    start: int
    end: int
    prompt_digest: bytes = b""
    """``params.prompt_digest`` of the prefill's prompt: a registration of
    another digest gets none of its layers."""


@dataclasses.dataclass(frozen=True)
class RdmaConnectorMetadata(KVConnectorMetadata):
    lease_epoch: int = 0
    """The producer scheduler's epoch (0 on a consumer-only engine)."""
    lease_key: bytes = dataclasses.field(default=b"", repr=False)
    """The epoch's lease key (``params.lease_token``): lets a worker verify
    that its scheduler granted a lease it has not been shipped yet. Stays
    inside the producer engine (never on the side channel, never logged)."""
    loads: tuple[LoadSpec, ...] = ()
    sends: tuple[SendSpec, ...] = ()
    releases: tuple[RemoteLease, ...] = ()
    """Leases to release without reading (full prefix hit, abort before load)."""
    renewals: tuple[RemoteLease, ...] = ()
    """Leases of requests still waiting for admission."""
    aborts: tuple[RequestId, ...] = ()
    """Requests finished while their load was handed to the worker: report
    them in ``done_recving`` once no read can land in their blocks (unless
    reported already)."""
    connects: tuple[PeerAddress, ...] = ()
    """Producers of requests the scheduler saw for the first time this step:
    the workers start a handshake with any they do not know yet
    (``RdmaConsumer.preconnect``), so that it overlaps the request's wait
    for admission instead of following it."""
    reclaims: tuple[int, ...] = ()
    """Generations of leases the producer's scheduler ends now to free
    blocks for waiting requests (memory pressure): the workers end them
    (GONE to every later call) and report them in ``done_sending``."""
    layer_pushes: tuple[LayerPushSpec, ...] = ()
    """Push mode: the prefills under a transfer id that compute in this step."""
    idle: bool = False
    """No request computes in this step (the scheduler scheduled no token):
    the worker may wait for its loads in ``get_finished`` (``idle_wait_s``)."""


@dataclasses.dataclass(frozen=True)
class RdmaHandshakeMetadata(KVConnectorHandshakeMetadata):
    engine_id: EngineId
    host: str
    port: int
    """This rank's side-channel port (the base port is ``port - tp_rank``)."""
    tp_rank: int
    compat_hash: str
    registration: int = 1
    """This rank's KV-cache registration: 1, then one more after each wake
    from sleep (the scheduler puts it into the params it issues)."""
