"""The producer scheduler's memory-pressure policy (no UCX, no sockets):
leases are reclaimed, oldest first, only while a request waits for blocks
and only down to ``lease_max_share`` of the KV cache. End to end through
harness engines: tests/faults/test_lease_bounds.py."""

from __future__ import annotations

import logging
import re

import pytest

from rdma_kv.connector import (
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    Request,
    SchedulerOutput,
)
from rdma_kv.connector.rdma import RdmaConnector
from rdma_kv.connector.rdma.params import parse_kv_transfer_params
from rdma_kv.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

BS, NUM_BLOCKS = 4, 64
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="float32")


def producer(**extra):
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", engine_id="P",
                              kv_port=5000, kv_connector_extra_config=extra)
    cache = KVCacheConfig(NUM_BLOCKS, (KVCacheTensor(NUM_BLOCKS * SPEC.page_size_bytes, ("l0",)),),
                          (KVCacheGroupSpec(("l0",), SPEC),))
    return RdmaConnector(config, KVConnectorRole.SCHEDULER, cache)


class Producer:
    """A producer scheduler and the blocks it hands out, as an engine would."""

    def __init__(self, **extra):
        self.s = producer(**extra)
        self.next_block = 0
        self.generation = {}

    def finish_prefill(self, rid, num_blocks):
        request = Request(rid, list(range(1, num_blocks * BS + 1)), {"do_remote_decode": True})
        request.num_computed_tokens = num_blocks * BS
        self.s.get_num_new_matched_tokens(request, 0)
        blocks = list(range(self.next_block, self.next_block + num_blocks))
        self.s.update_state_after_alloc(request, KVCacheBlocks.of(blocks), 0)
        self.next_block += num_blocks
        delay, params = self.s.request_finished(request, blocks)
        assert delay
        self.generation[rid] = parse_kv_transfer_params(params).lease.generation

    def step(self, waiting=()):
        """One scheduler step in which ``waiting`` were asked about and got no blocks."""
        for rid in waiting:
            self.s.get_num_new_matched_tokens(Request(rid, list(range(1, 9)), {"do_remote_decode": True}), 0)
        return self.s.build_connector_meta(SchedulerOutput())

    def reclaimed(self, meta):
        names = {g: rid for rid, g in self.generation.items()}
        return [names[g] for g in meta.reclaims]


def test_no_request_waits_no_reclaim_however_much_is_held():
    p = Producer()
    for i in range(6):
        p.finish_prefill(f"r{i}", 10)  # 60 of 64 blocks
    assert p.step().reclaims == ()
    assert p.s.scheduler.num_held_blocks() == 60


def test_a_waiting_request_reclaims_the_oldest_leases_down_to_the_share(caplog):
    p = Producer()
    for i in range(6):
        p.finish_prefill(f"r{i}", 10)
    p.step()
    with caplog.at_level(logging.WARNING, logger="rdma_kv.connector.rdma.scheduler"):
        meta = p.step(waiting=["new"])
    assert p.reclaimed(meta) == ["r0", "r1", "r2"]  # 60 -> 30 <= 32 = 0.5 x 64
    assert p.s.scheduler.num_held_blocks() == 30
    assert "ended the 3 oldest lease(s) (30 blocks)" in caplog.text
    assert p.step(waiting=["new"]).reclaims == ()  # at the share: nothing more
    # A lease reported finished (released by its consumer) no longer counts.
    p.s.update_connector_output(KVConnectorOutput.of(finished_sending=["r3", "r0"]))
    assert p.s.scheduler.num_held_blocks() == 20


def test_a_request_that_got_its_blocks_is_no_pressure():
    p = Producer()
    for i in range(6):
        p.finish_prefill(f"r{i}", 10)
    p.finish_prefill("late", 2)  # asked about and allocated in the same step
    assert p.step().reclaims == ()


@pytest.mark.parametrize("share, expected", [(1.0, []), (0.25, ["r0", "r1", "r2", "r3", "r4"])])
def test_the_share_is_configurable(share, expected):
    p = Producer(lease_max_share=share)
    for i in range(6):
        p.finish_prefill(f"r{i}", 10)
    assert p.reclaimed(p.step(waiting=["new"])) == expected


