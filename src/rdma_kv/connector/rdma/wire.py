"""The side channel's wire format: framed, versioned, schema-checked msgspec.

Owns every message the side channel carries, the compatibility record two
engines must agree on (:class:`CompatInfo`, with its hash and a mismatch
report naming both sides' values), the wire form of block geometry, and the
framing: a 4-byte big-endian length, then one msgpack message (a tagged
msgspec union). Frames are size-limited before a byte of the body is read;
bodies are decoded against the schema only (never pickle), so a malformed
peer gets an error, not code execution.

Version 2 opens every connection with HELLO -> CHALLENGE and, when the
producer has a shared secret, AUTH -> AUTH_OK (``auth.py``) before any other
request is served.

Imports the standard library, msgspec, ``rdma_kv.errors`` and the
connector's ``geometry`` and ``params``; never the transport.
"""

from __future__ import annotations

import enum
import hashlib
import re
import socket
import struct
import time
from typing import Annotated, TypeVar, Union

import msgspec

from rdma_kv.connector.geometry import KVCacheGeometry, LayerGeometry, Layout, Region, Segment
from rdma_kv.connector.rdma.params import LEASE_BINDING_BYTES, LEASE_TOKEN_BYTES, LeaseRef
from rdma_kv.connector.types import RequestId
from rdma_kv.errors import MetadataError, PeerError

__all__ = [
    "CLAIM_BYTES",
    "PUSH_NOTIFY_PREFIX",
    "PUSH_TOKEN_BYTES",
    "HeadsWire",
    "Push",
    "PushHello",
    "PushQuery",
    "PushReg",
    "PushReply",
    "PushState",
    "MAX_READER",
    "MAX_READERS",
    "PROTOCOL_VERSION",
    "Auth",
    "AuthOk",
    "Challenge",
    "CompatInfo",
    "Confirm",
    "ErrorReply",
    "GeometryWire",
    "Handshake",
    "HandshakeReply",
    "Hello",
    "LeaseReply",
    "LeaseStatus",
    "LeaseWire",
    "RankInfo",
    "Refused",
    "Release",
    "Renew",
    "decode_reply",
    "decode_request",
    "recv_frame",
    "check_reader",
    "send_frame",
]

PROTOCOL_VERSION = 6
"""The side channel's version: both ends must speak the same one. A peer of
another version is refused with a message naming both versions (a version-1
producer answers HELLO with ``error``, which the client reports as a version
mismatch). Each version, and what changed under it without a new number
(fields added with a default, which an older peer of the same version
refuses as unknown: ``forbid_unknown_fields``):

1. First release (2026-11-22). HANDSHAKE ``{version, engine_id, tp_rank,
   compat}`` answered ``handshake_ok{version, engine_id, tp_rank, compat,
   compat_hash, agent_metadata, geometry}``; RENEW, CONFIRM (with
   ``release``) and RELEASE of ``[epoch, generation, request_id]`` answered
   HELD, PENDING or GONE. ``CompatInfo`` named ``num_kv_heads`` and
   ``tp_size``.
2. (2026-11-22) Every connection opens with HELLO -> CHALLENGE and, when
   the producer has a shared secret, AUTH -> AUTH_OK (``auth``); a peer's
   geometry is capped (``MAX_BLOCKS_PER_LAYER``, ``MAX_SLOTS``). Later under
   2: ``CompatInfo`` gained ``kv_layout`` and ``attention_backend``.
3. (2026-11-24) A lease names its grant ``token`` and the consumer's
   ``claim``; CLAIMED and UNKNOWN answers.
4. (2026-11-24) A lease call names the consumer rank making it (``reader``)
   and how many consumer ranks read this producer rank under the lease
   (``readers``): the lease ends when all of them released. Later under 4
   (heterogeneous tensor parallel, hybrid models): HANDSHAKE and its reply
   name a ``RankInfo`` (``tp_rank, tp_size, num_kv_heads``) instead of
   ``tp_rank``; ``CompatInfo`` names ``total_kv_heads`` instead of
   ``num_kv_heads`` and drops ``tp_size``, and gained ``layer_groups``; a
   geometry layer gained ``head_nbytes`` and ``group``.
5. (2026-11-25) A lease call carries the lease's ``binding``
   (``params.lease_binding``: engine, TP size, token count and block ids of
   every group), which the grant token covers; FORGED answers a genuine
   token presented with other block ids. Later under 5 (sleep mode): the
   handshake reply names the producer's KV-cache ``registration`` (default
   1), and the binding covers it.
6. (2026-11-26) Push mode (``mode: "push"``): ``CompatInfo`` names the
   ``transfer_mode`` (a pull engine and a push engine refuse each other at
   the handshake); PUSH_HELLO (the decode's agent metadata and geometry),
   PUSH (a lease, the decode's allocation ``token`` and both sides' block
   ids: the producer writes those blocks) and PUSH_QUERY (state, or abort)
   answered ``push{state, detail, writes_end_within_s}``.
"""
MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 16 << 20  # agent metadata (worker address + rkeys) plus geometry
MAX_LEASES_PER_MESSAGE = 4096
CLAIM_BYTES = 16
MAX_READER = (1 << 16) - 1
"""The highest consumer rank a lease call may name."""
MAX_READERS = 1024
"""The most consumer ranks that may read one producer rank under one lease
(the table remembers, per lease, which of them released)."""
MAX_LAYERS = 4096
MAX_BLOCKS_PER_LAYER = 1 << 24
MAX_SLOTS = 1 << 26
"""Descriptors a peer's geometry may make us prepare (20 bytes each on the
consumer: 1.3 GB at this cap). Without it a producer could announce 2**40
blocks of stride 0 inside a one-byte region and exhaust the consumer's memory."""

