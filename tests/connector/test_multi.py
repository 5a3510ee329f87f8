"""MultiConnector with the storage connector and fake children: first-hit
load selection, save to all, finished merging, frees, params, load errors."""

from __future__ import annotations

import pytest

import kv_harness
from kv_harness import BLOCK_SIZE, LAYERS, FakeConnector, MiniEngine, fake_child
from rdma_kv.connector import (
    KVCacheBlocks,
    KVConnectorFactory,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
    MultiConnector,
    MultiKVConnectorMetadata,
    Request,
    SchedulerOutput,
    StorageConnector,
)
from rdma_kv.connector.multi import MultiKVConnectorHandshakeMetadata
from rdma_kv.errors import ConfigError, MetadataError


def multi_config(*children, role="kv_both"):
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role=role, engine_id="engine-7",
        kv_connector_extra_config={"connectors": list(children)},
    )


def storage_child(path):
    return {"kv_connector": "StorageConnector",
            "kv_connector_extra_config": {"storage_path": str(path)}}


def pair(*children, role="kv_both"):
    cfg = multi_config(*children, role=role)
    _, kvcc = kv_harness.cpu_kv_caches()
    make = KVConnectorFactory.create_connector
    return make(cfg, KVConnectorRole.SCHEDULER, kvcc), make(cfg, KVConnectorRole.WORKER, kvcc)


def test_children_are_built_from_config_and_inherit_engine_id_and_role(tmp_path):
    sched, worker = pair(fake_child(), storage_child(tmp_path),
                         {**fake_child(), "kv_role": "kv_consumer", "engine_id": "own"})
    assert [type(c) for c in sched.children] == [FakeConnector, StorageConnector, FakeConnector]
    assert [c.config.engine_id for c in sched.children] == ["engine-7", "engine-7", "own"]
    assert [c.config.kv_role for c in sched.children] == ["kv_both", "kv_both", "kv_consumer"]
    assert all(c.role is KVConnectorRole.WORKER for c in worker.children)


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({}, "no key 'connectors'"),
        ({"connectors": []}, "non-empty list"),
        ({"connectors": ["StorageConnector"]}, r"\['connectors'\]\[0\] must be a dict"),
        ({"connectors": [{"kv_connector": "StorageConnector", "kv_port": 1e9}]},
         r"\['connectors'\]\[0\]: kv_port must be an integer"),
        ({"connectors": [{"kv_conector": "X"}]}, r"\['connectors'\]\[0\]: unknown .*'kv_conector'"),
        # a child's setting put beside "connectors" was ignored: the child ran without it
        ({"connectors": [fake_child()], "storage_path": "/x"},
         r"MultiConnector: unknown kv_connector_extra_config key\(s\) \['storage_path'\]; "
         r"its only key is 'connectors': a child's settings go in that child's own"),
    ],
)
def test_bad_child_configs_are_reported_with_their_index(extra, pattern):
    cfg = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                           kv_connector_extra_config=extra)
    with pytest.raises(ConfigError, match=pattern):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER)


def test_load_comes_from_the_first_child_that_reports_tokens():
    sched, _ = pair(fake_child(matched_tokens=0), fake_child(matched_tokens=8, load_async=True),
                    fake_child(matched_tokens=12))
    a, b, c = sched.children
    request = Request("r", list(range(20)))
    assert sched.get_num_new_matched_tokens(request, 4) == (8, True)
    assert c.names("match") == [("match", "r", 4)]  # asked too, as vLLM does; b was chosen
    sched.update_state_after_alloc(request, KVCacheBlocks.of([1, 2, 3]), 8)
    assert a.names("alloc") == [("alloc", "r", ([1, 2, 3],), 0)]
    assert b.names("alloc") == [("alloc", "r", ([1, 2, 3],), 8)]
    assert c.names("alloc") == [("alloc", "r", ([1, 2, 3],), 0)]  # sees the blocks, loads nothing


def rdma_child(**extra):
    """The RDMA connector as a child (its scheduler side needs no transport)."""
    return {"kv_connector": "RdmaKVConnector", "kv_port": 15555, "kv_connector_extra_config": extra}


