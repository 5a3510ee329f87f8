"""Hybrid models in the RDMA connector: several KV-cache groups, and
sliding-window groups read only inside the window.

Planning (no transport): which blocks of a sliding-window group a load
reads (window smaller than the prompt, exactly equal, larger), the slot
table's per-group index arrays against a per-row loop, runs per group, the
params' flat (one group) and nested (several) forms. Then a producer and a
consumer worker over the fake transport with a two-group KV cache: the
window's blocks land bit-exact, the blocks before the window are left
alone, and the load records the bytes it did not read.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeFabric
from rdma_testutil import wait_until

from rdma_kv.connector import (
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVConnectorRole,
    KVTransferConfig,
    Request,
    SchedulerOutput,
    SlidingWindowSpec,
)
from rdma_kv.connector.geometry import derive_geometry
from rdma_kv.connector.rdma import RdmaConnector
from rdma_kv.connector.rdma.params import parse_kv_transfer_params
from rdma_kv.connector.rdma.compat import compat_info
from rdma_kv.connector.rdma.slots import BlockPairs, SlotTable, count_runs
from rdma_kv.connector.rdma.intake import blocks_to_read
from rdma_kv.errors import ConfigError, DescriptorError

pytestmark = pytest.mark.timeout(60)

BS, WINDOW, NUM_BLOCKS = 4, 6, 64
HEADS, HEAD = 2, 8
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype="float32")
SLIDING = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype="float32",
                            sliding_window=WINDOW)
# Layer order as vLLM lists a hybrid Llama: sliding, full, sliding; group 0
# holds the sliding layers, group 1 the full one.
LAYERS = ("l0", "l1", "l2")
GROUPS = (KVCacheGroupSpec(("l0", "l2"), SLIDING), KVCacheGroupSpec(("l1",), FULL))


def hybrid_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    tensors = tuple(KVCacheTensor(num_blocks * FULL.page_size_bytes, (name,)) for name in LAYERS)
    return KVCacheConfig(num_blocks, tensors, GROUPS)


def kv_caches(num_blocks: int = NUM_BLOCKS, fill: float | None = None) -> dict[str, np.ndarray]:
    """One [blocks, heads, block_size, 2*head] fp32 array per layer (vLLM's CPU layout)."""
    shape = (num_blocks, HEADS, BS, 2 * HEAD)
    out = {}
    for i, name in enumerate(LAYERS):
        if fill is None:
            out[name] = np.zeros(shape, dtype=np.float32)
        else:  # every (layer, block) distinct
            out[name] = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1e6 * (i + 1))
    return out


# --- which blocks a sliding-window group reads ---------------------------------------


@pytest.mark.parametrize("num_tokens, skipped", [
    (3, 0), (WINDOW, 0), (WINDOW + 2, 0),  # the window still covers token 0
    (9, 1),  # the next token (9) attends to [4, 9]: block 0 (tokens 0..3) is skipped
    (16, 2),  # [11, 16]: blocks 0 and 1
    (17, 3),  # [12, 17]: blocks 0..2, as vLLM frees them
    (40, 8),
])
def test_sliding_window_skips_the_blocks_before_the_window_of_the_next_token(num_tokens, skipped):
    # Token n attends to [n - w + 1, n]: after n tokens, blocks ending before n - w + 1 go.
    assert SLIDING.num_skipped_blocks(num_tokens) == skipped
    assert skipped == max(0, num_tokens - WINDOW + 1) // BS
    assert FULL.num_skipped_blocks(num_tokens) == 0


