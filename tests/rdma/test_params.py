"""kv_transfer_params parsing (no UCX, no sockets); the lease table is tests/rdma/test_leases.py."""

from __future__ import annotations

import copy

import pytest

from rdma_kv.connector.rdma.params import (
    LeaseRef,
    RemoteDecodeRequest,
    RemotePrefillParams,
    lease_binding,
    parse_kv_transfer_params,
)
from rdma_kv.errors import ConfigError

TOKEN = bytes(range(16))
DIGEST = bytes(range(16, 32))


def producer_params(**changes):
    params = RemotePrefillParams("P", "127.0.0.1", 5000, (3, 4, 9), "req-1", 1, 77, 5, TOKEN, 30.0, 40,
                                 DIGEST).to_dict()
    params.update(changes)
    return params


def test_round_trip_and_never_mutates():
    params = producer_params()
    before = copy.deepcopy(params)
    parsed = parse_kv_transfer_params(params)
    assert params == before
    assert isinstance(parsed, RemotePrefillParams)
    binding = lease_binding("P", 1, 40, ((3, 4, 9),), 1, DIGEST)
    assert parsed.remote_block_ids == ((3, 4, 9),) and parsed.lease == LeaseRef(77, 5, "req-1", TOKEN, binding)
    assert parsed.to_dict() == params  # verbatim forwarding reproduces the same value


@pytest.mark.parametrize("changes", [
    {"remote_block_ids": [3, 4, 10]},  # another request's block
    {"remote_block_ids": [3, 4]},  # fewer
    {"remote_block_ids": [4, 3, 9]},  # reordered
    {"remote_block_ids": [[3, 4, 9], []]},  # another group structure
    {"remote_block_ids": [[3, 4], [9]]},
    {"remote_num_tokens": 41},
    {"remote_prompt_digest": "00" * 16},  # another prompt's
    {"remote_engine_id": "P2"},
    {"tp_size": 2},
])
def test_the_binding_covers_every_field_that_says_what_to_read(changes):
    genuine = parse_kv_transfer_params(producer_params()).lease
    altered = parse_kv_transfer_params(producer_params(**changes)).lease
    assert altered.binding != genuine.binding
    # What does not say what to read (where to dial, the TTL) is not bound:
    # another producer has another key; the TTL only paces renewals.
    moved = parse_kv_transfer_params(producer_params(remote_host="10.0.0.9", remote_port=6000,
                                                     remote_lease_ttl_s=5)).lease
    assert moved.binding == genuine.binding


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
    # plain ints are checked in bulk (min, max): both ends of the range still hold
    ({"remote_block_ids": [1, 1 << 32]}, "remote_block_ids"),
    ({"remote_block_ids": [[1, 2], [3, -1]]}, "remote_block_ids"),
    ({"remote_engine_id": ""}, "remote_engine_id"),
    ({"remote_lease_generation": None}, "remote_lease_generation"),
    ({"remote_lease_ttl_s": 0}, "remote_lease_ttl_s"),
    # The consumer renews at a third of the TTL the params name: a crafted
    # 1e-9 would make every engine step a RENEW to the producer.
    ({"remote_lease_ttl_s": 1e-9}, "remote_lease_ttl_s"),
    ({"remote_lease_ttl_s": 0.99}, "remote_lease_ttl_s"),
    ({"remote_lease_ttl_s": 86400.5}, "remote_lease_ttl_s"),
    ({"remote_lease_token": None}, "remote_lease_token"),
    # a producer older than protocol 11 names no prompt digest
    ({"remote_prompt_digest": None}, "remote_prompt_digest"),
    ({"remote_prompt_digest": "ab" * 15 + "  "}, "remote_prompt_digest"),
    ({"remote_lease_token": "ab" * 15}, "remote_lease_token"),
    ({"remote_lease_token": "zz" * 16}, "remote_lease_token"),
    # 32 characters that bytes.fromhex reads as 15 bytes (it skips blanks):
    # the producer's schema would refuse the whole batch of lease calls
    # this token travelled in, other requests' CONFIRMs with it.
    ({"remote_lease_token": "ab" * 15 + "  "}, "remote_lease_token"),
    ({"remote_lease_token": " " + "ab" * 15 + "\n"}, "remote_lease_token"),
    # JSON's "\ud800": a str no digest or wire encoding takes (it crashed the
    # scheduler's lease lookup, or failed a batch of CONFIRMs).
    ({"remote_engine_id": "P\ud800"}, "remote_engine_id"),
    ({"remote_request_id": "req-1\udcff"}, "remote_request_id"),
    ({"remote_host": "\ud800.example"}, "remote_host"),
    ({"transfer_id": "t\ud800"}, "transfer_id"),
    ({"tp_size": 0}, "tp_size"),
    # rank r's side channel is remote_port + r: past 65535 the consumer dialled a wrapped port
    ({"remote_port": 65535, "tp_size": 2}, "remote_port"),
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
])
def test_bad_fields_are_named(changes, field):
    with pytest.raises(ConfigError, match=field):
        parse_kv_transfer_params(producer_params(**changes))


def test_a_token_of_another_length_is_refused_at_construction():
    with pytest.raises(ConfigError, match="a lease token is 16 bytes, got 15"):
        RemotePrefillParams("P", "127.0.0.1", 5000, (3,), "req-1", 1, 77, 5, TOKEN[:15], 30.0, 40, DIGEST)


def test_unknown_keys_and_conflicts():
    with pytest.raises(ConfigError, match=r"unknown kv_transfer_params key\(s\) \['bogus'\]; valid keys"):
        parse_kv_transfer_params({"do_remote_decode": True, "bogus": 1})
    with pytest.raises(ConfigError, match="both do_remote_decode and do_remote_prefill"):
        parse_kv_transfer_params(producer_params(do_remote_decode=True))


def test_whole_numbers_as_floats_are_read_as_integers():
    """A protobuf Struct (gRPC P/D workers: vllm-router's, SMG's) carries
    every number as a double: the decode gets remote_port 5000.0 and block
    ids 3.0. Read exactly as the integers they are (every one below 2**53
    is), so the lease's token still verifies; a fraction, or a double too
    large to be exact, is refused (found by an adversarial review: every
    such decode recomputed)."""
    params = producer_params()
    as_struct = {k: ([float(b) for b in v] if k == "remote_block_ids" else
                     float(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in params.items()}
    parsed = parse_kv_transfer_params(as_struct)
    assert parsed == parse_kv_transfer_params(params)
    assert all(type(b) is int for g in parsed.remote_block_ids for b in g)
    for bad in ({"remote_port": 5000.5}, {"remote_block_ids": [3.0, 4.5, 9.0]}, {"remote_port": float("nan")},
                {"remote_lease_epoch": 2.0 ** 60}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse_kv_transfer_params(producer_params(**bad))
