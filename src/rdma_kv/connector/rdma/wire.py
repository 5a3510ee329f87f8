"""The side channel's messages: versioned, schema-checked msgspec.

Owns every message the side channel carries (a tagged msgspec union each
way) and their codec; the handshake's compatibility record and geometry are
``wiregeom``'s (re-exported here, as the messages carry them), and the
framing (a 4-byte big-endian length, size-limited before a byte of the
body is read) is ``framing``'s. Bodies are decoded against the schema
only (never pickle), so a malformed peer gets an error, not code
execution.

Version 2 opens every connection with HELLO -> CHALLENGE and, when the
producer has a shared secret, AUTH -> AUTH_OK (``auth.py``) before any other
request is served.

The protocol's version, and what each one changed, are ``versions``'s
(``PROTOCOL_VERSION``, re-exported here).

Imports the standard library, msgspec, ``rdma_kv.errors``, the
connector's ``params``, ``versions`` and ``wiregeom``; never the transport.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, TypeVar, Union

import msgspec

from rdma_kv.connector.rdma.params import LEASE_BINDING_BYTES, LEASE_TOKEN_BYTES, LeaseRef
from rdma_kv.connector.rdma.versions import PROTOCOL_VERSION
from rdma_kv.connector.types import RequestId
from rdma_kv.connector.rdma.wiregeom import (
    MAX_BLOCKS_PER_LAYER,
    MAX_LAYERS,
    MAX_SLOTS,
    U64,
    CompatInfo,
    GeometryWire,
    RegionWire,
    Str,
)
from rdma_kv.errors import MetadataError

__all__ = [
    "CLAIM_BYTES",
    "lease_chunks",
    "PUSH_NOTIFY_PREFIX",
    "INCARNATION_BYTES",
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
    "RegionWire",
    "Release",
    "Renew",
    "MAX_BLOCKS_PER_LAYER",
    "MAX_SLOTS",
    "decode_reply",
    "decode_request",
    "check_reader",
]

MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 16 << 20  # agent metadata (worker address + rkeys) plus geometry
MAX_LEASES_PER_MESSAGE = 4096
CLAIM_BYTES = 16
MAX_READER = (1 << 16) - 1
"""The highest consumer rank a lease call may name."""
MAX_READERS = 1024
"""The most consumer ranks that may read one producer rank under one lease
(the table remembers, per lease, which of them released)."""


class LeaseStatus(enum.IntEnum):
    """A producer's answer about one lease (``leases`` has the state machine)."""

    HELD = 1
    """The blocks are held for this claimant: to a CONFIRM, they were held,
    unreleased and unexpired, from the grant until this answer."""
    PENDING = 2
    """Granted by the producer's scheduler but not yet shipped to this worker
    (RENEW, RELEASE), or this worker has not learnt its epoch yet, or not
    verified: the call had presented ``leases.WRONG_TOKENS_PER_CALL`` tokens
    that do not verify before this lease. Nothing recorded: ask again."""
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
T = TypeVar("T")

LEASE_FIXED_BYTES = 96
"""The most one lease of a lease call takes on the wire besides its request
id's UTF-8 bytes: two 64-bit integers (9 bytes each), token, binding and
claim (18 each), reader and readers (3 each), the array's and the
string's headers (1 and 3): 82, rounded up."""
MESSAGE_FIXED_BYTES = 256
"""Room for a lease call's own fields (tag, version, flags) and list header."""