_HEADER = struct.Struct(">I")
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 anyway
Str = Annotated[str, msgspec.Meta(max_length=1024)]


class LeaseStatus(enum.IntEnum):
    """A producer's answer about one lease (``leases`` has the state machine)."""

    HELD = 1
    """The blocks are held for this claimant: to a CONFIRM, they were held,
    unreleased and unexpired, from the grant until this answer."""
    PENDING = 2
    """Granted by the producer's scheduler but not yet shipped to this worker
    (RENEW, RELEASE), or this worker has not learnt its epoch yet: ask again."""
    GONE = 3
    """Released or expired (for good: a lease never comes back), or of another
    producer incarnation."""
    CLAIMED = 4
    """Refused: another consumer claimed this lease first (the same
    kv_transfer_params loaded twice, e.g. a router retry). Nothing changed."""
    UNKNOWN = 5
    """Refused: this producer never granted such a lease (its token does not
    verify for what the call names). Nothing was recorded."""
    FORGED = 6
    """Refused: the token is one this producer granted, but the call names
    other blocks (or another request id, token count, engine or TP size)
    than the lease covers: the kv_transfer_params were altered. Nothing was recorded; the
    producer logs the attempt with the peer's address."""


class CompatInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What two engines must agree on to copy KV heads block for block,
    whatever their tensor-parallel sizes: the model's shape, not a rank's
    (a rank's share, its heads and TP size, travels in :class:`RankInfo`)."""

    num_layers: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    total_kv_heads: Annotated[int, msgspec.Meta(ge=0)]
    """The model's KV heads (1 for MLA), before tensor parallelism shards them."""
    head_size: Annotated[int, msgspec.Meta(ge=0)]
    dtype: Str
    spec: Str
    """The KV-cache spec's kind and block size, and its page size per KV head."""
    layouts: Annotated[list[Str], msgspec.Meta(max_length=MAX_LAYERS)]
    """Per layer: layout, segment bytes per KV head, bytes of one head's
    slice, and memory order with the heads dim written ``H``, e.g.
    ``blocks_first:4096:2048:(B,H,16,64) order 0,1,2,3``."""
    kv_layout: Str = ""
    """``NHD``, ``HND`` or ``MLA`` (geometry.LayerGeometry.kv_layout)."""
    attention_backend: Str = ""
    """The engine's attention backend (vLLM's name, e.g. ``FLASH_ATTN``); empty outside vLLM."""
    layer_groups: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_LAYERS)] = []
    """Per layer, its KV-cache group; empty for a single group (hybrid
    models: block ids travel per group, so both sides must group alike)."""
    transfer_mode: Str = "pull"
    """``pull`` (the decode reads) or ``push`` (the producer writes): both
    engines must run the same mode."""

    def compat_hash(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:32]

    def mismatches(self, other: CompatInfo, mine: str = "local", theirs: str = "remote") -> list[str]:
        """One line per differing field, naming both sides' values."""
        out = []
        for name in self.__struct_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                if name == "layouts":
                    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    a = f"{len(a)} layers, layer {first}: {a[first] if first < len(a) else '-'}"
                    b = f"{len(b)} layers, layer {first}: {b[first] if first < len(b) else '-'}"
                out.append(f"{name}: {mine} {a!r} vs {theirs} {b!r}")
                if name == "block_size":
                    out[-1] += (" (blocks are not remapped between block sizes: the KV is not "
                                "transferred and the request is computed locally, or fails under "
                                "kv_load_failure_policy=fail; start both engines with the same "
                                "--block-size)")
        return out


class SegmentWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    offset: U64
    block_stride_bytes: U64
    block_nbytes: Annotated[int, msgspec.Meta(ge=1)]


class LayerWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    name: Str
    region_index: Annotated[int, msgspec.Meta(ge=0)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS_PER_LAYER)]
    layout: Layout
    segments: Annotated[list[SegmentWire], msgspec.Meta(min_length=1, max_length=8)]
    head_nbytes: U64 = 0
    """``LayerGeometry.head_nbytes``: lets a reader slice heads out of a block."""
    group: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)] = 0
    """The layer's KV-cache group (last, with a default: a single-group peer's layers need not send it)."""


class RegionWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    base_address: U64
    nbytes: Annotated[int, msgspec.Meta(ge=1)]


class GeometryWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    regions: Annotated[list[RegionWire], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    layers: Annotated[list[LayerWire], msgspec.Meta(max_length=MAX_LAYERS)]

    @classmethod
    def from_geometry(cls, geometry: KVCacheGeometry) -> GeometryWire:
        return cls(
            [RegionWire(r.base_address, r.nbytes) for r in geometry.regions],
            [
                LayerWire(
                    layer.name, layer.region_index, layer.num_blocks, layer.layout,
                    [SegmentWire(s.offset, s.block_stride_bytes, s.block_nbytes)
                     for s in layer.segments],
                    layer.head_nbytes,
                    layer.group,
                )
                for layer in geometry.layers
            ],
        )

    def to_geometry(self) -> KVCacheGeometry:
        """Checked: every block of every segment lies inside its region, so a
        peer cannot make us read outside what it registered."""
        regions = tuple(Region(r.base_address, r.nbytes, "remote", ()) for r in self.regions)
        slots = sum(layer.num_blocks * len(layer.segments) for layer in self.layers)
        if slots > MAX_SLOTS:
            raise MetadataError(
                f"peer geometry lists {slots} block descriptors, over the limit of {MAX_SLOTS}"
            )
        layers = []
        for layer in self.layers:
            if layer.region_index >= len(regions):
                raise MetadataError(
                    f"peer geometry: layer {layer.name!r} names region {layer.region_index}, "
                    f"but only {len(regions)} regions were sent"
                )
            region = regions[layer.region_index]
            size = region.nbytes
            if region.base_address + size >= 2**64:
                raise MetadataError(f"peer geometry: region {layer.region_index} ends past the "
                                    "64-bit address space")
            for seg in layer.segments:
                end = seg.offset + (layer.num_blocks - 1) * seg.block_stride_bytes + seg.block_nbytes
                if end > size:
                    raise MetadataError(
                        f"peer geometry: layer {layer.name!r} block {layer.num_blocks - 1} ends at "
                        f"byte {end}, beyond its region of {size} bytes"
                    )
            layers.append(LayerGeometry(
                layer.name, layer.region_index, layer.num_blocks, layer.layout,
                tuple(Segment(s.offset, s.block_stride_bytes, s.block_nbytes) for s in layer.segments),
                head_nbytes=layer.head_nbytes,
                group=layer.group,
            ))
        return KVCacheGeometry(regions, tuple(layers))


Token = Annotated[bytes, msgspec.Meta(min_length=LEASE_TOKEN_BYTES, max_length=LEASE_TOKEN_BYTES)]
Binding = Annotated[bytes, msgspec.Meta(min_length=LEASE_BINDING_BYTES, max_length=LEASE_BINDING_BYTES)]
ClaimKey = Annotated[bytes, msgspec.Meta(min_length=CLAIM_BYTES, max_length=CLAIM_BYTES)]


def check_reader(reader: int, readers: int) -> None:
    """Raise ``ValueError`` unless ``reader`` and ``readers`` are within what
    the wire carries (the schema checks a peer's values the same way)."""
    if not 0 <= reader <= MAX_READER or not 1 <= readers <= MAX_READERS:
        raise ValueError(
            f"lease call by reader {reader} of {readers}: the reader (the consumer's tensor-parallel "
            f"rank) must be in [0, {MAX_READER}] and readers (how many consumer ranks read this "
            f"producer rank under the lease) in [1, {MAX_READERS}]")


Reader = Annotated[int, msgspec.Meta(ge=0, le=MAX_READER)]
Readers = Annotated[int, msgspec.Meta(ge=1, le=MAX_READERS)]


class LeaseWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One lease in a RENEW, CONFIRM or RELEASE: the producer's name for it
    (with its grant token and the binding the token covers), the asking
    consumer's claim, the consumer rank making the call (``reader``) and how
    many consumer ranks read this producer rank under the lease
    (``readers``, fixed by the first claim). Omitted on the wire, the last
    two mean reader 0 of 1."""

    epoch: U64
    generation: U64
    request_id: Str
    token: Token
    binding: Binding
    claim: ClaimKey
    reader: Reader = 0
    readers: Readers = 1

    @classmethod
    def of(cls, ref: LeaseRef, claim: bytes, reader: int = 0, readers: int = 1) -> LeaseWire:
        check_reader(reader, readers)
        return cls(ref.epoch, ref.generation, ref.request_id, ref.token, ref.binding, claim, reader, readers)

    def ref(self) -> LeaseRef:
        return LeaseRef(self.epoch, self.generation, RequestId(self.request_id), self.token, self.binding)


Leases = Annotated[list[LeaseWire], msgspec.Meta(max_length=MAX_LEASES_PER_MESSAGE)]


# --- requests (client -> server) ---------------------------------------------------

Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Proof = Annotated[bytes, msgspec.Meta(max_length=64)]


class Hello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """The first message of every connection: the client's nonce and role."""

    version: int
    role: Annotated[str, msgspec.Meta(max_length=32)]
    nonce: Nonce


class Auth(msgspec.Struct, frozen=True, tag="auth", forbid_unknown_fields=True):
    """The client's proof (``auth.client_proof``); empty when it has no secret."""

    version: int
    proof: Proof


class RankInfo(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One rank's share of the model: its TP rank and size, and the KV heads it holds."""

    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class Handshake(msgspec.Struct, frozen=True, tag="handshake", forbid_unknown_fields=True):
    version: int
    engine_id: Str
    rank: RankInfo
    compat: CompatInfo


class Renew(msgspec.Struct, frozen=True, tag="renew", forbid_unknown_fields=True):
    version: int
    leases: Leases


class Confirm(msgspec.Struct, frozen=True, tag="confirm", forbid_unknown_fields=True):
    """Were these leases held continuously until now? With ``release``, a
    HELD lease is also released in the same step (one round trip)."""

    version: int
    leases: Leases
    release: bool = False


class Release(msgspec.Struct, frozen=True, tag="release", forbid_unknown_fields=True):
    version: int
    leases: Leases


PUSH_TOKEN_BYTES = 16
PUSH_NOTIFY_PREFIX = b"rdma-kv-push:"
"""A push's notification (transport-level, after every write landed): this prefix, then the 16-byte token."""
PushToken = Annotated[bytes, msgspec.Meta(min_length=PUSH_TOKEN_BYTES, max_length=PUSH_TOKEN_BYTES)]
BlockIdList = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS_PER_LAYER)]],
                        msgspec.Meta(max_length=1 << 20)]