@pytest.mark.parametrize("case, num_tokens", [
    ("window smaller than the prompt", 17),
    ("window exactly the prompt", WINDOW),
    ("window larger than the prompt", 3),
])
def test_blocks_to_read_reads_only_inside_the_window(case, num_tokens):
    last = -(-num_tokens // BS)
    local = list(range(100, 100 + last))
    producer = list(range(200, 200 + last))
    skipped = SLIDING.num_skipped_blocks(num_tokens)
    # The producer offers the window only (what request_finished holds).
    plan = blocks_to_read(SLIDING, num_tokens, 0, local, producer[skipped:])
    assert plan == (tuple(local[skipped:]), tuple(producer[skipped:]), skipped), case
    if case == "window smaller than the prompt":
        assert skipped > 0
    else:
        assert skipped == 0 and plan[0] == tuple(local)
    # A full-attention group reads every block, whatever the window.
    assert blocks_to_read(FULL, num_tokens, 0, local, producer) == (tuple(local), tuple(producer), 0)


def test_blocks_to_read_with_a_local_prefix_hit_and_bad_input():
    # 17 tokens: window starts at block 3; a local hit of 2 blocks does not count as skipped
    assert blocks_to_read(SLIDING, 17, 2 * BS, [1, 2, 3, 4, 5], [9, 8]) == ((4, 5), (9, 8), 1)
    # a hit beyond the window start: nothing is skipped by the window
    assert blocks_to_read(SLIDING, 17, 4 * BS, [1, 2, 3, 4, 5], [9, 8]) == ((5,), (8,), 0)
    # the producer must cover the window
    assert "block 3 is needed" in blocks_to_read(SLIDING, 17, 0, [1, 2, 3, 4, 5], [8])
    assert "not a multiple of block size" in blocks_to_read(SLIDING, 17, 3, [1, 2, 3, 4, 5], [9, 8])
    assert "5 needed" in blocks_to_read(FULL, 17, 0, [1, 2], [1, 2, 3, 4, 5])


# --- the slot table per group ---------------------------------------------------------


def test_slot_table_rows_take_their_groups_block_ids():
    caches = kv_caches()
    geometry = derive_geometry(caches, hybrid_config())
    assert [layer.group for layer in geometry.layers] == [0, 0, 1]  # config order: l0, l2, l1
    slots = SlotTable(geometry)
    assert slots.num_groups == 2 and slots.row_group.tolist() == [0, 0, 1]
    sliding, full = np.array([7, 8]), np.array([3, 4, 5, 6])
    got = slots.indices((sliding, full), "local")
    expected = np.concatenate([slots.row_base[r] + (sliding, full)[g]
                               for r, g in enumerate(slots.row_group.tolist())])
    assert got.tolist() == expected.tolist()
    # each index is the address of that layer's block
    addrs = slots.descs.addrs[got]
    base = {name: caches[name].__array_interface__["data"][0] for name in LAYERS}
    page = FULL.page_size_bytes
    want = ([base["l0"] + b * page for b in sliding] + [base["l2"] + b * page for b in sliding]
            + [base["l1"] + b * page for b in full])
    assert addrs.tolist() == want
    assert slots.group_nbytes.tolist() == [2 * page, page]
    assert slots.skipped_nbytes((3, 0)) == 3 * 2 * page and slots.skipped_nbytes(()) == 0
    # an empty group (a window that holds nothing new) is fine
    assert slots.indices(((), full), "local").tolist() == expected[4:].tolist()
    with pytest.raises(DescriptorError, match="1 groups of remote block ids for a remote KV cache of 2"):
        slots.indices([full], "remote")
    with pytest.raises(DescriptorError, match=r"local block ids \[64\]"):
        slots.indices(([64], full), "local")


def test_single_group_slot_table_is_unchanged():
    spec = FULL
    config = KVCacheConfig.uniform(NUM_BLOCKS, LAYERS, spec)
    slots = SlotTable(derive_geometry(kv_caches(), config))
    ids = np.array([5, 6, 9])
    flat = (slots.row_base[:, None] + ids[None, :]).ravel()
    assert slots.indices(ids, "local").tolist() == flat.tolist()  # the 1-D form of one group
    assert slots.indices([ids], "local").tolist() == flat.tolist()
    assert count_runs(ids, ids + 1, slots.num_rows) == count_runs([ids], [ids + 1], slots) == 3 * 2
    compat = compat_info(config, derive_geometry(kv_caches(), config), 1)
    assert compat.spec == f"full_attention_{spec.block_size}_{spec.page_size_bytes // spec.num_kv_heads}" and compat.layer_groups == []


def test_count_runs_per_group_and_compat_names_the_groups():
    config = hybrid_config()
    geometry = derive_geometry(kv_caches(), config)
    slots = SlotTable(geometry)
    # sliding: one run in each of 2 rows; full: two runs (5 breaks) in 1 row
    assert count_runs(([7, 8], [3, 4, 9]), ([1, 2], [3, 4, 5]), slots) == 2 * 1 + 1 * 2
    compat = compat_info(config, geometry, 1)
    per_head = [f"{s.type_id.rsplit('_', 1)[0]}_{s.page_size_bytes // s.num_kv_heads}" for s in (SLIDING, FULL)]
    assert compat.spec == "+".join(per_head) and compat.layer_groups == [0, 0, 1]
    single = compat_info(KVCacheConfig.uniform(NUM_BLOCKS, LAYERS, FULL),
                         derive_geometry(kv_caches(), KVCacheConfig.uniform(NUM_BLOCKS, LAYERS, FULL)), 1)
    assert any(line.startswith("spec:") for line in compat.mismatches(single))


# --- params: one list per group -----------------------------------------------------------


def params_with(ids):
    return {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
            "remote_port": 5000, "remote_block_ids": ids, "remote_request_id": "r", "tp_size": 1,
            "remote_lease_epoch": 1, "remote_lease_generation": 1, "remote_lease_token": "ab" * 16,
            "remote_lease_ttl_s": 30.0, "remote_num_tokens": 17,
            "remote_prompt_digest": "cd" * 16}


def test_params_flat_for_one_group_nested_for_several():
    flat = parse_kv_transfer_params(params_with([1, 2, 3]))
    assert flat.remote_block_ids == ((1, 2, 3),) and flat.to_dict()["remote_block_ids"] == [1, 2, 3]
    nested = parse_kv_transfer_params(params_with([[7, 8], [1, 2, 3, 4, 5]]))
    assert nested.remote_block_ids == ((7, 8), (1, 2, 3, 4, 5))
    assert nested.to_dict()["remote_block_ids"] == [[7, 8], [1, 2, 3, 4, 5]]
    assert parse_kv_transfer_params(params_with([[], [1]])).remote_block_ids == ((), (1,))
    for bad in ([[1], 2], [1, [2]], [[]], [[-1]], [[1]] * 65):
        with pytest.raises(ConfigError, match="remote_block_ids"):
            parse_kv_transfer_params(params_with(bad))


# --- scheduler: both roles, per group ----------------------------------------------------


def transfer_config(role, engine_id, **extra):
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"rpc_timeout_s": 1.0, "load_timeout_s": 5.0, **extra})


