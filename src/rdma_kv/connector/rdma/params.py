"""Typed ``kv_transfer_params``: the request-level P/D protocol, parsed once.

Owns the two shapes of a request's ``kv_transfer_params`` in vLLM's P/D
convention (the one its routers and example proxy already speak):

- a **prefill** request asks for remote decode: ``{"do_remote_decode": true}``
  (routers also send ``do_remote_prefill: false`` and ``remote_*: null``,
  which are accepted);
- the producer's ``request_finished`` returns :class:`RemotePrefillParams`
  as a dict; a router hands it *verbatim* to the **decode** request, which
  then says ``do_remote_prefill: true``.

Parsing happens here, at the edge: the caller's mapping is never mutated,
unknown keys and bad values raise :class:`~rdma_kv.errors.ConfigError`
naming the field and what is valid; inner code only sees the frozen
dataclasses below.

Imports the standard library, ``rdma_kv.errors`` and the connector's
``extrakeys`` and ``types``; never the transport.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import hmac
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rdma_kv.connector.extrakeys import encode_extra_keys
from rdma_kv.connector.types import (
    BlockId,
    EngineId,
    GroupBlockIds,
    Request,
    RequestId,
    as_group_block_ids,
    plain_ints_in,
)
from rdma_kv.connector.rdma.settings import MAX_LEASE_TTL_S, MIN_LEASE_TTL_S
from rdma_kv.errors import ConfigError

__all__ = [
    "PARAM_KEYS",
    "ConcurrentPrefill",
    "format_router_address",
    "router_address",
    "LEASE_BINDING_BYTES",
    "LEASE_TOKEN_BYTES",
    "LeaseRef",
    "RemoteDecodeRequest",
    "RemotePrefillParams",
    "lease_binding",
    "lease_token",
    "other_prompt",
    "request_prompt_digest",
    "parse_kv_transfer_params",
    "PROMPT_DIGEST_BYTES",
    "prompt_digest",
]

# Keys a request's kv_transfer_params may carry: vLLM's P/D keys, then the
# rdma-kv extensions (prefixed ``remote_`` like vLLM's, so a router that
# forwards the producer's output verbatim forwards them too).
_VLLM_KEYS = (
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_request_id",
    "tp_size",
)
_RDMA_KEYS = ("remote_lease_epoch", "remote_lease_generation", "remote_lease_token",
              "remote_lease_ttl_s", "remote_num_tokens", "remote_prompt_digest", "remote_registration")
# Concurrent dispatch (vllm-router's ``--kv-connector moriio`` WRITE mode, Ray
# Serve's concurrent handoff): both legs carry the router's ``transfer_id``;
# the data-parallel and TP keys are informational here.
_ROUTER_KEYS = ("transfer_id", "remote_dp_size", "remote_tp_size", "remote_dp_rank")
PARAM_KEYS = _VLLM_KEYS + _RDMA_KEYS + _ROUTER_KEYS

MAX_GROUPS = 64  # KV-cache groups of a hybrid model: a handful in practice
MAX_BLOCK_IDS = 1 << 20  # a 16M-token prompt at block 16; anything above is an attack or a bug
_JSON_SAFE_INT = (1 << 53) - 1  # routers written in JS or Go may parse numbers as doubles


LEASE_TOKEN_BYTES = 16
_HEX_TOKEN = re.compile(f"[0-9a-fA-F]{{{2 * LEASE_TOKEN_BYTES}}}")
LEASE_BINDING_BYTES = 16
PROMPT_DIGEST_BYTES = 16
_HEX_DIGEST = re.compile(f"[0-9a-fA-F]{{{2 * PROMPT_DIGEST_BYTES}}}")


def prompt_digest(token_ids: Sequence[int], extra_keys: Sequence[Any] = ()) -> bytes:
    """A digest of the prompt whose KV is handed over: BLAKE2b (16 bytes)
    of the token count, then every token id as a little-endian int64, so
    both engines compute it alike whatever their platform, then, if the
    request has any, its ``extra_keys`` (``Request.extra_keys``: what else
    decides its KV, such as the LoRA adapter, each image's identifier, the
    cache salt, a hash of prompt embeddings). The producer's params carry it
    (``remote_prompt_digest``, covered by the lease's token) and the decode
    compares it with its own request's: KV computed for another prompt of
    the same length (params of another request, a retry's stale ones, a
    client that changed its prompt), or for the same token ids with another
    image, adapter or salt, is never loaded. A prompt without extra keys
    has the digest it had before they were bound (2026-12-01)."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    digest = hashlib.blake2b(struct.pack("<Q", len(ids)), digest_size=PROMPT_DIGEST_BYTES,
                             person=b"rdma-kv prompt 1")
    digest.update(ids.tobytes())
    if extra_keys:  # (after the ids, whose length the count fixes: unambiguous)
        digest.update(encode_extra_keys(extra_keys))
    return digest.digest()