GroupIdLists = Annotated[list[BlockIdList], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]


class HeadsWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Heads ``[first, first + count)`` of the ``of`` KV heads a rank holds (``slots.HeadSlice``)."""

    first: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
    count: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    of: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class PushHello(msgspec.Struct, frozen=True, tag="push_hello", forbid_unknown_fields=True):
    """A decode rank introduces its KV cache to a producer rank that will
    write into it: its agent metadata (worker address, packed remote keys)
    and geometry, under its KV-cache ``registration``."""

    version: int
    engine_id: Str
    rank: RankInfo
    registration: Annotated[int, msgspec.Meta(ge=1)]
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_REQUEST_BYTES // 2)]
    geometry: GeometryWire


class Push(msgspec.Struct, frozen=True, tag="push", forbid_unknown_fields=True):
    """Write the lease's ``remote_block_ids`` (the producer's, per group)
    into the decode's ``local_block_ids`` (per group, allocated to this
    request), the heads of each side given by ``*_heads`` (None: whole
    blocks); notify ``token`` once every write is remotely complete."""

    version: int
    lease: LeaseWire
    token: PushToken
    engine_id: Str
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    registration: Annotated[int, msgspec.Meta(ge=1)]
    local_block_ids: GroupIdLists
    remote_block_ids: GroupIdLists
    local_heads: HeadsWire | None = None
    remote_heads: HeadsWire | None = None


class PushReg(msgspec.Struct, frozen=True, tag="push_reg", forbid_unknown_fields=True):
    """Concurrent dispatch: register the decode's blocks for the prompt from
    ``first_token`` on (one KV-cache group) under the router's
    ``transfer_id``, before or after the prefill ran; the producer writes
    them once the prefill under that id finished (its own lease, pinned),
    and notifies ``token``. ``reader``/``readers``: this decode rank, and how
    many decode ranks register for this producer rank (heterogeneous TP)."""

    version: int
    transfer_id: Str
    token: PushToken
    engine_id: Str
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    registration: Annotated[int, msgspec.Meta(ge=1)]
    first_token: Annotated[int, msgspec.Meta(ge=0)]
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]
    local_block_ids: GroupIdLists
    reader: Reader = 0
    readers: Readers = 1
    local_heads: HeadsWire | None = None
    remote_heads: HeadsWire | None = None


class PushQuery(msgspec.Struct, frozen=True, tag="push_query", forbid_unknown_fields=True):
    """Where the push of ``token`` is; with ``abort``, stop it first (no
    write is posted for it after this answer)."""

    version: int
    token: PushToken
    abort: bool = False


Request = Union[Hello, Auth, Handshake, Renew, Confirm, Release, PushHello, Push, PushReg, PushQuery]


# --- replies (server -> client) ------------------------------------------------------


class Challenge(msgspec.Struct, frozen=True, tag="challenge", forbid_unknown_fields=True):
    """Answer to HELLO: the server's nonce, and whether AUTH must follow."""

    version: int
    nonce: Nonce
    auth_required: bool