def connectors(mode, **kw):
    """Scheduler and worker connectors of a producer "P" and a consumer "D" over the hybrid config."""
    return tuple(RdmaConnector(transfer_config(role, engine, mode=mode), part, hybrid_config(),
                               **(kw if part is KVConnectorRole.WORKER else {}))
                 for role, engine in (("kv_producer", "P"), ("kv_consumer", "D"))
                 for part in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER))


def step(sched, work):
    """One engine step of ``sched``'s metadata on ``work``: (sending, recving)."""
    work.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput()))
    work.start_load_kv()
    sending, recving = work.get_finished(set())
    work.clear_connector_metadata()
    return sending, recving


def test_scheduler_offers_and_loads_the_window_per_group():
    p = RdmaConnector(transfer_config("kv_producer", "P", side_channel_port=5000),
                      KVConnectorRole.SCHEDULER, hybrid_config())
    prompt = list(range(1, 18))  # 17 tokens: 5 blocks; the window of token 16 starts in block 3
    prefill = Request("p1", prompt, {"do_remote_decode": True})
    prefill.num_computed_tokens = 17
    # vLLM hands the sliding group's list with null-block placeholders (0) where it freed blocks
    delay, params = p.request_finished_all_groups(prefill, ([0, 0, 0, 13, 14], [20, 21, 22, 23, 24]))
    assert delay and params["remote_block_ids"] == [[13, 14], [20, 21, 22, 23, 24]]
    (send,) = p.build_connector_meta(SchedulerOutput()).sends
    assert send.block_ids == ((13, 14), (20, 21, 22, 23, 24))  # the placeholders are not held

    d = RdmaConnector(transfer_config("kv_consumer", "D"), KVConnectorRole.SCHEDULER, hybrid_config())
    decode = Request("d1", prompt, params)
    assert d.get_num_new_matched_tokens(decode, 0) == (17, True)
    d.update_state_after_alloc(decode, KVCacheBlocks.of([0, 0, 0, 43, 44], [50, 51, 52, 53, 54]), 17)
    (load,) = d.build_connector_meta(SchedulerOutput()).loads
    assert load.error is None
    assert load.local_block_ids == ((43, 44), (50, 51, 52, 53, 54))
    assert load.remote_block_ids == ((13, 14), (20, 21, 22, 23, 24))
    assert load.num_skipped_blocks == (3, 0)

    # a producer that sent one group for a two-group consumer: computed locally
    wrong = Request("d2", prompt, {**params, "remote_block_ids": [20, 21, 22, 23, 24]})
    assert d.get_num_new_matched_tokens(wrong, 0) == (0, False)