def lease_chunks(items: Sequence[T], request_id: Callable[[T], str]) -> Iterator[list[T]]:
    """``items`` (each carrying one lease, whose request id ``request_id``
    gives) cut, in order, into the lease calls that carry them: at most
    ``MAX_LEASES_PER_MESSAGE`` leases, and at most ``MAX_REQUEST_BYTES``
    encoded, a call. The producer refuses a call over either limit whole
    (an ``ErrorReply``), and a request id may be 1024 characters: 4096
    leases of 190-character ids already pass the byte limit."""
    chunk: list[T] = []
    size = MESSAGE_FIXED_BYTES
    for item in items:
        nbytes = LEASE_FIXED_BYTES + len(request_id(item).encode())
        if chunk and (len(chunk) == MAX_LEASES_PER_MESSAGE or size + nbytes > MAX_REQUEST_BYTES):
            yield chunk
            chunk, size = [], MESSAGE_FIXED_BYTES
        chunk.append(item)
        size += nbytes
    if chunk:
        yield chunk


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
    """Push these leases' expiry back. With ``pin`` (sent as a consumer
    posts its reads), a HELD lease is also *pinned*: held, whatever else
    happens to the producer (reclaim, its lifetime bound, sleep), until it
    is released or the reply's ``pinned_s`` from the answer have passed."""

    version: int
    leases: Leases
    pin: bool = False


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
INCARNATION_BYTES = 8
Incarnation = Annotated[bytes, msgspec.Meta(min_length=INCARNATION_BYTES, max_length=INCARNATION_BYTES)]
PROMPT_DIGEST_BYTES = 16
PromptDigest = Annotated[bytes, msgspec.Meta(max_length=PROMPT_DIGEST_BYTES)]
"""``params.prompt_digest`` of a decode's prompt (empty: none named, which
no prefill matches)."""
"""A decode worker's, random, drawn when it starts: which of the decodes
calling themselves ``engine_id`` rank ``r`` a push is for."""
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
    incarnation: Incarnation
    registration: Annotated[int, msgspec.Meta(ge=1)]
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_REQUEST_BYTES // 2)]
    geometry: GeometryWire
    link: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """The decode's transport peer for this producer rank (new at each
    handshake): a new one is imported afresh (version 13)."""
    ordinal: Annotated[int, msgspec.Meta(ge=0, le=1 << 32)] = 0
    """The number of ``link``'s endpoint among those the decode's worker made
    to this producer rank's worker (``Agent.ordinal``; 0: not counted): the
    producer's import is made the same number (version 14)."""
    life: Annotated[bytes, msgspec.Meta(max_length=INCARNATION_BYTES)] = b""
    """The ``life`` of the producer's transport that answered the handshake
    ``link`` was made at (empty: not known): another life's pusher refuses
    it before importing anything, since ``ordinal`` counts endpoints to that
    life's worker (version 15)."""


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
    incarnation: Incarnation
    registration: Annotated[int, msgspec.Meta(ge=1)]
    local_block_ids: GroupIdLists
    remote_block_ids: GroupIdLists
    local_heads: HeadsWire | None = None
    remote_heads: HeadsWire | None = None
    link: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """The decode's link this push is sent on (``PushHello.link``): the
    producer writes it only over its import for that link, the one the
    decode fences if the push fails (version 14; empty: any)."""


class PushReg(msgspec.Struct, frozen=True, tag="push_reg", forbid_unknown_fields=True):
    """Concurrent dispatch: register the decode's blocks for the prompt from
    ``first_token`` on (one KV-cache group) under the router's
    ``transfer_id``, before or after the prefill ran; the producer writes
    them once the prefill under that id finished (its own lease, pinned),
    and notifies ``token``. ``reader``/``readers``: this decode rank, and how
    many decode ranks register for this producer rank (heterogeneous TP).
    ``prompt_digest``: the decode's prompt (``params.prompt_digest``); the
    producer writes only the KV of a prefill of that prompt."""

    version: int
    transfer_id: Str
    token: PushToken
    engine_id: Str
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    incarnation: Incarnation
    registration: Annotated[int, msgspec.Meta(ge=1)]
    first_token: Annotated[int, msgspec.Meta(ge=0)]
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]
    local_block_ids: GroupIdLists
    reader: Reader = 0
    readers: Readers = 1
    local_heads: HeadsWire | None = None
    remote_heads: HeadsWire | None = None
    prompt_digest: PromptDigest = b""
    link: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """As ``Push.link``."""


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
    words: RegionWire | None = None
    """The producer rank's held words (``heldwords``; 16 bytes per block,
    registered with its agent), None when it publishes none."""
    life: Annotated[bytes, msgspec.Meta(max_length=16)] = b""
    """The life of the producer rank's transport (``PushReply.life``; version 14)."""


class LeaseReply(msgspec.Struct, frozen=True, tag="lease", forbid_unknown_fields=True):
    statuses: Annotated[list[LeaseStatus], msgspec.Meta(max_length=MAX_LEASES_PER_MESSAGE)]
    ttl_s: float
    pinned_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """To a RENEW with ``pin``: every HELD lease of the call is pinned for at
    least this long from the answer (0: none is)."""


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
    life: Annotated[bytes, msgspec.Meta(max_length=16)] = b""
    """The life of the producer rank's transport that answered (version 14):
    8 random bytes drawn when the worker starts and at each wake from
    sleep, as in its handshake reply; empty while it has none (asleep). A
    push the producer may have taken in another life is not known to this
    one."""


Reply = Union[Challenge, AuthOk, HandshakeReply, LeaseReply, Refused, ErrorReply, PushReply]

_encoder = msgspec.msgpack.Encoder()
request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)


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