class AuthOk(msgspec.Struct, frozen=True, tag="auth_ok", forbid_unknown_fields=True):
    """The server's proof (``auth.server_proof``): it knows the secret too."""

    proof: Proof


class HandshakeReply(msgspec.Struct, frozen=True, tag="handshake_ok", forbid_unknown_fields=True):
    version: int
    engine_id: Str
    rank: RankInfo
    compat: CompatInfo
    compat_hash: Str
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_REPLY_BYTES)]
    geometry: GeometryWire
    registration: Annotated[int, msgspec.Meta(ge=1)] = 1
    """The producer's KV-cache registration this metadata is of (bumped when
    it re-registers after sleep): params naming another are not read."""


class LeaseReply(msgspec.Struct, frozen=True, tag="lease", forbid_unknown_fields=True):
    statuses: Annotated[list[LeaseStatus], msgspec.Meta(max_length=MAX_LEASES_PER_MESSAGE)]
    ttl_s: float


class Refused(msgspec.Struct, frozen=True, tag="refused", forbid_unknown_fields=True):
    """The server will not serve this client (version or compatibility)."""

    reason: Annotated[str, msgspec.Meta(max_length=8192)]


class ErrorReply(msgspec.Struct, frozen=True, tag="error", forbid_unknown_fields=True):
    """The request was malformed; the connection is closed after this."""

    message: Annotated[str, msgspec.Meta(max_length=8192)]


