"""The bytes of a request's ``extra_keys`` (``Request.extra_keys``: what
besides its token ids decides its KV) that the connectors' digests cover:
the RDMA connector's prompt digest (``rdma.params.prompt_digest``) and the
storage connector's block keys.

Imports the standard library and msgspec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = ["encode_extra_keys"]

_ENCODER = msgspec.msgpack.Encoder(enc_hook=repr)
"""Tuples of strings, numbers, bytes and None as MessagePack, the same on
every platform; any other object by its ``repr`` (one that names its
address then matches nothing, and its loads are refused: never a wrong
load). :func:`_canonical` first rewrites what MessagePack cannot hold or
would write in a process-dependent order."""


def _canonical(key: Any) -> Any:
    """``key`` with each int beyond MessagePack's 64 bits as extension 1
    (its decimal digits: MessagePack raised OverflowError, out of the
    engine's step) and each set or frozenset as extension 2 (its items'
    encodings, sorted: their iteration order follows the process's hash
    seed, so two engines digested one request differently). Other values
    are returned as they are, so the encoding of any key MessagePack held
    before is unchanged."""
    if isinstance(key, tuple | list):
        return tuple(map(_canonical, key))
    if isinstance(key, int) and not isinstance(key, bool) and not -(1 << 63) <= key < 1 << 64:
        return msgspec.msgpack.Ext(1, str(int(key)).encode())
    if isinstance(key, set | frozenset):
        return msgspec.msgpack.Ext(2, _ENCODER.encode(sorted(_ENCODER.encode(_canonical(k)) for k in key)))
    return key


def encode_extra_keys(extra_keys: Sequence[Any]) -> bytes:
    """MessagePack of ``tuple(extra_keys)``, canonical (see ``_canonical``)."""
    return _ENCODER.encode(_canonical(tuple(extra_keys)))
