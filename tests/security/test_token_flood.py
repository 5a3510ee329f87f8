"""Lease calls of made-up tokens from peers that proved nothing.

Without a shared secret any peer may send RENEW, CONFIRM and RELEASE, and
each lease it names costs the producer an HMAC (its token's) on the side
channel's one loop thread: before, a call of 4,096 made-up tokens cost
4,096 of them (and 4,096 records built), 64 such connections delayed a
legitimate decode's RENEW by 0.8 s at the median (``bench/experiments/token_flood.py``).
The table now stops verifying a call at its ``WRONG_TOKENS_PER_CALL``-th
token that does not verify and answers the rest PENDING unverified
(nothing recorded: the caller asks again). Counted, not timed: HMACs
computed and records built per flood call; what a valid caller is answered."""

from __future__ import annotations

import os
import socket
import time

import pytest
from leaseutil import EPOCH, HELD, PENDING, UNKNOWN, A, ref, state, table_with
from rdma_testutil import frame

from rdma_kv.connector.rdma import framing, leases, leasetokens, producer, wire
from rdma_kv.connector.rdma.leases import LeaseCall
from rdma_kv.connector.rdma.params import LeaseRef
from rdma_kv.connector.rdma.producer import ProducerHandler
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.types import EngineId

pytestmark = pytest.mark.timeout(60)

COMPAT = wire.CompatInfo(1, 16, 8, 128, "float16", "x", ["blocks_first:1"])
FLOOD = wire.MAX_LEASES_PER_MESSAGE
WRONG_TOKENS_PER_CALL = getattr(leases, "WRONG_TOKENS_PER_CALL", 8)  # (the old tree: fails, not errors)


def WireCalls(leases):  # noqa: N802
    """A call's leases as the producer's handler hands them to the table."""
    return producer._calls(wire.Renew(wire.PROTOCOL_VERSION, leases))


def made_up(n, first=1000):
    """``n`` leases of the table's epoch with tokens the producer never issued."""
    return [wire.LeaseWire(EPOCH, first + i, f"x{i}", os.urandom(16), os.urandom(16), A) for i in range(n)]


def genuine(gen):
    return wire.LeaseWire.of(ref(gen), A)