class PushState(str, enum.Enum):
    """A push as the producer sees it. ``running``: writes posted, not yet
    resolved; ``waiting``: registered under a transfer id whose prefill has
    not finished (nothing posted yet); ``done``: every write remotely complete (flushed) and the
    notification sent; ``failed``/``aborted``: resolved, and no write for
    it will be posted again; ``refused``: nothing was written (``detail``
    says why: the lease's answer, blocks outside the lease, an unknown
    decode); ``pending``: the lease's grant has not reached this worker yet
    (ask again); ``unknown``: no push of this token (never received, or
    forgotten long after it resolved)."""

    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    REFUSED = "refused"
    PENDING = "pending"
    UNKNOWN = "unknown"

    @property
    def resolved(self) -> bool:
        """No write of this push can still land."""
        return self not in (PushState.RUNNING, PushState.WAITING)


class PushReply(msgspec.Struct, frozen=True, tag="push_state", forbid_unknown_fields=True):
    state: PushState
    detail: Annotated[str, msgspec.Meta(max_length=8192)] = ""
    writes_end_within_s: float = 0.0
    """While ``running``: no write of this push lands later than this many
    seconds after the answer (the producer's transfer timeout)."""


Reply = Union[Challenge, AuthOk, HandshakeReply, LeaseReply, Refused, ErrorReply, PushReply]

_encoder = msgspec.msgpack.Encoder()
request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)


T = TypeVar("T")


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


_LEASE_FIELD = re.compile(r"\$\.leases\[(\d+)\]\[(\d+)\]")


def _name_lease_field(message: str) -> str:
    """msgspec names a field of an array-like struct by its index: name it."""
    match = _LEASE_FIELD.search(message)
    fields = LeaseWire.__struct_fields__
    if match is None or int(match.group(2)) >= len(fields):
        return message
    return f"{message} (lease {match.group(1)}, field {fields[int(match.group(2))]!r})"


def _decode(decoder: msgspec.msgpack.Decoder[T], body: bytes, what: str) -> T:
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError (not DecodeError) for a string
        # that is not UTF-8, e.g. a tag: malformed input all the same.
        raise MetadataError(f"malformed {what} ({len(body)} bytes): {_name_lease_field(str(exc))}") from None
    except RecursionError:  # deeply nested arrays: msgspec recurses per level
        raise MetadataError(f"malformed {what} ({len(body)} bytes): nested too deeply") from None


def decode_request(body: bytes) -> Request:
    """A side-channel request, schema-checked; ``MetadataError`` says what is wrong."""
    return _decode(request_decoder, body, "side-channel request")


def decode_reply(body: bytes) -> Reply:
    """A side-channel reply, schema-checked; ``MetadataError`` says what is wrong."""
    return _decode(reply_decoder, body, "side-channel reply")


# --- framing ---------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """``n`` bytes by ``deadline``. Bytes that arrived by then count even when
    this thread runs again only after it (a loaded host can leave a process
    unscheduled for many seconds): past the deadline, what the socket
    already holds is taken without waiting, and only a frame still
    incomplete is a timeout -- a reply received in time is never dropped for
    a late reader (its call would be retried on a new connection)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        sock.settimeout(max(left, 0.0))  # 0: non-blocking, what is buffered only
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except (BlockingIOError, InterruptedError, TimeoutError):
            if left > 0 and time.monotonic() < deadline:
                continue
            raise TimeoutError(f"{what}: timed out with {len(buf)} of {n} bytes received") from None
        if not chunk:
            raise PeerError(f"{what}: connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, payload: bytes, timeout_s: float) -> None:
    sock.settimeout(timeout_s)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, max_bytes: int, timeout_s: float, what: str) -> bytes | None:
    """One frame's body; ``None`` on a clean close before a frame starts.
    A length above ``max_bytes`` is refused before reading the body."""
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    first = sock.recv(_HEADER.size)
    if not first:
        return None
    header = first + (_recv_exact(sock, _HEADER.size - len(first), deadline, what)
                      if len(first) < _HEADER.size else b"")
    (length,) = _HEADER.unpack(header)
    if length > max_bytes:
        raise MetadataError(f"{what}: frame of {length} bytes exceeds the {max_bytes}-byte limit")
    return _recv_exact(sock, length, deadline, what)
