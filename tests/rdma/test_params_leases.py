"""kv_transfer_params parsing and the producer's lease table (no UCX, no sockets)."""

from __future__ import annotations

import copy

import pytest

from rdma_kv.connector.rdma.leases import LeaseTable
from rdma_kv.connector.rdma.params import (
    LeaseRef,
    RemoteDecodeRequest,
    RemotePrefillParams,
    parse_kv_transfer_params,
)
from rdma_kv.connector.rdma.wire import LeaseStatus
from rdma_kv.errors import ConfigError

HELD, PENDING, GONE = LeaseStatus.HELD, LeaseStatus.PENDING, LeaseStatus.GONE


def producer_params(**changes):
    params = RemotePrefillParams("P", "127.0.0.1", 5000, (3, 4, 9), "req-1", 1, 77, 5, 30.0, 40).to_dict()
    params.update(changes)
    return params


def test_round_trip_and_never_mutates():
    params = producer_params()
    before = copy.deepcopy(params)
    parsed = parse_kv_transfer_params(params)
    assert params == before
    assert isinstance(parsed, RemotePrefillParams)
    assert parsed.remote_block_ids == (3, 4, 9) and parsed.lease == LeaseRef(77, 5, "req-1")
    assert parsed.to_dict() == params  # verbatim forwarding reproduces the same value


def test_prefill_request_shapes_routers_send():
    assert isinstance(parse_kv_transfer_params({"do_remote_decode": True}), RemoteDecodeRequest)
    # vLLM's example proxy sends the remote_* keys as null on the prefill request
    proxy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert isinstance(parse_kv_transfer_params(proxy), RemoteDecodeRequest)
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({}) is None
    assert parse_kv_transfer_params({"do_remote_decode": False}) is None


@pytest.mark.parametrize("changes, field", [
    ({"remote_port": "5000"}, "remote_port"),
    ({"remote_port": 0}, "remote_port"),
    ({"remote_block_ids": []}, "remote_block_ids"),
    ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({"remote_block_ids": [1, True]}, "remote_block_ids"),
    ({"remote_engine_id": ""}, "remote_engine_id"),
    ({"remote_lease_generation": None}, "remote_lease_generation"),
    ({"remote_lease_ttl_s": 0}, "remote_lease_ttl_s"),
    ({"tp_size": 0}, "tp_size"),
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
])
def test_bad_fields_are_named(changes, field):
    with pytest.raises(ConfigError, match=field):
        parse_kv_transfer_params(producer_params(**changes))


def test_unknown_keys_and_conflicts():
    with pytest.raises(ConfigError, match=r"unknown kv_transfer_params key\(s\) \['bogus'\]; valid keys"):
        parse_kv_transfer_params({"do_remote_decode": True, "bogus": 1})
    with pytest.raises(ConfigError, match="both do_remote_decode and do_remote_prefill"):
        parse_kv_transfer_params(producer_params(do_remote_decode=True))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def ref(gen, rid=None, epoch=7):
    return LeaseRef(epoch, gen, rid or f"r{gen}")


def test_lease_life_cycle():
    clock = Clock()
    table = LeaseTable(clock)
    table.set_epoch(7)
    table.grant(ref(1), [1, 2], 10.0)
    table.grant(ref(2), [3], 10.0)
    assert table.renew([ref(1), ref(2), ref(3)]) == [HELD, HELD, PENDING]  # 3: granted, not shipped yet
    assert table.confirm([ref(1)], release=True) == [HELD]
    assert table.take_done() == {"r1"}
    # a retried CONFIRM (first reply lost) still reads HELD; a fresh RENEW does not
    assert table.confirm([ref(1)], release=True) == [HELD]
    assert table.renew([ref(1)]) == [GONE]
    assert table.release([ref(2)]) == [HELD]
    assert table.take_done() == {"r2"} and len(table) == 0
    assert table.release([ref(2)]) == [GONE]  # idempotent


def test_wrong_request_or_epoch_is_gone():
    table = LeaseTable(Clock())
    table.set_epoch(7)
    table.grant(ref(1), [1], 10.0)
    assert table.confirm([ref(1, rid="other")], release=False) == [GONE]
    assert table.confirm([ref(1, epoch=8)], release=False) == [GONE]  # a restarted producer
    assert LeaseTable(Clock()).confirm([ref(1)], release=False) == [PENDING]  # no epoch yet


def test_reaper_does_not_assume_sorted_expiries():
    clock = Clock()
    table = LeaseTable(clock)
    table.set_epoch(7)
    table.grant(ref(1), [1], 10.0)  # expires 1010
    table.grant(ref(2), [2], 2.0)  # expires 1002: after 1 in grant order
    table.grant(ref(3), [3], 5.0)
    clock.t = 1004
    assert table.renew([ref(3)]) == [HELD]  # now expires 1009
    assert table.expire() == ["r2"]
    clock.t = 1008.5
    assert table.expire() == []  # 3 was renewed; its old heap entry (1005) is re-checked
    clock.t = 1009
    assert table.expire() == ["r3"]
    clock.t = 1010
    assert table.expire() == ["r1"]
    assert table.take_done() == {"r1", "r2", "r3"}


def test_late_confirm_after_expiry_fails():
    clock = Clock()
    table = LeaseTable(clock)
    table.set_epoch(7)
    table.grant(ref(1), [1, 2], 1.0)
    clock.t += 1.5  # the consumer's reads were slow; nobody reaped yet
    assert table.confirm([ref(1)], release=True) == [GONE]  # confirm applies expiry first
    assert table.take_done() == {"r1"}
    assert table.held_block_ids() == set()


def test_pending_lease_confirmed_before_its_grant_is_freed_by_the_grant():
    # vLLM stops stepping when no request is left, so the last prefill's grant
    # reaches the worker only with the next request: a consumer must be able
    # to confirm and release the lease before that (docs/vllm-notes.md, 4).
    table = LeaseTable(Clock())
    table.set_epoch(7)
    table.grant(ref(1), [1], 10.0)
    assert table.confirm([ref(2), ref(3)], release=True) == [HELD, HELD]  # granted, not shipped
    assert table.confirm([ref(2)], release=True) == [HELD]  # a retry still reads HELD
    assert table.release([ref(4)]) == [PENDING]  # released unread before its grant
    assert table.renew([ref(5)]) == [PENDING]
    assert table.take_done() == set() and len(table) == 1
    table.grant(ref(2), [2], 10.0)
    table.grant(ref(3, rid="other"), [3], 10.0)  # not the request that was confirmed: held
    table.grant(ref(4), [4], 10.0)
    table.grant(ref(5), [5], 10.0)
    assert table.take_done() == {"r2", "r4"}
    assert sorted(lease.ref.generation for lease in table.leases()) == [1, 3, 5]
    assert table.confirm([ref(2)], release=True) == [HELD]  # retry after the grant
    assert table.confirm([ref(9, epoch=8)], release=True) == [GONE]  # another epoch
