"""Consumer (decode) side edge cases found by an adversarial review of the
scheduler against vLLM 0.32's call pattern (no UCX, no sockets)."""

from __future__ import annotations

import logging

import pytest

from rdma_kv.connector import FullAttentionSpec, KVCacheConfig, KVConnectorRole, KVTransferConfig, Request
from rdma_kv.connector import SchedulerOutput
from rdma_kv.connector.rdma import RdmaConnector
from rdma_kv.connector.rdma import scheduler as scheduler_module
from rdma_kv.connector.rdma.params import RemotePrefillParams, parse_kv_transfer_params, prompt_digest
from rdma_kv.errors import ConfigError

BS = 4
TOKEN = bytes(range(16))


def consumer():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="float16")
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_consumer", engine_id="D", kv_port=0,
                              kv_connector_extra_config={"side_channel_port": 5000})
    return RdmaConnector(config, KVConnectorRole.SCHEDULER, KVCacheConfig.uniform(64, ("l0", "l1"), spec))


def params_for(prompt, block_ids):
    return RemotePrefillParams("P", "127.0.0.1", 6000, tuple(block_ids), "p-1", 1, 77, 5, TOKEN, 30.0, len(prompt),
                               prompt_digest(prompt)).to_dict()


def test_more_block_ids_than_prompt_tokens_are_refused_at_the_edge():
    """A block holds at least one token: a producer never offers more block
    ids (per KV-cache group) than the prompt has tokens. A client's params
    with a 10-token prompt and a million ids were walked id by id (about
    0.5 s of the engine core's thread per parse, twice per request) and then
    accepted: the load was planned from the first ids."""
    prompt = list(range(1, 11))
    with pytest.raises(ConfigError, match="remote_block_ids"):
        parse_kv_transfer_params(params_for(prompt, range(11)))
    assert parse_kv_transfer_params(params_for(prompt, range(3))) is not None  # the producer's own: 3 blocks


def test_a_request_refused_at_admission_is_not_parsed_or_released_again_at_its_end(monkeypatch, caplog):
    """vLLM calls request_finished for every request: one whose params the
    scheduler already refused (and whose lease it already released) was
    parsed again (the whole id list, a second warning) and released a
    second time."""
    s = consumer()
    calls = []
    real = scheduler_module.parse_kv_transfer_params
    monkeypatch.setattr(scheduler_module, "parse_kv_transfer_params",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = list(range(1, 11))
    other = Request("d", prompt[:-1] + [99], params_for(prompt, (3, 4, 5)))  # another prompt's KV
    with caplog.at_level(logging.WARNING, logger="rdma_kv"):
        assert s.get_num_new_matched_tokens(other, 0) == (0, False)
        assert len(s.build_connector_meta(SchedulerOutput()).releases) == 1  # released once, at once
        assert s.request_finished(other, [7, 8, 9]) == (False, None)
        assert s.build_connector_meta(SchedulerOutput()).releases == ()
    assert len(calls) == 1
    assert len([r for r in caplog.records if "d" in r.getMessage() and r.levelno >= logging.WARNING]) == 1
    assert s.scheduler.num_tracked() == 0


def test_children_of_one_request_share_its_params_one_loads_none_fails(fabric):
    """vLLM runs a request with ``n > 1`` as n child requests ("0_<id>",
    "1_<id>", ...) that all carry the parent's ``kv_transfer_params``: one
    lease for several requests. Each loaded under it; the producer lets only
    the first claim hold the lease, so every other child's load was refused
    (CLAIMED): a load error, and under kv_load_failure_policy=fail (vLLM's
    default) an error for the client's request. Now the others wait for the
    first one's KV and are computed locally (in vLLM from the prefix cache
    the load filled; the harness engine caches no loaded block in time for
    them); no lease is released by a child it does not belong to."""
    from test_connector_fake import Pair

    pair = Pair(fabric, policy="fail")
    try:
        prompt = list(range(1, 30))
        params = pair.prefill({"x": prompt})["x"]
        children = {f"{i}_x": prompt for i in range(3)}
        results = pair.decode(children, {rid: params for rid in children})
        for rid in children:
            r = results[rid]
            assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], (rid, r)
        assert sum(1 for rid in children if results[rid].external_tokens) == 1
        pair.settle()
        assert pair.P.worker.worker.leases.stats.released == 1
    finally:
        pair.close()


def test_an_aborted_child_does_not_release_the_lease_its_sibling_loads_under():
    """A child aborted before the engine asked about it (vLLM: request_finished
    for a request never seen) released the lease of its params, with a claim
    of its own: if it reached the producer before the sibling's first call,
    it ended the sibling's lease and the sibling's load failed."""
    s = consumer()
    prompt = list(range(1, 11))
    params = params_for(prompt, (3, 4, 5))
    first, second = Request("0_x", prompt, params), Request("1_x", prompt, params)
    assert s.get_num_new_matched_tokens(first, 0) == (10, True)
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)  # asked again later
    assert s.request_finished(second, []) == (False, None)
    meta = s.build_connector_meta(SchedulerOutput())
    assert meta.releases == () and [r.claim for r in meta.renewals] == [s.scheduler._remote["0_x"].claim]


def test_a_child_asked_after_its_sibling_finished_is_computed_locally():
    """vLLM asks about a waiting request only when a slot is free
    (``max_num_seqs``): with more children than slots, a child was first
    asked after the sibling that loaded the lease had finished, loaded
    under the lease that sibling had released (GONE): a load error, under
    kv_load_failure_policy=fail an error (found in real vLLM: n=2 of five
    prompts, max_num_seqs 8, the last two prompts' second samples failed).
    Another request with the same params (a router's retry, not a sibling)
    still loads: the producer's answer decides (tests/faults)."""
    s = consumer()
    prompt = list(range(1, 11))
    params = params_for(prompt, (3, 4, 5))
    first = Request("0_x-abc", prompt, params)
    assert s.get_num_new_matched_tokens(first, 0) == (10, True)
    assert s.request_finished(first, []) == (False, None)
    s.build_connector_meta(SchedulerOutput())
    assert s.get_num_new_matched_tokens(Request("1_x-abc", prompt, params), 0) == (0, False)
    assert s.request_finished(Request("1_x-abc", prompt, params), []) == (False, None)
    assert s.build_connector_meta(SchedulerOutput()).releases == ()
    assert s.get_num_new_matched_tokens(Request("x-retry", prompt, params), 0) == (10, True)