def request_prompt_digest(request: Request) -> bytes:
    """:func:`prompt_digest` of ``request``'s prompt and extra keys, made
    once per prompt (kept in ``request.memo``, which an adapter's next
    ``Request`` for the same engine request shares: ``Request.with_params``)."""
    digest = request.memo.get("rdma.prompt_digest")
    if digest is None:
        digest = request.memo["rdma.prompt_digest"] = prompt_digest(request.prompt_token_ids,
                                                                    request.extra_keys)
    return digest


@dataclasses.dataclass(frozen=True)
class LeaseRef:
    """Names one lease on a producer: the producer scheduler's ``epoch``
    (random per process, so a restarted producer never confirms an old lease)
    and a ``generation`` unique within that epoch, plus the request id, the
    ``binding`` (:func:`lease_binding`: what the lease lets its holder read)
    and the ``token`` that proves the producer granted exactly that
    (:func:`lease_token`)."""

    epoch: int
    generation: int
    request_id: RequestId
    token: bytes = dataclasses.field(repr=False)
    binding: bytes = dataclasses.field(repr=False)


def lease_binding(engine_id: str, tp_size: int, num_tokens: int, block_ids: GroupBlockIds,
                  registration: int = 1, prompt: bytes = b"") -> bytes:
    """A digest of everything a lease lets its holder read: the producer
    engine, its tensor-parallel size, the prompt's token count, the block
    ids of every KV-cache group, in order, the registration of the
    producer's KV cache they index (bumped when it re-registers after sleep)
    and the digest of the prompt whose KV they hold (:func:`prompt_digest`).
    The grant token covers it, so params altered to name other blocks
    (another request's, or blocks reused since), or another prompt, fail the
    producer's check at every lease call, CONFIRM included: what was read
    under them is never used."""
    digest = hashlib.sha256(b"rdma-kv lease binding 2")
    name = engine_id.encode()
    digest.update(struct.pack(">QQQQQQ", len(name), tp_size, num_tokens, registration, len(block_ids),
                              len(prompt)) + name + prompt)
    for group in block_ids:
        digest.update(struct.pack(f">Q{len(group)}I", len(group), *group))
    return digest.digest()[:LEASE_BINDING_BYTES]


def lease_token(key: bytes, epoch: int, generation: int, request_id: str, binding: bytes) -> bytes:
    """The producer's proof that it granted lease ``(epoch, generation,
    request_id)`` over exactly ``binding`` (:func:`lease_binding`): an
    HMAC-SHA256 under the scheduler's per-epoch lease key, which only the
    producer engine's own processes know. A worker verifies it on every
    lease call, before it records anything, so a peer can neither claim,
    renew or release a lease by guessing the (sequential) generation, nor
    point a lease it holds at blocks it was not granted."""
    if len(binding) != LEASE_BINDING_BYTES:
        raise ValueError(f"a lease binding is {LEASE_BINDING_BYTES} bytes, got {len(binding)}")
    message = (b"rdma-kv lease 2" + struct.pack(">QQ", epoch, generation) + binding
               + request_id.encode())
    return hmac.new(key, message, hashlib.sha256).digest()[:LEASE_TOKEN_BYTES]