# --- two workers over the fake transport -----------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_hybrid_load_reads_the_window_bit_exact_and_records_the_bytes_skipped(mode):
    """Pull reads the window; push (the producer writes) writes only it, and
    touches nothing else of the decode's cache."""
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    p_sched, p_work, d_sched, d_work = connectors(mode, **kw)
    src, dst = kv_caches(fill=1.0), kv_caches()
    try:
        p_work.register_kv_caches(src)
        d_work.register_kv_caches(dst)
        p_sched.set_xfer_handshake_metadata({0: p_work.get_handshake_metadata()})

        prompt = list(range(1, 18))
        prefill = Request("r", prompt, {"do_remote_decode": True})
        prefill.num_computed_tokens = len(prompt)
        sliding_p, full_p = [0, 0, 0, 13, 14], [20, 21, 22, 23, 24]
        _, params = p_sched.request_finished_all_groups(prefill, (sliding_p, full_p))
        step(p_sched, p_work)  # the lease reaches the producer's worker

        decode = Request("r", prompt, params)
        n, _ = d_sched.get_num_new_matched_tokens(decode, 0)
        sliding_d, full_d = [0, 0, 0, 43, 44], [50, 51, 52, 53, 54]
        d_sched.update_state_after_alloc(decode, KVCacheBlocks.of(sliding_d, full_d), n)
        done: set[str] = set()

        def pump():
            step(p_sched, p_work)
            done.update(step(d_sched, d_work)[1])

        wait_until(lambda: "r" in done, step=pump, what="the hybrid load")
        assert d_work.get_block_ids_with_load_errors() == set()
        # Pull: the data, its held words' read chained behind it (``heldwords``).
        assert (fabric.reads, fabric.chained, fabric.writes) == ((1, 1, 0) if mode == "pull" else (0, 0, 1))
        for name, (mine, theirs) in {"l0": (sliding_d, sliding_p), "l2": (sliding_d, sliding_p),
                                     "l1": (full_d, full_p)}.items():
            first = 3 if name != "l1" else 0
            for i in range(first, 5):
                assert np.array_equal(dst[name][mine[i]], src[name][theirs[i]]), (name, i)
        # the blocks before the window were not read: nothing outside the load changed
        touched = {"l0": {43, 44}, "l2": {43, 44}, "l1": set(full_d)}
        for name, blocks in touched.items():
            rest = [b for b in range(NUM_BLOCKS) if b not in blocks]
            assert not dst[name][rest].any(), name
        stats = d_work.get_kv_connector_stats()
        (record,) = stats["requests"]
        page = FULL.page_size_bytes
        assert record["ok"] and record["nbytes"] == (2 * 2 + 5) * page
        assert record["nbytes_skipped"] == stats["totals"]["nbytes_skipped"] == 3 * 2 * page
        assert record["num_blocks"] == 2 + 5
    finally:
        p_work.shutdown()
        d_work.shutdown()