@pytest.mark.parametrize("extra, says", [
    ({"lease_max_share": 0}, "lease_max_share must be in (0, 1]"),
    ({"lease_max_share": 1.5}, "lease_max_share must be in (0, 1]"),
    ({"lease_max_s": 0}, "lease_max_s must be in (0, 86400] seconds"),  # (the message names the bound since d0260d1)
    # A consumer accepts no TTL under a second in kv_transfer_params, so a
    # producer grants none: its consumers would refuse every request.
    ({"lease_ttl_s": 0.5}, "lease_ttl_s must be in [1, 86400] seconds, got 0.5"),
    ({"lease_ttl_s": 86401}, "lease_ttl_s must be in [1, 86400] seconds"),
])
def test_bad_bounds_are_refused(extra, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        producer(**extra)


def test_a_prefill_aborted_after_its_last_chunk_was_scheduled_is_not_held():
    """An engine counts a chunk's tokens computed when it schedules them:
    an abort handled after the last chunk was scheduled reaches
    ``request_finished`` with the whole prompt counted. It was held under a
    lease for the full TTL (its params reach no router, so no decode
    claims it; an abort storm pinned KV cache). Held are only requests that
    finished with an answer, as vLLM's NixlConnector does (found by an
    adversarial review)."""
    p = Producer()
    request = Request("cut", list(range(1, 3 * BS + 1)), {"do_remote_decode": True})
    request.num_computed_tokens = 3 * BS
    p.s.get_num_new_matched_tokens(request, 0)
    p.s.update_state_after_alloc(request, KVCacheBlocks.of([0, 1, 2]), 0)
    request.aborted = True
    assert p.s.request_finished(request, [0, 1, 2]) == (False, None)
    p.finish_prefill("done", 3)  # the same prefill finished with its answer: held (asserted there)
    assert list(p.generation) == ["done"]


def test_blocks_two_leases_share_through_the_prefix_cache_count_once():
    """vLLM's prefix cache hands a prompt's cached blocks to every later
    request with that prefix (a system prompt): two leases name the same
    physical blocks, which one reclaim does not free while the other holds
    them. Each lease's blocks were added up, so six prefills of 10 blocks
    sharing 9 counted 60 held blocks where 15 are held: a request waiting
    for blocks reclaimed three leases (their decodes recomputed), freeing 3
    blocks, with leases holding under a quarter of the cache (found by an
    adversarial review of the producer side)."""
    p = Producer()
    shared = list(range(9))
    for i in range(6):
        request = Request(f"r{i}", list(range(1, 10 * BS)) + [100 + i], {"do_remote_decode": True})
        request.num_computed_tokens = 10 * BS
        p.s.get_num_new_matched_tokens(request, 9 * BS)
        blocks = [*shared, 9 + i]
        p.s.update_state_after_alloc(request, KVCacheBlocks.of(blocks), 0)
        assert p.s.request_finished(request, blocks)[0] is True
    assert p.s.scheduler.num_held_blocks() == 15
    assert p.step(waiting=["new"]).reclaims == ()  # 15 <= 32 = 0.5 x 64: nothing to reclaim
    # Once every lease naming a shared block ended, it no longer counts.
    p.s.update_connector_output(KVConnectorOutput.of(finished_sending=[f"r{i}" for i in range(5)]))
    assert p.s.scheduler.num_held_blocks() == 10
    p.s.update_connector_output(KVConnectorOutput.of(finished_sending=["r5"]))
    assert p.s.scheduler.num_held_blocks() == 0


def test_a_reclaim_counts_only_the_blocks_no_other_lease_holds():
    """Over the share, the oldest leases are ended until the blocks leases
    hold (each once) are down to it: a lease whose blocks another lease
    also holds frees none of them."""
    p = Producer(lease_max_share=0.25)  # 16 of 64 blocks
    shared = list(range(10))
    for i in range(4):
        request = Request(f"r{i}", list(range(1, 10 * BS + 1)) + [1000 + i] * (2 * BS + 1), {"do_remote_decode": True})
        request.num_computed_tokens = 12 * BS + 1
        p.s.get_num_new_matched_tokens(request, 10 * BS)
        blocks = [*shared, 10 + 3 * i, 11 + 3 * i, 12 + 3 * i]
        p.s.update_state_after_alloc(request, KVCacheBlocks.of(blocks), 0)
        delay, params = p.s.request_finished(request, blocks)
        p.generation[f"r{i}"] = parse_kv_transfer_params(params).lease.generation
    assert p.s.scheduler.num_held_blocks() == 10 + 4 * 3  # 22
    assert p.reclaimed(p.step(waiting=["new"])) == ["r0", "r1"]  # 22 -> 19 -> 16
    assert p.s.scheduler.num_held_blocks() == 16


def test_a_request_left_waiting_with_blocks_to_spare_reclaims_nothing():
    """vLLM asks about a waiting request, then may leave it for the next
    step for other reasons than memory (the step's token budget with
    chunked prefill off, the encoder's budget). Each such step ended the
    oldest leases over the share, with the blocks there (real vLLM:
    ``tests/vllm/test_vllm_producer_leases.py``). With the engine's free
    blocks known (vLLM's block pool), only a request needing more blocks
    than are free is pressure (found by an adversarial review)."""
    p = Producer()
    free = [14]
    p.s.bind_free_blocks(lambda: free[0])
    for i in range(6):
        p.finish_prefill(f"r{i}", 10)  # 60 of 64 blocks held (a test's blocks: none is really taken)
    p.step()
    assert p.step(waiting=["new"]).reclaims == ()  # 8 tokens: 2 blocks, 14 free
    free[0] = 1
    assert p.reclaimed(p.step(waiting=["new"])) == ["r0", "r1", "r2"]  # 2 blocks, 1 free: pressure