def test_every_child_hears_of_a_request_the_first_hit_loads():
    """vLLM's MultiConnector asks every child; the first with tokens loads.
    The RDMA producer learns from this question that a request waits for
    blocks and then ends the oldest leases over ``lease_max_share``. Asked
    only until the first hit, it never heard of requests a child before it
    (a storage cache) could serve: leases kept the blocks they waited for
    (renewed by their decodes) and admission stalled."""
    sched, _ = pair(fake_child(matched_tokens=8), rdma_child(lease_max_share=0.25),
                    role="kv_producer")
    fake, rdma = sched.children
    for rid, blocks in (("p1", range(0, 6)), ("p2", range(6, 12))):  # leases hold 12 of 32 blocks
        prefill = Request(rid, list(range(1, 6 * BLOCK_SIZE)), {"do_remote_decode": True})
        prefill.num_computed_tokens = prefill.num_prompt_tokens
        assert sched.request_finished(prefill, list(blocks))[0] is True
    sched.build_connector_meta(SchedulerOutput())
    waiting = Request("w", list(range(40)))
    assert sched.get_num_new_matched_tokens(waiting, 0) == (8, False)  # the first hit wins
    # no blocks for it this step: the engine allocates nothing and asks again later
    meta = sched.build_connector_meta(SchedulerOutput())
    assert len(meta.children[1].reclaims) == 1  # down to 6 of 32 blocks held
    assert rdma.scheduler.num_held_blocks() == 6


def test_a_consumer_child_not_chosen_releases_the_producers_lease_at_once():
    """A decode whose load a child before the RDMA connector serves (a
    storage hit) does not read the producer's blocks: the RDMA child, asked
    and then given 0 tokens, releases the lease at admission (vLLM's
    order). Never asked, it released it only when the decode finished, so
    the producer held the prompt's blocks for the whole decode (or the
    lease's 30 s)."""
    producer, _ = pair(rdma_child(), role="kv_producer")
    prefill = Request("p", list(range(1, 6 * BLOCK_SIZE)), {"do_remote_decode": True})
    prefill.num_computed_tokens = prefill.num_prompt_tokens
    _, params = producer.request_finished(prefill, list(range(6)))
    sched, _ = pair(fake_child(matched_tokens=8), rdma_child(), role="kv_consumer")
    decode = Request("d", list(range(1, 6 * BLOCK_SIZE)), params)
    assert sched.get_num_new_matched_tokens(decode, 0) == (8, False)
    sched.update_state_after_alloc(decode, KVCacheBlocks.of(list(range(10, 16))), 8)
    meta = sched.build_connector_meta(SchedulerOutput())
    assert meta.children[1].loads == ()
    assert [r.lease.request_id for r in meta.children[1].releases] == ["p"]


def test_a_child_still_looking_up_defers_the_answer():
    sched, _ = pair(fake_child(matched_tokens=None), fake_child(matched_tokens=8))
    request = Request("r", list(range(20)))
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    sched.update_state_after_alloc(request, KVCacheBlocks.of([1]), 0)
    assert [c[3] for c in sched.children[1].names("alloc")] == [0]  # nobody was chosen
    sched.children[0].matched = 0
    assert sched.get_num_new_matched_tokens(request, 0) == (8, False)


def test_no_child_with_tokens_means_nothing_to_load():
    sched, _ = pair(fake_child(), fake_child())
    assert sched.get_num_new_matched_tokens(Request("r", [1, 2, 3]), 0) == (0, False)