def test_block_size_mismatch_is_refused_with_what_to_set(caplog):
    """A producer at block size 8 sends 3 blocks for 17 tokens; a consumer at
    block size 4 needs 5: the params are refused before any handshake, with
    the advice (the handshake's own refusal is in test_sidechannel)."""
    big = FullAttentionSpec(block_size=2 * BS, num_kv_heads=HEADS, head_size=HEAD, dtype="float32")
    p = RdmaConnector(transfer_config("kv_producer", "P", side_channel_port=5000),
                      KVConnectorRole.SCHEDULER, KVCacheConfig.uniform(NUM_BLOCKS, LAYERS, big))
    prefill = Request("p1", range(1, 18), {"do_remote_decode": True})
    prefill.num_computed_tokens = 17
    _, params = p.request_finished(prefill, [1, 2, 3])
    d = RdmaConnector(transfer_config("kv_consumer", "D"), KVConnectorRole.SCHEDULER,
                      KVCacheConfig.uniform(NUM_BLOCKS, LAYERS, FULL))
    with caplog.at_level("WARNING"):
        assert d.get_num_new_matched_tokens(Request("d1", range(1, 18), params), 0) == (0, False)
    assert "has 3 blocks" in caplog.text and "needs 5 at block size 4" in caplog.text
    assert "computing locally" in caplog.text and "same --block-size" in caplog.text


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_peer_geometry_that_groups_layers_otherwise_is_refused(mode, monkeypatch):
    """The block geometry a peer announces (a producer's in its handshake
    reply, a decode's in its PUSH_HELLO) is its own word, apart from its
    compatibility record. One that puts the layers in other KV-cache groups
    with the same number of rows per group (here l0 in the full group, l1 in
    the sliding one) used to pass the bytes-per-row check: the slot indices
    of the two sides paired layer l0's window blocks with another layer's
    blocks of the full group, and the load ended ok with the wrong bytes
    (found by a review of the geometry mapping). Now the rows' groups must
    match too: the load fails naming the mismatch. Real UCX on loopback."""
    import dataclasses

    from rdma_kv.connector.geometry import KVCacheGeometry
    from rdma_kv.connector.rdma import wire

    def regrouped(geometry: KVCacheGeometry) -> KVCacheGeometry:
        swap = {"l0": 1, "l1": 0, "l2": 0}
        return KVCacheGeometry(geometry.regions, tuple(dataclasses.replace(layer, group=swap[layer.name])
                                                       for layer in geometry.layers))

    p_sched, p_work, d_sched, d_work = connectors(mode)
    src, dst = kv_caches(fill=1.0), kv_caches()
    # What a peer announces (the producer's handshake reply, the decode's PUSH_HELLO): regrouped.
    announce = wire.GeometryWire.from_geometry
    monkeypatch.setattr(wire.GeometryWire, "from_geometry", classmethod(lambda cls, g: announce(regrouped(g))))
    try:
        p_work.register_kv_caches(src)
        d_work.register_kv_caches(dst)
        p_sched.set_xfer_handshake_metadata({0: p_work.get_handshake_metadata()})

        prompt = list(range(1, 18))
        prefill = Request("r", prompt, {"do_remote_decode": True})
        prefill.num_computed_tokens = len(prompt)
        sliding_p, full_p = [0, 0, 0, 13, 14], [20, 21, 22, 23, 24]
        _, params = p_sched.request_finished_all_groups(prefill, (sliding_p, full_p))
        step(p_sched, p_work)
        decode = Request("r", prompt, params)
        n, _ = d_sched.get_num_new_matched_tokens(decode, 0)
        sliding_d, full_d = [0, 0, 0, 43, 44], [50, 51, 52, 53, 54]
        d_sched.update_state_after_alloc(decode, KVCacheBlocks.of(sliding_d, full_d), n)
        done: set[str] = set()

        def pump():
            step(p_sched, p_work)
            done.update(step(d_sched, d_work)[1])

        wait_until(lambda: "r" in done, step=pump, what="the load")
        wrong = [(name, i) for name, (mine, theirs) in {"l0": (sliding_d, sliding_p), "l2": (sliding_d, sliding_p),
                                                       "l1": (full_d, full_p)}.items()
                 for i in range(3 if name != "l1" else 0, 5)
                 if not np.array_equal(dst[name][mine[i]], src[name][theirs[i]])]
        errors = d_work.get_block_ids_with_load_errors()
        assert errors, f"a geometry grouping the layers otherwise was accepted; wrong blocks: {wrong}"
        (record,) = d_work.get_kv_connector_stats()["requests"]
        assert not record["ok"] and "group" in record["error"], record
    finally:
        p_work.shutdown()
        d_work.shutdown()


def test_runs_and_skipped_bytes_count_each_groups_rows():
    """A read's runs are per row of the group whose ids it takes (rows per
    group kept on the table), and bytes a window skipped are per group."""
    slots = SlotTable(derive_geometry(kv_caches(), hybrid_config()))
    assert slots.group_rows.tolist() == [2, 1]
    sliding_l, sliding_r = np.array([7, 8]), np.array([1, 2])  # one run
    full_l, full_r = np.array([3, 4, 5, 6]), np.array([9, 10, 0, 1])  # two runs
    pairs = BlockPairs.of((sliding_l, full_l), (sliding_r, full_r))
    assert pairs.runs(slots) == 2 * 1 + 1 * 2
    assert count_runs((sliding_l, full_l), (sliding_r, full_r), slots) == 4
    page = FULL.page_size_bytes
    assert slots.skipped_nbytes([0, 0]) == slots.skipped_nbytes(()) == 0
    assert slots.skipped_nbytes([3, 0]) == 3 * 2 * page and slots.skipped_nbytes((1, 2)) == 2 * page + 2 * page