@dataclasses.dataclass(frozen=True)
class RemoteDecodeRequest:
    """A prefill request that asks the producer to keep its KV for a decoder;
    ``transfer_id``: a router dispatching both legs at once names the pair
    (push mode: the decode registers its blocks under it)."""

    transfer_id: str | None = None


@dataclasses.dataclass(frozen=True)
class ConcurrentPrefill:
    """A decode request dispatched together with its prefill (no params of
    the producer yet): its KV is pushed by the producer whose side channel
    the router named in the request id (:func:`router_address`), paired by
    ``transfer_id``."""

    transfer_id: str


ROUTER_ADDRESS_RE = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
"""How vllm-router (moriio mode) and Ray Serve name the prefill's registered
address inside the request id both legs carry (``X-Request-Id``)."""


def format_router_address(host: str, port: int, engine_id: str, tp_size: int) -> str:
    """What a push-mode engine registers with a router as its address
    (``zmq_address``): the side channel of its rank 0, its engine id and TP size."""
    if "___" in engine_id or "," in engine_id or ":" in engine_id:
        raise ConfigError(f"engine id {engine_id!r} cannot be carried in a router address "
                          "(no '___', ',' or ':' allowed)")
    return f"host:{host},handshake:{port},engine:{engine_id},tp:{tp_size}"


def router_address(request_id: str) -> tuple[str, int, str, int] | None:
    """(host, port, engine id, TP size) of the prefill named in ``request_id``
    by a concurrently dispatching router; None when it names none. Raises
    ``ConfigError`` for an address that is not :func:`format_router_address`'s."""
    match = ROUTER_ADDRESS_RE.search(request_id)
    if match is None:
        return None
    fields: dict[str, str] = {}
    for part in match.group(1).split(","):
        key, sep, value = part.partition(":")
        if sep:
            fields[key] = value
    try:
        port, tp = int(fields["handshake"]), int(fields.get("tp", "1"))
        host, engine = fields["host"], fields["engine"]
    except (KeyError, ValueError):
        raise ConfigError(f"the request id names prefill address {match.group(1)[:200]!r}; expected "
                          "'host:H,handshake:PORT,engine:ID,tp:N' (what an rdma-kv producer registers)") from None
    if not (host and engine and 0 < port < 65536 and 0 < tp <= 1024):
        raise ConfigError(f"the request id names prefill address {match.group(1)[:200]!r}: bad host, port, "
                          "engine or tp")
    return host, port, engine, tp


