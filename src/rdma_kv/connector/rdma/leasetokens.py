"""Which tokens of a lease call to check, computed before the lease table's lock is taken.

A token is an HMAC (``params.lease_token``) of the lease's epoch,
generation, request id and binding under the epoch's key. The table
compares each call's token with the one computed here, under its lock
(``leases.LeaseTable._each``); computing them there took 15 ms for 4,096
made-up leases, under the lock the engine thread's ``take_done`` and step
wait for. A call is examined only up to its ``WRONG_TOKENS_PER_CALL``-th
token that does not verify: a peer that proved nothing must not make one
call cost an HMAC per lease it names.

Imports the standard library and the connector's ``params`` and
``rdma.leaserecords``.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from rdma_kv.connector.rdma.leaserecords import LeaseCall
from rdma_kv.connector.rdma.params import lease_token

__all__ = ["WRONG_TOKENS_PER_CALL", "expected_tokens"]

WRONG_TOKENS_PER_CALL = 8
"""Tokens that do not verify (UNKNOWN, FORGED) a call is answered for; its
leases after the last are answered PENDING, unverified and unrecorded: each
token is an HMAC on the side channel's loop thread, and a peer that proved
nothing made a call of 4,096 made-up tokens cost 4,096."""


def expected_tokens(calls: Sequence[LeaseCall], epoch: int | None,
                    key: bytes) -> tuple[list[LeaseCall], list[bytes | None]]:
    """The calls to examine, in order, up to and with the
    ``WRONG_TOKENS_PER_CALL``-th whose token does not verify under
    ``epoch``'s ``key``, and the token each call's lease would have (None
    where the table answers without one: no epoch yet, or another epoch's
    lease). No lock needed."""
    examined: list[LeaseCall] = []
    tokens: list[bytes | None] = []
    wrong = 0
    for i in range(len(calls)):
        if wrong == WRONG_TOKENS_PER_CALL:
            break
        call = calls[i]
        ref = call.ref
        token = None
        if epoch is not None and ref.epoch == epoch:
            token = lease_token(key, ref.epoch, ref.generation, ref.request_id, ref.binding)
            wrong += not hmac.compare_digest(token, ref.token)
        examined.append(call)
        tokens.append(token)
    return examined, tokens