@pytest.fixture
def hmacs(monkeypatch):
    """How many lease tokens the table computed (an HMAC each)."""
    count = [0]
    real = leases.lease_token

    def counted(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(leases, "lease_token", counted)  # under the lock (a new epoch meanwhile)
    monkeypatch.setattr(leasetokens, "lease_token", counted)  # before it
    return count


@pytest.fixture
def built(monkeypatch):
    """How many ``LeaseCall`` records the producer built from the wire."""
    count = [0]

    class Counted(LeaseCall):
        def __post_init__(self):
            count[0] += 1
            super().__post_init__()

    monkeypatch.setattr(producer, "LeaseCall", Counted)
    return count


@pytest.mark.parametrize("kind", ["renew", "pin", "confirm", "release"])
def test_a_call_of_made_up_tokens_costs_a_bounded_number_of_hmacs_and_records_nothing(hmacs, built, kind):
    table = table_with(1, 2)
    before = state(table)
    calls = WireCalls(made_up(FLOOD))
    statuses = {"renew": lambda: table.renew(calls), "pin": lambda: table.pin(calls)[0],
                "confirm": lambda: table.confirm(calls, release=True), "release": lambda: table.release(calls)}[kind]()
    assert statuses == [UNKNOWN] * WRONG_TOKENS_PER_CALL + [PENDING] * (FLOOD - WRONG_TOKENS_PER_CALL)
    assert hmacs[0] == WRONG_TOKENS_PER_CALL  # was 4,096
    assert built[0] == WRONG_TOKENS_PER_CALL
    assert state(table) == before
    assert table.stats.refused_unknown == WRONG_TOKENS_PER_CALL
    assert getattr(table.stats, "unverified", None) == FLOOD - WRONG_TOKENS_PER_CALL


def test_a_valid_callers_batch_with_fewer_altered_params_is_answered_in_full(hmacs):
    table = table_with(1, 2, 3)
    wrong = made_up(WRONG_TOKENS_PER_CALL - 1)
    batch = [genuine(1), *wrong[:3], genuine(2), *wrong[3:], genuine(3)]
    statuses = table.renew(WireCalls(batch))
    assert statuses == [HELD] + [UNKNOWN] * 3 + [HELD] + [UNKNOWN] * (WRONG_TOKENS_PER_CALL - 4) + [HELD]
    assert hmacs[0] == len(batch)
    assert getattr(table.stats, "unverified", 0) == 0


def test_leases_after_the_last_wrong_token_are_pending_and_answered_when_asked_again():
    """A batch that carries WRONG_TOKENS_PER_CALL altered params sets before a
    genuine lease: that lease is answered PENDING, unclaimed; the consumer,
    told which were UNKNOWN, asks again without them and is answered HELD."""
    table = table_with(1)
    statuses = table.confirm(WireCalls([*made_up(WRONG_TOKENS_PER_CALL), genuine(1)]), release=False)
    assert statuses == [UNKNOWN] * WRONG_TOKENS_PER_CALL + [PENDING]
    assert table.leases()[0].claim is None  # nothing recorded for the lease not verified
    assert table.confirm(WireCalls([genuine(1)]), release=True) == [HELD]
    assert table.take_done() == {"r1"}


def test_the_bound_holds_when_the_epoch_changes_between_the_tokens_and_the_lock(hmacs, monkeypatch):
    """A new epoch while the tokens were computed: they are computed again
    under the lock, still only up to the last wrong token."""
    table = table_with(1)
    real = leasetokens.expected_tokens

    def then_new_epoch(calls, epoch, key):
        out = real(calls, epoch, key)
        table.set_epoch(EPOCH + 1, b"n" * 32)
        return out

    monkeypatch.setattr(leases, "expected_tokens", then_new_epoch)
    flood = [wire.LeaseWire(EPOCH + 1, 1000 + i, f"x{i}", os.urandom(16), os.urandom(16), A) for i in range(64)]
    statuses = table.renew(WireCalls([*made_up(3), *flood]))
    # Before: the first 3 are checked under the old key (wrong), the flood's (another epoch) not at all;
    # under the lock, the new epoch's: the first 3 are GONE, the flood's wrong tokens count.
    assert statuses == [wire.LeaseStatus.GONE] * 3 + [UNKNOWN] * WRONG_TOKENS_PER_CALL + \
        [PENDING] * (64 - WRONG_TOKENS_PER_CALL)
    assert hmacs[0] == 3 + WRONG_TOKENS_PER_CALL


def test_a_list_of_calls_is_bounded_too(hmacs):
    """Callers that pass LeaseCalls (tests, the push path) get the same rule."""
    table = table_with(1)
    calls = [LeaseCall(LeaseRef(EPOCH, 1000 + i, f"x{i}", os.urandom(16), os.urandom(16)), A) for i in range(100)]
    assert table.release(iter(calls)) == [UNKNOWN] * WRONG_TOKENS_PER_CALL + [PENDING] * (100 - WRONG_TOKENS_PER_CALL)
    assert hmacs[0] == WRONG_TOKENS_PER_CALL


def _exchange(sock, message):
    sock.sendall(frame(message))
    body = framing.recv_frame(sock, wire.MAX_REPLY_BYTES, "test", deadline=time.monotonic() + 20)
    assert body is not None, "the server closed the connection instead of answering"
    return wire.decode_reply(body)


def test_over_the_side_channel_an_unauthenticated_flood_call_costs_a_bounded_number_of_hmacs(hmacs):
    """No secret: a peer that proved nothing sends the largest RENEW the wire
    takes, all made-up tokens, then a legitimate decode renews its lease."""
    table = table_with(1)
    handler = ProducerHandler(EngineId("P"), wire.RankInfo(0, 1, 8), 30.0, table, COMPAT, lambda: b"md", None)
    with SideChannelServer(handler, "127.0.0.1", 0) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as attacker:
            assert isinstance(_exchange(attacker, wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32))),
                              wire.Challenge)
            reply = _exchange(attacker, wire.Renew(wire.PROTOCOL_VERSION, made_up(FLOOD)))
            assert isinstance(reply, wire.LeaseReply)
            assert reply.statuses == [UNKNOWN] * WRONG_TOKENS_PER_CALL + [PENDING] * (FLOOD - WRONG_TOKENS_PER_CALL)
            assert hmacs[0] == WRONG_TOKENS_PER_CALL
            assert server.stats.unknown == WRONG_TOKENS_PER_CALL and server.stats.trusted == 0
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as decode:
            _exchange(decode, wire.Hello(wire.PROTOCOL_VERSION, "consumer", os.urandom(32)))
            reply = _exchange(decode, wire.Renew(wire.PROTOCOL_VERSION, [genuine(1)]))
            assert isinstance(reply, wire.LeaseReply) and reply.statuses == [HELD]