@dataclasses.dataclass(frozen=True)
class RemotePrefillParams:
    """What a producer returns for a finished prefill; the decode request carries it."""

    remote_engine_id: EngineId
    remote_host: str
    remote_port: int
    remote_block_ids: GroupBlockIds
    """Per KV-cache group, the producer's blocks of the prompt in token order,
    ending with the block of the last prompt token; a sliding-window group's
    list leaves out the leading blocks outside the window (``to_dict``: a
    flat list for one group, a list of lists for several)."""
    remote_request_id: RequestId
    tp_size: int
    remote_lease_epoch: int
    remote_lease_generation: int
    remote_lease_token: bytes
    remote_lease_ttl_s: float
    remote_num_tokens: int
    """Prompt tokens whose KV the remote blocks hold."""
    remote_prompt_digest: bytes
    """:func:`prompt_digest` of those tokens (the whole prompt): the decode
    loads only for a prompt of this digest; the lease's token covers it."""
    remote_registration: int = 1
    """The producer's KV-cache registration the block ids index: 1 from its
    start, bumped each time it re-registers (vLLM sleep mode). A consumer
    whose cached peer is of another registration handshakes again, and
    params of an older one are a load error, never a read."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "remote_block_ids", as_group_block_ids(self.remote_block_ids))
        if len(self.remote_lease_token) != LEASE_TOKEN_BYTES:  # the wire refuses any other length
            raise ConfigError(f"a lease token is {LEASE_TOKEN_BYTES} bytes, got {len(self.remote_lease_token)}")
        if len(self.remote_prompt_digest) != PROMPT_DIGEST_BYTES:
            raise ConfigError(f"a prompt digest is {PROMPT_DIGEST_BYTES} bytes, got {len(self.remote_prompt_digest)}")

    @functools.cached_property
    def binding(self) -> bytes:
        """What these params let their holder read (:func:`lease_binding`)."""
        return lease_binding(self.remote_engine_id, self.tp_size, self.remote_num_tokens,
                             self.remote_block_ids, self.remote_registration, self.remote_prompt_digest)

    @property
    def lease(self) -> LeaseRef:
        return LeaseRef(self.remote_lease_epoch, self.remote_lease_generation,
                        self.remote_request_id, self.remote_lease_token, self.binding)

    def to_dict(self) -> dict[str, Any]:
        """A new JSON-compatible dict in vLLM's P/D convention."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_block_ids": ([int(b) for b in self.remote_block_ids[0]]
                                 if len(self.remote_block_ids) == 1
                                 else [[int(b) for b in group] for group in self.remote_block_ids]),
            "remote_request_id": self.remote_request_id,
            "tp_size": self.tp_size,
            "remote_lease_epoch": self.remote_lease_epoch,
            "remote_lease_generation": self.remote_lease_generation,
            "remote_lease_token": self.remote_lease_token.hex(),
            "remote_lease_ttl_s": self.remote_lease_ttl_s,
            "remote_num_tokens": self.remote_num_tokens,
            "remote_prompt_digest": self.remote_prompt_digest.hex(),
            "remote_registration": self.remote_registration,
        }


def _field_error(field: str, value: Any, expected: str) -> ConfigError:
    if isinstance(value, (list, tuple)) and len(value) > 8:  # a client's list: never repr it whole
        shown = f"{type(value).__name__} of {len(value)} starting {value[:8]!r}"
    else:
        shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"kv_transfer_params[{field!r}] must be {expected}, got {shown}")


