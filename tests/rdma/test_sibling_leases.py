"""The producer scheduler and vLLM's children of a request with ``n > 1``
(no UCX, no sockets). vLLM prefills each child, then hands the client one
child's ``kv_transfer_params``: the first finished child's lease is the one
every sibling hands over, so the others' blocks are not pinned for
``lease_ttl_s`` after the decode read and released the one it was given.
Through real vLLM: tests/vllm/test_vllm_rdma_pd.py (its ``n=2`` step)."""

from __future__ import annotations

import pytest

from rdma_kv.connector import KVCacheBlocks, KVConnectorOutput, Request, SchedulerOutput
from rdma_kv.connector.rdma.params import parse_kv_transfer_params
from test_lease_pressure import BS, producer

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(1, 11))  # 10 tokens: 3 blocks of 4


def finish(s, rid, prompt=PROMPT, first_block=0, extra_keys=()):
    """Prefill ``rid`` to its end on producer scheduler ``s``: (delay_free, params)."""
    request = Request(rid, prompt, {"do_remote_decode": True}, extra_keys=extra_keys)
    request.num_computed_tokens = len(prompt)
    s.get_num_new_matched_tokens(request, 0)
    blocks = list(range(first_block, first_block + -(-len(prompt) // BS)))
    s.update_state_after_alloc(request, KVCacheBlocks.of(blocks), 0)
    return s.request_finished(request, blocks)


def test_every_child_hands_over_the_first_finished_childs_lease_and_only_it_is_held():
    s = producer()
    first = finish(s, "0_cmpl-7-1a2b3c4d", first_block=0)
    second = finish(s, "1_cmpl-7-1a2b3c4d", first_block=3)
    third = finish(s, "2_cmpl-7-1a2b3c4d", first_block=6)
    assert first[0] is True and second[0] is False and third[0] is False
    assert first[1] == second[1] == third[1]
    assert second[1] is not first[1]  # a dict of its own: vLLM annotates each child's (remote_prefill_cached_tokens)
    assert first[1]["remote_block_ids"] == [0, 1, 2] and first[1]["remote_request_id"] == "0_cmpl-7-1a2b3c4d"
    assert s.scheduler.num_held_blocks() == 3 and s.scheduler.shared_with_siblings == 2
    meta = s.build_connector_meta(SchedulerOutput())
    assert [send.request_id for send in meta.sends] == ["0_cmpl-7-1a2b3c4d"]  # one lease reaches the workers


def test_requests_that_are_not_siblings_each_get_their_own_lease():
    """Another parent, a request that is no child, and an id that looks
    like a sibling's with another prompt: each its own lease."""
    s = producer()
    mine = finish(s, "0_p-1", first_block=0)[1]
    other_parent = finish(s, "0_p-2", first_block=3)
    no_child = finish(s, "p-1", first_block=6)
    other_prompt = finish(s, "1_p-1", PROMPT[:-1] + [99], first_block=9)
    longer = finish(s, "2_p-1", PROMPT + [11], first_block=12)
    for delay, params in (other_parent, no_child, other_prompt, longer):
        assert delay is True
        assert parse_kv_transfer_params(params).lease != parse_kv_transfer_params(mine).lease
    assert s.scheduler.shared_with_siblings == 0 and s.scheduler.num_held_blocks() == 3 + 3 + 3 + 3 + 3


def test_a_sibling_finishing_after_the_first_childs_lease_ended_gets_its_own():
    """The decode read and released the first child's lease (the workers
    report it in finished_sending) before a slow sibling finished: that
    sibling's params would name a lease that is gone, so it is granted one."""
    s = producer()
    first = finish(s, "0_p-1")
    s.build_connector_meta(SchedulerOutput())
    s.update_connector_output(KVConnectorOutput.of(["0_p-1"], None))
    late = finish(s, "1_p-1", first_block=3)
    assert late[0] is True and late[1]["remote_request_id"] == "1_p-1"
    assert parse_kv_transfer_params(late[1]).lease != parse_kv_transfer_params(first[1]).lease
    assert finish(s, "2_p-1", first_block=6) == (False, late[1])  # and the next shares that one


def test_push_mode_children_are_left_to_their_transfer_ids():
    s = producer(mode="push")
    assert finish(s, "0_p-1")[0] is True and finish(s, "1_p-1", first_block=3)[0] is True


def test_an_id_that_looks_like_a_siblings_with_other_extra_keys_gets_its_own_lease():
    """An engine that does not randomize request ids lets a client name its
    request like another's child: the same tokens with another image, LoRA
    adapter or cache salt (``Request.extra_keys``) are other KV."""
    s = producer()
    image = (("mm", "img-1", 0),)
    first = finish(s, "0_p-1", first_block=0, extra_keys=image)
    assert finish(s, "1_p-1", first_block=3, extra_keys=image) == (False, first[1])  # a genuine sibling
    assert finish(s, "2_p-1", first_block=6, extra_keys=(("mm", "img-2", 0),))[0] is True
    assert finish(s, "3_p-1", first_block=9)[0] is True


def test_a_sibling_never_hands_over_an_ended_lease_whose_request_id_holds_another():
    """The sibling's lease is live only as that very lease (its generation),
    not as whatever lease its request id holds now: an engine that reuses
    ids (the harness, vLLM with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)
    grants "0_p" a second lease for another prompt after the first ended.
    A later "1_p" of the first prompt was handed the ended lease's params,
    its own blocks freed: its decode found nothing to read. Found by an
    adversarial review."""
    s = producer()
    other = PROMPT[:-1] + [99]
    first = finish(s, "0_p", first_block=0)
    s.build_connector_meta(SchedulerOutput())
    s.update_connector_output(KVConnectorOutput.of(["0_p"], None))  # the first lease ended
    reused = finish(s, "0_p", other, first_block=3)  # the id again, another prompt: its own lease
    assert reused[0] is True
    late = finish(s, "1_p", first_block=6)
    assert late[0] is True and late[1] != first[1]
    assert parse_kv_transfer_params(late[1]).lease not in (parse_kv_transfer_params(first[1]).lease,
                                                           parse_kv_transfer_params(reused[1]).lease)
    assert s.scheduler.shared_with_siblings == 0 and s.scheduler.num_held_blocks() == 6


def test_a_grant_is_forgotten_when_its_lease_ends():
    """Nothing of a lease that ended is kept for siblings that may never
    come: each grant holds its params (every block id of the prompt), and
    without this the last SIBLING_GRANTS_KEPT stayed for the life of the
    engine. Ended by its decode (finished_sending) or reclaimed under
    memory pressure. Found by an adversarial review."""
    from test_lease_pressure import Producer

    s = producer()
    for i in range(5):
        finish(s, f"0_p-{i}", first_block=3 * i)
        assert finish(s, f"1_p-{i}", first_block=3 * i)[0] is False
    assert len(s.scheduler._sibling_grants) == 5
    s.build_connector_meta(SchedulerOutput())
    s.update_connector_output(KVConnectorOutput.of([f"0_p-{i}" for i in range(5)], None))
    assert len(s.scheduler._sibling_grants) == 0

    p = Producer()
    for i in range(6):
        p.finish_prefill(f"0_r{i}", 10)
    assert len(p.s.scheduler._sibling_grants) == 6
    p.step()
    assert p.reclaimed(p.step(waiting=["new"])) == ["0_r0", "0_r1", "0_r2"]
    assert len(p.s.scheduler._sibling_grants) == 3