def test_storage_hit_is_chosen_over_a_fake_without_tokens_and_loads_bit_exact(tmp_path, rng):
    tokens = rng.integers(0, 1000, size=4 * BLOCK_SIZE + 1).tolist()
    MiniEngine(kv_harness.storage_config(tmp_path, "kv_producer")).prefill(Request("a", tokens))
    engine = MiniEngine(multi_config(fake_child(), storage_child(tmp_path)), fill_seed=9,
                        first_block=10)
    result = engine.prefill(Request("b", tokens))
    assert result["num_external"] == 4 * BLOCK_SIZE
    fake, storage = engine.scheduler.children
    assert fake.names("match") == [("match", "b", 0)]
    meta = result["meta"]
    assert isinstance(meta, MultiKVConnectorMetadata) and len(meta.children) == 2
    assert [load.block_ids for load in meta.children[1].loads] == [tuple(range(10, 14))]
    for layer_index, name in enumerate(LAYERS):
        for i, block in enumerate(range(10, 14)):
            expected = kv_harness.expected_block(tokens, i, layer_index)
            assert engine.kv_caches[name][block].equal(expected)


def test_every_child_saves(tmp_path, rng):
    tokens = rng.integers(0, 1000, size=3 * BLOCK_SIZE + 1).tolist()
    engine = MiniEngine(multi_config(fake_child(), storage_child(tmp_path), role="kv_producer"))
    engine.prefill(Request("a", tokens))
    fake_worker = engine.worker.children[0]
    assert [c[1] for c in fake_worker.names("save_layer")] == list(LAYERS)
    assert fake_worker.names("wait_save") == [("wait_save",)]
    assert fake_worker.names("bind") == [("bind", 1)]  # its own metadata, not the Multi's
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3  # the storage child saved too
    assert fake_worker.names("register") == [("register", sorted(LAYERS))]


def _finish(sched, worker, request_id="r", finished=()):
    """One step: ship the scheduler's metadata, collect the workers' report."""
    meta = sched.build_connector_meta(SchedulerOutput(finished_req_ids=frozenset(finished)))
    worker.bind_connector_metadata(meta)
    done = worker.get_finished(set(finished))
    worker.clear_connector_metadata()
    return meta, done


def test_finished_sending_only_when_every_delaying_child_is_done():
    sched, worker = pair(fake_child(delay_free=True), fake_child(delay_free=False),
                         fake_child(delay_free=True))
    request = Request("r", [1, 2, 3])
    assert sched.request_finished(request, [4, 5]) == (True, None)
    a, b, c = worker.children
    a.done_sending.add("r")
    b.done_sending.add("r")  # did not delay: its report does not count
    meta, done = _finish(sched, worker, finished={"r"})
    assert meta.delayed_sends == {"r": (0, 2)}
    assert done == (set(), set())
    c.done_sending.add("r")
    _, done = _finish(sched, worker)
    assert done == ({"r"}, set())
    a.done_sending.add("r")  # a late duplicate is not reported again
    _, done = _finish(sched, worker)
    assert done == (set(), set())


def test_delay_free_while_any_child_delays():
    sched, _ = pair(fake_child(delay_free=False), fake_child(delay_free=True))
    assert sched.request_finished(Request("r", [1]), [0])[0] is True
    sched, _ = pair(fake_child(), fake_child())
    assert sched.request_finished(Request("r", [1]), [0]) == (False, None)
    assert sched.build_connector_meta(SchedulerOutput()).delayed_sends == {}


def test_receives_are_merged_from_every_child():
    sched, worker = pair(fake_child(), fake_child())
    worker.children[0].done_recving.add("x")
    worker.children[1].done_recving.add("y")
    _, done = _finish(sched, worker)
    assert done == (set(), {"x", "y"})


def test_kv_transfer_params_are_combined_and_clashes_rejected():
    sched, _ = pair(fake_child(params={"remote_engine_id": "e"}), fake_child(),
                    fake_child(params={"storage_hit": True}))
    delay, params = sched.request_finished(Request("r", [1]), [0])
    assert params == {"remote_engine_id": "e", "storage_hit": True}
    sched, _ = pair(fake_child(params={"k": 1}), fake_child(params={"k": 2}))
    with pytest.raises(ConfigError, match="key 'k' of request 'r' is set by both FakeConnector#0 and FakeConnector#1"):
        sched.request_finished(Request("r", [1]), [0])