def _whole(value: Any) -> Any:
    """A float that is a whole number below 2**53 as that integer (a
    protobuf ``Struct``, as gRPC P/D workers carry params, has only
    doubles: 5600 arrives as 5600.0); any other value as it is. Exact: a
    double holds every integer below 2**53, and the lease's token covers
    the integers it was issued for."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2.0 ** 53:
        return int(value)
    return value


def _int(params: Mapping[str, Any], field: str, lo: int, hi: int) -> int:
    value = _whole(params.get(field))
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _field_error(field, value, f"an integer in [{lo}, {hi}]")
    return value


def _str(params: Mapping[str, Any], field: str, max_len: int = 256) -> str:
    value = params.get(field)
    expected = f"a non-empty string of at most {max_len} characters"
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise _field_error(field, value, expected)
    try:  # JSON can carry a lone surrogate ("\ud800"), which no wire or digest can encode
        value.encode()
    except UnicodeEncodeError:
        raise _field_error(field, value, expected + " (valid Unicode, without lone surrogates)") from None
    return value


def other_prompt(params: RemotePrefillParams, request: Request) -> str | None:
    """Why ``params`` are not loaded for ``request``: they hold the KV of
    another prompt (None if of this one)."""
    mine = request_prompt_digest(request)
    if hmac.compare_digest(params.remote_prompt_digest, mine):
        return None
    return (f"kv_transfer_params['remote_prompt_digest'] is {params.remote_prompt_digest.hex()}, the digest of "
            f"another {params.remote_num_tokens}-token prompt than this request's ({mine.hex()}): the params hold "
            f"the KV of another prompt, or of these token ids with another image, LoRA adapter or cache salt (the "
            f"prefill of request {params.remote_request_id[:200]!r}), which is not loaded. A router must send the "
            "decode the same prompt as its prefill, with that prefill's params (not another request's, nor ones "
            "kept from an earlier attempt), and both engines must name the LoRA adapter alike")


def _token(params: Mapping[str, Any], field: str) -> bytes:
    value = params.get(field)
    expected = f"{2 * LEASE_TOKEN_BYTES} hex digits (the producer's request_finished output, verbatim)"
    # fullmatch, not bytes.fromhex alone: fromhex skips whitespace, so
    # 30 digits and 2 blanks would make a 15-byte token, which the
    # producer's schema refuses for the whole batch of lease calls it
    # travels in (other requests' CONFIRMs with it).
    if not isinstance(value, str) or _HEX_TOKEN.fullmatch(value) is None:
        raise _field_error(field, value, expected)
    return bytes.fromhex(value)


def _digest(params: Mapping[str, Any], field: str) -> bytes:
    value = params.get(field)
    if not isinstance(value, str) or _HEX_DIGEST.fullmatch(value) is None:
        raise _field_error(field, value, f"{2 * PROMPT_DIGEST_BYTES} hex digits (the producer's request_finished "
                                         "output, verbatim; a producer older than side-channel protocol 11 sends "
                                         "none: run the same rdma-kv version on both engines)")
    return bytes.fromhex(value)


def _flag(params: Mapping[str, Any], field: str) -> bool:
    value = params.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _field_error(field, value, "true, false or null")
    return value


def _block_id_groups(ids: Any, max_per_group: int) -> GroupBlockIds:
    """``remote_block_ids``: a flat list (one KV-cache group) or a list of
    per-group lists (hybrid models), at most ``MAX_GROUPS`` groups and
    ``MAX_BLOCK_IDS`` ids in all, each in [0, 2**32); one group may be
    empty (a window that holds no block), not all. No group has more than
    ``max_per_group`` ids (a block holds at least one token: a producer
    never offers more blocks than the prompt has tokens), checked before
    any id is looked at (a million ids take half a second to walk)."""
    expected = (f"a non-empty list of at most {MAX_BLOCK_IDS} block ids, or a list of at most "
                f"{MAX_GROUPS} such lists (one per KV-cache group)")
    if not isinstance(ids, (list, tuple)) or not ids:
        raise _field_error("remote_block_ids", ids, expected)
    nested = isinstance(ids[0], (list, tuple))
    groups = ids if nested else [ids]
    if len(groups) > MAX_GROUPS or sum(len(g) if isinstance(g, (list, tuple)) else 1
                                       for g in groups) > MAX_BLOCK_IDS:
        raise _field_error("remote_block_ids", ids, expected)
    longest = max(len(g) if isinstance(g, (list, tuple)) else 1 for g in groups)
    if longest > max_per_group:
        raise _field_error("remote_block_ids", ids, f"at most {max_per_group} block ids per KV-cache group (a "
                                                    "block holds at least one token of the prompt), not "
                                                    f"{longest}")
    out = []
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise _field_error("remote_block_ids", ids, "a flat list of block ids or a list of lists, "
                                                        "not a mix of both")
        if plain_ints_in(group, 0, 1 << 32):
            out.append(tuple(group))  # plain ints (JSON's)
            continue
        for value in map(_whole, group):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
                raise _field_error("remote_block_ids", ids, "integers in [0, 2**32)")
        out.append(tuple(BlockId(_whole(b)) for b in group))
    if not any(groups):
        raise _field_error("remote_block_ids", ids, expected)
    return tuple(out)


def parse_kv_transfer_params(
    params: Mapping[str, Any] | None, *, max_block_ids: int | None = None,
) -> RemoteDecodeRequest | RemotePrefillParams | ConcurrentPrefill | None:
    """Parse a request's ``kv_transfer_params``: ``None`` when they ask for
    nothing from this connector, else the typed form. Raises ``ConfigError``
    naming the field and the valid values; never mutates ``params``.
    ``max_block_ids``: refuse more block ids per KV-cache group than that
    (the consumer passes its request's prompt length: no producer offers
    more blocks than tokens, whatever ``remote_num_tokens`` a client wrote)."""
    if params is None:
        return None
    if not isinstance(params, Mapping):  # before len(): any object may arrive here, an int has no len()
        raise ConfigError(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
    if len(params) == 0:
        return None
    unknown = sorted(str(k)[:64] for k in params if k not in PARAM_KEYS)
    if unknown:
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise ConfigError(  # bounded: the keys come from a client request
            f"unknown kv_transfer_params key(s) {unknown[:8]}{more}; valid keys are {list(PARAM_KEYS)}"
        )
    decode, prefill = _flag(params, "do_remote_decode"), _flag(params, "do_remote_prefill")
    if decode and prefill:
        raise ConfigError(
            "kv_transfer_params sets both do_remote_decode and do_remote_prefill; a request "
            "is either a prefill for a remote decoder or a decode of a remote prefill"
        )
    transfer_id = params.get("transfer_id")
    if transfer_id is not None:
        transfer_id = _str(params, "transfer_id", 256)
    if decode:
        return RemoteDecodeRequest(transfer_id)
    if not prefill:
        return None
    if transfer_id is not None and params.get("remote_engine_id") is None:
        return ConcurrentPrefill(transfer_id)  # the producer's params never come: it pushes
    bound = MAX_BLOCK_IDS  # ids per group: no more than the prompt's tokens (checked below, in field order)
    stated = _whole(params.get("remote_num_tokens"))
    if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 1:
        bound = min(bound, stated)
    if max_block_ids is not None:
        bound = min(bound, max(1, max_block_ids))
    groups = _block_id_groups(params.get("remote_block_ids"), bound)
    ttl = params.get("remote_lease_ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not MIN_LEASE_TTL_S <= ttl <= MAX_LEASE_TTL_S:
        raise _field_error("remote_lease_ttl_s", ttl,
                           f"a number of seconds in [{MIN_LEASE_TTL_S:g}, {MAX_LEASE_TTL_S:g}], the producer's "
                           f"lease_ttl_s (the consumer renews at a third of it)")
    num_tokens = _int(params, "remote_num_tokens", 1, MAX_BLOCK_IDS * 1024)
    port, tp_size = _int(params, "remote_port", 1, 65535), _int(params, "tp_size", 1, 1024)
    if port + tp_size - 1 > 65535:  # rank r's side channel is port + r: past 65535 it wrapped to another port
        raise _field_error("remote_port", port, f"a port whose producer ranks' ports (+ 0 .. {tp_size - 1}, "
                                                f"tp_size {tp_size}) stay within 65535")
    return RemotePrefillParams(
        remote_engine_id=EngineId(_str(params, "remote_engine_id")),
        remote_host=_str(params, "remote_host"),
        remote_port=port,
        remote_block_ids=groups,
        remote_request_id=RequestId(_str(params, "remote_request_id", 1024)),
        tp_size=tp_size,
        remote_lease_epoch=_int(params, "remote_lease_epoch", 1, _JSON_SAFE_INT),
        remote_lease_generation=_int(params, "remote_lease_generation", 1, _JSON_SAFE_INT),
        remote_lease_token=_token(params, "remote_lease_token"),
        remote_lease_ttl_s=float(ttl),
        remote_num_tokens=num_tokens,
        remote_prompt_digest=_digest(params, "remote_prompt_digest"),
        remote_registration=_int(params, "remote_registration", 1, _JSON_SAFE_INT)
        if params.get("remote_registration") is not None else 1,
    )
