"""Agent metadata: the typed, versioned blob a peer imports (never pickle).

Layout (msgpack via msgspec): ``AgentMetadata{magic, version, schema, name,
ucx_version, worker_address, regions[RegionInfo{base, nbytes, kind, rkey}]}``.
``schema`` is a hash of the field layout, so two builds that disagree on the
format refuse each other even at the same version number. Everything a peer
sends is size-limited and schema-checked here, once, at the edge.

May import: msgspec, rdma_kv.errors, rdma_kv.transport.memory.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

from rdma_kv.errors import MetadataError
from rdma_kv.transport.memory import MemoryKind

MAGIC = "rdma-kv/agent"
VERSION = 1
MAX_METADATA_BYTES = 4 << 20
MAX_REGIONS = 65536
MAX_NAME_BYTES = 255

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 anyway
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_BYTES)]


class RegionInfo(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    base: U64
    nbytes: Annotated[int, msgspec.Meta(gt=0)]
    kind: MemoryKind
    rkey: Annotated[bytes, msgspec.Meta(min_length=1, max_length=65536)]


class AgentMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    magic: str
    version: int
    schema: str
    name: Name
    ucx_version: Annotated[str, msgspec.Meta(max_length=64)]
    worker_address: Annotated[bytes, msgspec.Meta(min_length=1, max_length=1 << 20)]
    regions: Annotated[list[RegionInfo], msgspec.Meta(max_length=MAX_REGIONS)]


def _schema_hash() -> str:
    fields = [
        (t.__name__, t.__struct_fields__, [str(a) for a in t.__annotations__.values()])
        for t in (RegionInfo, AgentMetadata)
    ]
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


class _Header(msgspec.Struct):
    """What every release's blob starts with. Unknown fields are ignored so a
    newer layout is reported as incompatible, not as malformed (the strict
    AgentMetadata decoder forbids unknown fields)."""

    magic: str
    version: int
    schema: str
    name: str = "?"


SCHEMA = _schema_hash()
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AgentMetadata)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def _malformed(blob: bytes, exc: Exception) -> MetadataError:
    return MetadataError(
        f"malformed or truncated agent metadata ({len(blob)} bytes): {exc}; "
        "pass the exact bytes the peer's Agent.metadata() returned"
    )


def encode(name: str, ucx_version: str, worker_address: bytes, regions: list[RegionInfo]) -> bytes:
    md = AgentMetadata(MAGIC, VERSION, SCHEMA, name, ucx_version, worker_address, regions)
    return _encoder.encode(md)


def decode(blob: bytes) -> AgentMetadata:
    """Parse and check peer metadata; MetadataError says what is wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MetadataError(f"agent metadata must be bytes, got {type(blob).__name__}")
    if len(blob) > MAX_METADATA_BYTES:
        raise MetadataError(
            f"agent metadata is {len(blob)} bytes, over the {MAX_METADATA_BYTES}-byte limit"
        )
    try:
        head = _header_decoder.decode(blob)
    # msgspec raises UnicodeDecodeError, not DecodeError, for a str that is
    # not UTF-8: malformed input all the same.
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise _malformed(blob, exc) from None
    if head.magic != MAGIC:
        raise MetadataError(f"not rdma-kv agent metadata (magic {head.magic!r}, expected {MAGIC!r})")
    if head.version != VERSION or head.schema != SCHEMA:
        raise MetadataError(
            f"incompatible agent metadata from {head.name!r}: version {head.version} schema "
            f"{head.schema}, this agent speaks version {VERSION} schema {SCHEMA}; run the "
            "same rdma-kv release on both sides"
        )
    try:
        md = _decoder.decode(blob)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise _malformed(blob, exc) from None
    spans = sorted((r.base, r.base + r.nbytes) for r in md.regions)
    for (b0, e0), (b1, e1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise MetadataError(
                f"agent metadata from {md.name!r} lists overlapping regions "
                f"[{b0:#x}, {e0:#x}) and [{b1:#x}, {e1:#x})"
            )
    # Ends must fit in uint64 (the peer's RegionTable stores them so); checked
    # here, before add_peer() creates an endpoint and unpacks remote keys.
    if spans and spans[-1][1] >= 2**64:
        raise MetadataError(
            f"agent metadata from {md.name!r} has a region ending at {spans[-1][1]:#x}, "
            "past the 64-bit address space"
        )
    return md