def test_request_finished_all_groups_reaches_every_child():
    """vLLM's hybrid-memory call: each child gets the block ids per group;
    delays and params merge as for ``request_finished``."""
    sched, _ = pair(fake_child(delay_free=True, params={"a": 1}), fake_child(params={"b": 2}))
    # Children of one group (the base default) take a single group ...
    assert sched.request_finished_all_groups(Request("r", [1]), ([4, 5],)) == (True, {"a": 1, "b": 2})
    assert sched.build_connector_meta(SchedulerOutput()).delayed_sends == {"r": (0,)}
    # ... and refuse several, naming themselves.
    with pytest.raises(ConfigError, match="FakeConnector supports one KV-cache group, got block ids of 2"):
        sched.request_finished_all_groups(Request("s", [1]), ([4], [5]))
    # Children that handle groups see every group, not the first.
    seen = []
    for index, child in enumerate(sched.children):
        child.request_finished_all_groups = (
            lambda request, ids, index=index: seen.append((index, [list(g) for g in ids])) or (index == 1, None))
    assert sched.request_finished_all_groups(Request("t", [1]), ([4], [5, 6])) == (True, None)
    assert seen == [(0, [[4], [5, 6]]), (1, [[4], [5, 6]])]
    assert sched.build_connector_meta(SchedulerOutput()).delayed_sends == {"t": (1,)}


def test_load_errors_are_combined():
    _, worker = pair(fake_child(), fake_child())
    worker.children[0].load_errors.update({1, 2})
    worker.children[1].load_errors.update({2, 9})
    assert worker.get_block_ids_with_load_errors() == {1, 2, 9}
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_storage_load_error_surfaces_through_multi(tmp_path, rng):
    tokens = rng.integers(0, 1000, size=3 * BLOCK_SIZE + 1).tolist()
    MiniEngine(kv_harness.storage_config(tmp_path)).prefill(Request("a", tokens))
    for path in tmp_path.rglob("*.safetensors"):
        path.write_bytes(b"not a safetensors file")
    engine = MiniEngine(multi_config(storage_child(tmp_path), fake_child()), first_block=20)
    result = engine.prefill(Request("b", tokens))
    assert result["num_external"] == 3 * BLOCK_SIZE
    assert result["output"].invalid_block_ids == frozenset({20, 21, 22})


def test_metadata_and_handshakes_are_per_child():
    sched, worker = pair(fake_child(), fake_child())
    with pytest.raises(MetadataError, match="2 children expects a MultiKVConnectorMetadata"):
        worker.bind_connector_metadata(KVConnectorMetadata())
    assert worker.get_handshake_metadata() is None
    worker.children[1].handshake = "hs-1"
    hs = worker.get_handshake_metadata()
    assert hs == MultiKVConnectorHandshakeMetadata((None, "hs-1"))
    sched.set_xfer_handshake_metadata({0: hs, 1: MultiKVConnectorHandshakeMetadata(("a", "b"))})
    assert sched.children[0].names("handshake") == [("handshake", {1: "a"})]
    assert sched.children[1].names("handshake") == [("handshake", {0: "hs-1", 1: "b"})]
    with pytest.raises(MetadataError, match="rank 3"):
        sched.set_xfer_handshake_metadata({3: "raw"})


def test_outputs_stats_and_shutdown_reach_every_child():
    sched, worker = pair(fake_child(fail_shutdown=True), fake_child())
    sched.update_connector_output(kv_harness.KVConnectorOutput.of(["a"]))
    assert all(len(c.names("output")) == 1 for c in sched.children)
    sched.build_connector_meta(SchedulerOutput())
    assert sched.get_kv_connector_stats() == {"FakeConnector#0": {"steps": 1},
                                              "FakeConnector#1": {"steps": 1}}
    with pytest.raises(RuntimeError, match="fake shutdown failure"):
        worker.shutdown()
    assert all(c.names("shutdown") == [("shutdown",)] for c in worker.children)


def test_multi_connector_is_role_checked_like_any_connector():
    sched, worker = pair(fake_child())
    from rdma_kv.errors import RoleError

    with pytest.raises(RoleError):
        worker.request_finished(Request("r", [1]), [0])
    with pytest.raises(RoleError):
        sched.get_finished(set())
    assert isinstance(sched, MultiConnector)
