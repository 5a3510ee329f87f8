"""StorageConnector: save in one engine, load bit-exact in a fresh one
(same process and a spawned process), prefix rules, failures as load errors."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import traceback

import numpy as np
import pytest
import torch

import kv_harness
from kv_harness import (
    BLOCK_SIZE,
    HEAD_SIZE,
    LAYERS,
    NUM_BLOCKS,
    NUM_HEADS,
    NUM_LAYERS,
    MiniEngine,
    expected_block,
    storage_config,
)
from rdma_kv.connector import (
    CachedRequestData,
    KVCacheBlocks,
    KVConnectorFactory,
    KVConnectorOutput,
    KVConnectorRole,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from rdma_kv.connector.storage import StorageConnectorMetadata, chained_block_keys
from rdma_kv.errors import ConfigError, NotInitializedError, SpecError


def _prompt(rng, num_tokens):
    return rng.integers(0, 50_000, size=num_tokens).tolist()


def _layer_blocks(engine, block_ids):
    """The bytes of ``block_ids`` in every layer, as one array per layer."""
    return {
        name: engine.kv_caches[name][list(block_ids)].contiguous().view(torch.uint8).numpy().copy()
        for name in LAYERS
    }


def _assert_holds_expected(engine, tokens, block_ids, block_indices):
    for layer_index, name in enumerate(LAYERS):
        for i in block_indices:
            got = engine.kv_caches[name][block_ids[i]]
            assert torch.equal(got, expected_block(tokens, i, layer_index)), (name, i)


def test_saved_blocks_load_bit_exact_in_a_fresh_engine(tmp_path, rng):
    tokens = _prompt(rng, 5 * BLOCK_SIZE + 2)  # 5 full blocks and a partial one
    producer = MiniEngine(storage_config(tmp_path, "kv_producer"), fill_seed=1)
    saved = producer.prefill(Request("p1", tokens))
    assert saved["num_external"] == 0
    assert [len(s.keys) for s in saved["meta"].saves] == [5]
    assert saved["delay_free"] is False and saved["params"] is None
    files = sorted(p.name for p in tmp_path.rglob("*.safetensors"))
    assert len(files) == 5
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporaries

    consumer = MiniEngine(storage_config(tmp_path, "kv_consumer"), fill_seed=2, first_block=7)
    loaded = consumer.prefill(Request("c1", tokens))
    assert loaded["num_external"] == 5 * BLOCK_SIZE
    assert loaded["output"].invalid_block_ids == frozenset()
    ids_p, ids_c = saved["block_ids"], loaded["block_ids"]
    assert ids_p[:5] != ids_c[:5]  # different physical blocks, same content
    want = _layer_blocks(producer, ids_p[:5])
    got = _layer_blocks(consumer, ids_c[:5])
    for name in LAYERS:
        np.testing.assert_array_equal(got[name], want[name])
    _assert_holds_expected(consumer, tokens, ids_c, range(5))
    assert not consumer.scheduler.config.is_kv_producer
    assert loaded["meta"].saves == ()  # a consumer never saves


def test_never_the_whole_prompt_and_only_beyond_local_hits(tmp_path, rng):
    tokens = _prompt(rng, 4 * BLOCK_SIZE)  # exactly 4 blocks
    MiniEngine(storage_config(tmp_path)).prefill(Request("a", tokens))
    engine = MiniEngine(storage_config(tmp_path), fill_seed=3)
    sched = engine.scheduler
    # All 4 blocks are stored, but the last token must be computed: 3 blocks.
    assert sched.get_num_new_matched_tokens(Request("b", tokens), 0) == (3 * BLOCK_SIZE, False)
    # Local prefix hits are not loaded again.
    assert sched.get_num_new_matched_tokens(Request("b", tokens), 2 * BLOCK_SIZE) == (BLOCK_SIZE, False)
    assert sched.get_num_new_matched_tokens(Request("b", tokens), 3 * BLOCK_SIZE) == (0, False)
    # One more token makes the 4th block loadable.
    longer = Request("c", tokens + [7])
    assert sched.get_num_new_matched_tokens(longer, 0) == (4 * BLOCK_SIZE, False)


def test_a_local_prefix_hit_loads_only_the_later_blocks(tmp_path, rng):
    tokens = _prompt(rng, 4 * BLOCK_SIZE + 1)
    MiniEngine(storage_config(tmp_path)).prefill(Request("a", tokens))
    engine = MiniEngine(storage_config(tmp_path), fill_seed=4)
    request = Request("b", tokens)
    assert engine.scheduler.get_num_new_matched_tokens(request, BLOCK_SIZE) == (3 * BLOCK_SIZE, False)
    block_ids = [3, 9, 12, 20, 21]
    engine.scheduler.update_state_after_alloc(request, KVCacheBlocks.of(block_ids), 3 * BLOCK_SIZE)
    before = engine.kv_caches[LAYERS[0]][3].clone()
    meta, _ = engine.step(SchedulerOutput())
    (load,) = meta.loads
    assert load.block_ids == (9, 12, 20)
    assert torch.equal(engine.kv_caches[LAYERS[0]][3], before)  # block 0 untouched
    _assert_holds_expected(engine, tokens, block_ids, [1, 2, 3])


def test_the_chain_makes_a_key_name_the_whole_prefix(tmp_path, rng):
    tokens = _prompt(rng, 3 * BLOCK_SIZE + 1)
    MiniEngine(storage_config(tmp_path)).prefill(Request("a", tokens))
    engine = MiniEngine(storage_config(tmp_path))
    other_start = [tokens[0] + 1] + tokens[1:]  # same blocks 1 and 2, different block 0
    assert engine.scheduler.get_num_new_matched_tokens(Request("b", other_start), 0) == (0, False)
    shared_prefix = tokens[: 2 * BLOCK_SIZE] + [1] * (BLOCK_SIZE + 1)
    assert engine.scheduler.get_num_new_matched_tokens(Request("c", shared_prefix), 0) == (
        2 * BLOCK_SIZE, False)
    keys = chained_block_keys(tokens, BLOCK_SIZE, b"seed")
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys[:2] == chained_block_keys(tokens[: 2 * BLOCK_SIZE], BLOCK_SIZE, b"seed")
    assert keys != chained_block_keys(tokens, BLOCK_SIZE, b"other")


def test_namespaces_do_not_share_blocks(tmp_path, rng):
    tokens = _prompt(rng, 3 * BLOCK_SIZE + 1)
    MiniEngine(storage_config(tmp_path, namespace="llama-a")).prefill(Request("a", tokens))
    other = MiniEngine(storage_config(tmp_path, namespace="llama-b"))
    assert other.scheduler.get_num_new_matched_tokens(Request("b", tokens), 0) == (0, False)
    same = MiniEngine(storage_config(tmp_path, namespace="llama-a"))
    assert same.scheduler.get_num_new_matched_tokens(Request("b", tokens), 0)[0] == 3 * BLOCK_SIZE


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete"])
def test_damaged_files_become_load_errors_from_that_block_on(tmp_path, rng, damage):
    tokens = _prompt(rng, 4 * BLOCK_SIZE + 1)
    MiniEngine(storage_config(tmp_path)).prefill(Request("a", tokens))
    engine = MiniEngine(storage_config(tmp_path), fill_seed=5)
    request = Request("b", tokens)
    assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (4 * BLOCK_SIZE, False)
    keys = chained_block_keys(tokens, BLOCK_SIZE, engine.scheduler._seed)
    path = engine.scheduler.path_for(keys[2])
    data = bytearray(open(path, "rb").read())
    if damage == "flip_byte":
        data[-5] ^= 0xFF
        open(path, "wb").write(bytes(data))
    elif damage == "truncate":
        open(path, "wb").write(bytes(data[: len(data) // 2]))
    else:
        os.unlink(path)
    block_ids = [30, 29, 28, 27, 26]
    engine.scheduler.update_state_after_alloc(request, KVCacheBlocks.of(block_ids), 4 * BLOCK_SIZE)
    before = engine.kv_caches[LAYERS[0]][28].clone()
    _, output = engine.step(SchedulerOutput())
    assert output.invalid_block_ids == frozenset({28, 27})  # block 2 and everything after
    _assert_holds_expected(engine, tokens, block_ids, [0, 1])
    assert torch.equal(engine.kv_caches[LAYERS[0]][28], before)  # nothing half-written
    assert engine.worker.get_block_ids_with_load_errors() == set()  # reported once


def test_a_file_from_another_layout_is_refused(tmp_path, rng):
    tokens = _prompt(rng, 2 * BLOCK_SIZE + 1)
    engine = MiniEngine(storage_config(tmp_path), fill_seed=6)
    engine.prefill(Request("a", tokens))
    engine.worker._layout_signature = lambda: "[]"  # as if the loader's layout differed
    request = Request("b", tokens)
    assert engine.scheduler.get_num_new_matched_tokens(request, 0)[0] == 2 * BLOCK_SIZE
    engine.scheduler.update_state_after_alloc(request, KVCacheBlocks.of([1, 2, 3]), 2 * BLOCK_SIZE)
    _, output = engine.step(SchedulerOutput())
    assert output.invalid_block_ids == frozenset({1, 2})


def _hnd_caches():
    """The harness's cache shape with heads inside tokens (HND): the same
    sizes, every block's bytes permuted."""
    whole = torch.zeros(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, 2 * HEAD_SIZE,
                        dtype=torch.bfloat16)
    return whole, {name: whole[i].permute(0, 2, 1, 3) for i, name in enumerate(LAYERS)}


def test_engines_of_two_layouts_in_one_namespace_keep_apart(tmp_path, rng):
    """NHD and HND blocks have the same sizes and permuted bytes. Before,
    both layouts' files had one name per block: the second engine found the
    first's files, refused every one at load (its layout check) and could
    never store its own, so the prefix missed there for good (or the two
    replaced each other's files). Now each layout has its own directory
    under the namespace: each engine misses the other's files, saves and
    loads its own, bit-exact."""
    tokens = _prompt(rng, 2 * BLOCK_SIZE + 1)
    nhd = MiniEngine(storage_config(tmp_path), fill_seed=1)
    nhd.prefill(Request("p", tokens))
    hnd = MiniEngine(storage_config(tmp_path), fill_seed=2)
    whole, caches = _hnd_caches()
    hnd.register(caches)  # same shape and sizes, other order
    assert hnd.worker.directory != nhd.worker.directory
    assert hnd.scheduler.directory == hnd.worker.directory  # told by the handshake
    first = hnd.prefill(Request("c", tokens))
    assert first["num_external"] == 0  # the NHD files are not this layout's
    assert first["output"].invalid_block_ids == frozenset()
    assert [len(s.keys) for s in first["meta"].saves] == [2]
    for engine, name in ((hnd, "c2"), (nhd, "p2")):
        again = engine.prefill(Request(name, tokens))
        assert again["num_external"] == 2 * BLOCK_SIZE, name
        assert again["output"].invalid_block_ids == frozenset(), name
        _assert_holds_expected(engine, tokens, again["block_ids"], range(2))


def test_a_file_saved_in_another_memory_order_is_refused(tmp_path, rng):
    """The load's layout check stays: a file of the NHD layout put where
    the HND engine's file of the block belongs is refused, nothing copied."""
    tokens = _prompt(rng, 2 * BLOCK_SIZE + 1)
    producer = MiniEngine(storage_config(tmp_path, "kv_producer"), fill_seed=1)
    producer.prefill(Request("p", tokens))
    consumer = MiniEngine(storage_config(tmp_path, "kv_consumer"), fill_seed=2)
    whole, caches = _hnd_caches()
    consumer.register(caches)
    for key in chained_block_keys(tokens, BLOCK_SIZE, producer.worker._seed)[:2]:
        os.makedirs(os.path.dirname(consumer.worker.path_for(key)), exist_ok=True)
        shutil.copy(producer.worker.path_for(key), consumer.worker.path_for(key))
    loaded = consumer.prefill(Request("c", tokens))
    assert loaded["num_external"] == 2 * BLOCK_SIZE  # the scheduler sees the files
    assert loaded["output"].invalid_block_ids == frozenset(loaded["block_ids"][:2])
    assert not whole.any()  # nothing was copied into the loader's blocks


@pytest.mark.parametrize("damage", ["flip_byte", "another_layout"])
def test_a_file_that_fails_to_load_is_missed_then_replaced(tmp_path, rng, caplog, damage):
    """A stored file that failed verification stayed: every later request
    with the prefix was offered it, failed to load it (a warning and a
    recompute each time) and saved nothing after it, so the prefix missed
    from that block on for good. Now the failure is reported once: the
    scheduler offers the block no more, and the next save of the block
    replaces the file (atomically), so later requests hit again."""
    tokens = _prompt(rng, 4 * BLOCK_SIZE + 1)
    MiniEngine(storage_config(tmp_path)).prefill(Request("a", tokens))
    engine = MiniEngine(storage_config(tmp_path), fill_seed=5, first_block=8)
    keys = chained_block_keys(tokens, BLOCK_SIZE, engine.scheduler._seed)
    path = engine.worker.path_for(keys[1])
    if damage == "flip_byte":
        data = bytearray(open(path, "rb").read())
        data[-5] ^= 0xFF
        open(path, "wb").write(bytes(data))
    else:  # as saved by an engine whose layout signature differs
        other = MiniEngine(storage_config(tmp_path / "other"))
        other.worker._layout_signature = lambda: "[]"
        other.prefill(Request("o", tokens))
        shutil.copy(other.worker.path_for(keys[1]), path)
    first = engine.prefill(Request("b", tokens))
    assert first["num_external"] == 4 * BLOCK_SIZE
    assert first["output"].invalid_block_ids == frozenset(first["block_ids"][1:4])
    second = engine.prefill(Request("c", tokens))
    assert second["num_external"] == BLOCK_SIZE  # block 1 is not offered again
    assert second["output"].invalid_block_ids == frozenset()
    (save,) = second["meta"].saves
    assert save.keys == (keys[1],) and save.replace == (keys[1],)  # 2 and 3 are fine
    assert not list(tmp_path.rglob("*.tmp"))
    third = engine.prefill(Request("d", tokens))
    assert third["num_external"] == 4 * BLOCK_SIZE
    assert third["output"].invalid_block_ids == frozenset()
    _assert_holds_expected(engine, tokens, third["block_ids"], range(4))
    failures = [r for r in caplog.records if "loading block" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]


def test_chunked_prefill_saves_once_the_prompt_is_complete(tmp_path, rng):
    tokens = _prompt(rng, 3 * BLOCK_SIZE)
    engine = MiniEngine(storage_config(tmp_path, "kv_producer"))
    block_ids = [5, 6, 7]
    new = NewRequestData("r", tuple(tokens), (tuple(block_ids),), 0)
    first = SchedulerOutput(scheduled_new_reqs=(new,),
                                       num_scheduled_tokens={"r": 2 * BLOCK_SIZE})
    meta, _ = engine.step(first, {"r": (tokens[: 2 * BLOCK_SIZE], block_ids, 0)})
    assert meta.saves == ()
    cached = CachedRequestData("r", None, 2 * BLOCK_SIZE)
    second = SchedulerOutput(scheduled_cached_reqs=(cached,),
                                        num_scheduled_tokens={"r": BLOCK_SIZE})
    meta, _ = engine.step(second, {"r": (tokens, block_ids, 2)})
    assert [s.block_ids for s in meta.saves] == [(5, 6, 7)]
    third = SchedulerOutput(scheduled_cached_reqs=(cached,), num_scheduled_tokens={"r": 1})
    meta, _ = engine.step(third)
    assert meta.saves == ()  # saved once
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3


def test_blocks_already_stored_are_not_written_again(tmp_path, rng):
    tokens = _prompt(rng, 3 * BLOCK_SIZE + 1)
    MiniEngine(storage_config(tmp_path)).prefill(Request("a", tokens))
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.safetensors")}
    engine = MiniEngine(storage_config(tmp_path))
    result = engine.prefill(Request("b", tokens + [1] * BLOCK_SIZE))
    assert result["num_external"] == 3 * BLOCK_SIZE
    assert [len(s.keys) for s in result["meta"].saves] == [1]  # only the new 4th block
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


def test_config_and_contract_errors(tmp_path):
    _, kvcc = kv_harness.cpu_kv_caches()
    create = KVConnectorFactory.create_connector
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config key\(s\) \['storage_dir'\]"):
        create(storage_config(tmp_path, storage_dir="x"), KVConnectorRole.SCHEDULER, kvcc)
    with pytest.raises(ConfigError, match="no key 'storage_path'"):
        cfg = storage_config(tmp_path).replace(kv_connector_extra_config={})
        create(cfg, KVConnectorRole.SCHEDULER, kvcc)
    with pytest.raises(ConfigError, match="needs the engine's KVCacheConfig"):
        create(storage_config(tmp_path), KVConnectorRole.SCHEDULER, None)
    with pytest.raises(ConfigError, match="must be bool"):
        create(storage_config(tmp_path, fsync="yes"), KVConnectorRole.SCHEDULER, kvcc)
    sched = create(storage_config(tmp_path), KVConnectorRole.SCHEDULER, kvcc)
    with pytest.raises(NotInitializedError, match="without a preceding get_num_new_matched_tokens"):
        sched.update_state_after_alloc(Request("x", [1] * 9), KVCacheBlocks.of([1, 2, 3]), 8)
    # Before the worker's handshake metadata the scheduler knows no layout: the cache is off.
    assert sched.get_num_new_matched_tokens(Request("x", [1] * 9), 0) == (0, False)
    with pytest.raises(ConfigError, match="expected one worker layout"):
        sched.set_xfer_handshake_metadata({})
    with pytest.raises(NotInitializedError, match="no layout yet"):
        sched.path_for("ab" * 32)
    worker = create(storage_config(tmp_path), KVConnectorRole.WORKER, kvcc)
    assert worker.get_handshake_metadata() is None
    worker.bind_connector_metadata(StorageConnectorMetadata())
    with pytest.raises(NotInitializedError, match="register_kv_caches"):
        worker._block_views(0)
    shape = (2, kv_harness.NUM_BLOCKS, BLOCK_SIZE, kv_harness.NUM_HEADS, kv_harness.HEAD_SIZE)
    off_host = {n: torch.empty(shape, dtype=torch.bfloat16, device="meta") for n in LAYERS}
    with pytest.raises(SpecError, match="device 'meta'"):
        worker.register_kv_caches(off_host)


# --- a later engine in another process ---------------------------------------------


def _child_load(storage_path: str, tokens: list[int], queue) -> None:
    try:
        import kv_harness as harness
        from rdma_kv.connector import Request as Req

        engine = harness.MiniEngine(harness.storage_config(storage_path, "kv_consumer"),
                                    fill_seed=99, first_block=11)
        result = engine.prefill(Req("child", tokens))
        blocks = result["block_ids"][: result["num_external"] // harness.BLOCK_SIZE]
        data = {
            name: engine.kv_caches[name][blocks].contiguous().view(torch.uint8).numpy().tobytes()
            for name in harness.LAYERS
        }
        queue.put(("ok", result["num_external"], sorted(result["output"].invalid_block_ids), data))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_spawned_process_loads_what_this_one_saved(tmp_path, rng):
    tokens = _prompt(rng, 6 * BLOCK_SIZE + 3)
    producer = MiniEngine(storage_config(tmp_path, "kv_producer"), fill_seed=7)
    saved = producer.prefill(Request("p", tokens))
    want = _layer_blocks(producer, saved["block_ids"][:6])

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_load, args=(str(tmp_path), tokens, queue))
    child.start()
    try:
        message = queue.get(timeout=90)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert message[0] == "ok", f"child failed:\n{message[1]}"
    _, num_external, errors, data = message
    assert num_external == 6 * BLOCK_SIZE and errors == []
    for name in LAYERS:
        assert data[name] == want[name].tobytes(), name
    assert child.exitcode == 0


class _ContextEngine(MiniEngine):
    """A MiniEngine whose forward pass, like attention, makes a block's KV
    depend on the KV of the block before it in the cache: KV computed over a
    block that failed to load is wrong, as in a real model."""

    def step(self, scheduler_output, compute={}):
        contextual = {}
        for rid, (tokens, block_ids, first) in compute.items():
            contextual[rid] = (tokens, block_ids, len(block_ids))  # the base writes nothing
            self._pending = (tokens, block_ids, first)
        original = self.worker.save_kv_layer

        def save_kv_layer(name, kv_layer, attn_metadata=None, **kwargs):
            tokens, block_ids, first = self._pending
            layer_index = LAYERS.index(name)
            for i in range(first, len(block_ids)):
                if (i + 1) * BLOCK_SIZE <= len(tokens):
                    value = expected_block(tokens, i, layer_index)
                    if i > 0:
                        value = value + self.kv_caches[name][block_ids[i - 1]] / 2
                    self.kv_caches[name][block_ids[i]] = value
            original(name, kv_layer, attn_metadata, **kwargs)

        self.worker.save_kv_layer = save_kv_layer
        try:
            return super().step(scheduler_output, contextual)
        finally:
            del self.worker.save_kv_layer


def fail_one_read(engine, key: str) -> list:
    """The engine's worker fails its first read of ``key`` with a transient
    I/O error; returns the list that gets the failed block id."""
    read_block = engine.worker._read_block
    failed: list = []

    def read_once_failing(k, block_id):
        if k == key and not failed:  # a transient I/O error
            failed.append(block_id)
            raise OSError(5, "Input/output error")
        read_block(k, block_id)

    engine.worker._read_block = read_once_failing
    return failed


def test_blocks_computed_over_a_failed_load_are_not_saved(tmp_path, rng):
    """A synchronous load that fails leaves the block's old bytes in place,
    and the same step's forward pass computes the prompt's later blocks
    over them (vLLM drops them from its own prefix cache and recomputes).
    They were saved under their prefix's keys anyway, as valid files: once
    the failed block could be read again, every later request with that
    prefix loaded KV computed over garbage."""
    short = _prompt(rng, 3 * BLOCK_SIZE + 1)
    long = short[: 3 * BLOCK_SIZE] + _prompt(rng, 3 * BLOCK_SIZE + 1)
    reference = _ContextEngine(storage_config(tmp_path / "reference", "kv_producer"))
    ref_blocks = reference.prefill(Request("ref", long))["block_ids"]

    _ContextEngine(storage_config(tmp_path / "cache")).prefill(Request("a", short))
    engine = _ContextEngine(storage_config(tmp_path / "cache"), fill_seed=3, first_block=8)
    keys = chained_block_keys(long, BLOCK_SIZE, engine.worker._seed)
    failed = fail_one_read(engine, keys[1])
    result = engine.prefill(Request("b", long))
    assert result["num_external"] == 3 * BLOCK_SIZE and failed
    assert result["output"].invalid_block_ids == frozenset(result["block_ids"][1:3])
    assert not any(os.path.exists(engine.worker.path_for(k)) for k in keys[3:6])

    fresh = _ContextEngine(storage_config(tmp_path / "cache"), fill_seed=4, first_block=16)
    loaded = fresh.prefill(Request("c", long))
    for name in LAYERS:
        for i in range(6):
            assert torch.equal(fresh.kv_caches[name][loaded["block_ids"][i]],
                               reference.kv_caches[name][ref_blocks[i]]), (name, i)


def test_a_failed_save_is_logged_and_the_engine_carries_on(tmp_path, rng, monkeypatch, caplog):
    """A cache that cannot write (disk full, quota, a dead mount) must not
    stop the engine: ``wait_for_save`` raised ``OSError`` out of the
    forward step, which ends a vLLM engine with every request in it."""
    import errno

    from rdma_kv.connector import storage as storage_module

    tokens = _prompt(rng, 3 * BLOCK_SIZE + 1)
    engine = MiniEngine(storage_config(tmp_path, "kv_producer"))

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage_module.os, "fsync", full)
    result = engine.prefill(Request("a", tokens))  # raised before
    assert [len(s.keys) for s in result["meta"].saves] == [3]
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob("*.tmp"))
    assert "No space left on device" in caplog.text
    assert engine.worker.get_kv_connector_stats() == {"blocks_loaded": 0, "blocks_saved": 0,
                                                      "load_errors": 0, "save_errors": 1}
    monkeypatch.undo()
    engine.prefill(Request("b", tokens))  # the next request's save goes through
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3


# --- temporary files of interrupted saves ---------------------------------------------


def _child_save_stalled(storage_path: str, tokens: list[int], queue) -> None:
    """Save a prompt, stalling in the first block's fsync (the file written,
    not yet renamed) until killed: a writer mid-save, then a crash."""
    try:
        import time

        import kv_harness as harness
        from rdma_kv.connector import Request as Req

        def stall(fd):
            queue.put("writing")
            time.sleep(600)

        os.fsync = stall
        engine = harness.MiniEngine(harness.storage_config(storage_path, "kv_producer"))
        engine.prefill(Req("child", tokens))
        queue.put("error: the save did not stall")
    except BaseException:
        queue.put("error: " + traceback.format_exc())


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_crashed_save_leaves_no_temporary_file_but_a_live_one_is_kept(tmp_path, rng):
    """A save interrupted by a crash left its temporary file for good (never
    read, never removed). Now a worker removes at start-up the temporary
    files whose writer is gone, and keeps the one a live writer is writing."""
    tokens = _prompt(rng, 2 * BLOCK_SIZE + 1)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_save_stalled, args=(str(tmp_path), tokens, queue))
    child.start()
    try:
        assert queue.get(timeout=120) == "writing"
        (tmp,) = tmp_path.rglob("*.tmp")
        MiniEngine(storage_config(tmp_path))  # starts while the child writes
        assert tmp.exists()  # a live writer's file is kept
    finally:
        child.kill()  # the crash
        child.join(timeout=60)
    assert not child.is_alive()
    assert list(tmp_path.rglob("*.tmp")) == [tmp]
    engine = MiniEngine(storage_config(tmp_path))  # the next start-up
    assert not list(tmp_path.rglob("*.tmp"))
    assert engine.prefill(Request("a", tokens))["meta"].saves  # the block was never stored


def test_temporaries_of_other_hosts_are_removed_once_old(tmp_path):
    from rdma_kv.connector import storefiles

    engine = MiniEngine(storage_config(tmp_path))
    tmp_dir = os.path.join(engine.worker.directory, "tmp")
    os.makedirs(tmp_dir)
    host, pid_ns = storefiles._owner()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = "ab" * 32
    names = {
        "other_old": f"{key}.otherhost.1.77.00aa.tmp",
        "other_recent": f"{key}.otherhost.1.78.00ab.tmp",
        "here_dead": f"{key}.{host}.{pid_ns}.{dead.pid}.00ac.tmp",
        "here_live_old": f"{key}.{host}.{pid_ns}.{os.getpid()}.00ad.tmp",
        "not_ours": "notes.txt",
    }
    for label, name in names.items():
        open(os.path.join(tmp_dir, name), "wb").write(b"x")
    old = storefiles.STALE_TMP_S + 60
    for label in ("other_old", "here_live_old"):
        path = os.path.join(tmp_dir, names[label])
        os.utime(path, (os.stat(path).st_atime - old, os.stat(path).st_mtime - old))
    MiniEngine(storage_config(tmp_path))
    assert sorted(os.listdir(tmp_dir)) == sorted(
        names[label] for label in ("other_recent", "here_live_old", "not_ours"))


# --- asynchronous scheduling -----------------------------------------------------------


def _contextual_worker_step(engine, meta, compute=(), finished=frozenset()):
    """The worker's half of one step (vLLM's execute_model), with a forward
    pass whose block KV depends on the block before it, like attention:
    ``compute`` is ``(tokens, block_ids, first, last)`` per request."""
    worker = engine.worker
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for layer_index, name in enumerate(LAYERS):
        worker.wait_for_layer_load(name)
        for tokens, block_ids, first, last in compute:
            for i in range(first, last):
                value = expected_block(tokens, i, layer_index)
                if i > 0:
                    value = value + engine.kv_caches[name][block_ids[i - 1]] / 2
                engine.kv_caches[name][block_ids[i]] = value
        worker.save_kv_layer(name, engine.kv_caches[name], None)
    worker.wait_for_save()
    sending, recving = worker.get_finished(finished)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return KVConnectorOutput.of(sending, recving, errors)


def _contextual_reference(tokens, num_blocks):
    blocks = []
    for i in range(num_blocks):
        layers = []
        for layer_index in range(NUM_LAYERS):
            value = expected_block(tokens, i, layer_index)
            if i > 0:
                value = value + blocks[i - 1][layer_index] / 2
            layers.append(value)
        blocks.append(layers)
    return blocks


def _admit(engine, request, block_ids):
    num_external, _ = engine.scheduler.get_num_new_matched_tokens(request, 0)
    engine.scheduler.update_state_after_alloc(request, KVCacheBlocks.of(block_ids), num_external)
    return num_external


def test_async_scheduling_saves_nothing_of_a_request_whose_load_failed(tmp_path, rng):
    """vLLM's async scheduling (a batch queue of 2) schedules step N+1
    before it hears of step N's load errors. A chunked prefill whose load
    failed in step N had its last chunk, scheduled in N+1, saved in N+1:
    blocks computed over the failed block's stale bytes, stored as valid
    files (the worker remembered failed loads for their own step only).
    Now nothing of that request is saved until it finishes; a later request
    (on the same, reused blocks) saves the prefix correctly."""
    short = _prompt(rng, 3 * BLOCK_SIZE + 1)
    long = short[: 3 * BLOCK_SIZE] + _prompt(rng, 3 * BLOCK_SIZE + 1)  # 6 full blocks
    store = MiniEngine(storage_config(tmp_path), fill_seed=1)
    ids = list(range(3, 7))
    _admit(store, Request("a", short), ids)
    meta = store.scheduler.build_connector_meta(SchedulerOutput(
        scheduled_new_reqs=(NewRequestData("a", tuple(short), (tuple(ids),), 0),),
        num_scheduled_tokens={"a": len(short)}))
    store.scheduler.update_connector_output(
        _contextual_worker_step(store, meta, [(short, ids, 0, 3)]))
    keys = chained_block_keys(long, BLOCK_SIZE, store.worker._seed)
    assert [os.path.exists(store.worker.path_for(k)) for k in keys] == [True] * 3 + [False] * 3

    engine = MiniEngine(storage_config(tmp_path), fill_seed=3)
    sched = engine.scheduler
    failed = fail_one_read(engine, keys[1])
    ids = list(range(10, 17))
    assert _admit(engine, Request("r", long), ids) == 3 * BLOCK_SIZE
    # step N: load blocks 0-2, compute block 3 (a chunk)
    meta_n = sched.build_connector_meta(SchedulerOutput(
        scheduled_new_reqs=(NewRequestData("r", tuple(long), (tuple(ids),), 3 * BLOCK_SIZE),),
        num_scheduled_tokens={"r": BLOCK_SIZE}))
    assert meta_n.saves == ()
    # step N+1 is scheduled before step N's output comes back: the last chunk, and the save
    cached = CachedRequestData("r", None, 4 * BLOCK_SIZE)
    meta_n1 = sched.build_connector_meta(SchedulerOutput(
        scheduled_cached_reqs=(cached,), num_scheduled_tokens={"r": 2 * BLOCK_SIZE + 1}))
    assert [s.keys for s in meta_n1.saves] == [tuple(keys[3:])]
    out_n = _contextual_worker_step(engine, meta_n, [(long, ids, 3, 4)])
    out_n1 = _contextual_worker_step(engine, meta_n1, [(long, ids, 4, 6)])
    assert failed and out_n.invalid_block_ids == frozenset(ids[1:3])
    sched.update_connector_output(out_n)
    sched.update_connector_output(out_n1)
    assert not any(os.path.exists(engine.worker.path_for(k)) for k in keys[3:])

    # The request finishes (vLLM recomputed it); the next one gets its blocks.
    sched.request_finished(Request("r", long), ids)
    assert _admit(engine, Request("s", long), ids) == BLOCK_SIZE  # block 1 failed: missed
    meta = sched.build_connector_meta(SchedulerOutput(
        scheduled_new_reqs=(NewRequestData("s", tuple(long), (tuple(ids),), BLOCK_SIZE),),
        num_scheduled_tokens={"s": len(long) - BLOCK_SIZE}, finished_req_ids=frozenset({"r"})))
    out = _contextual_worker_step(engine, meta, [(long, ids, 1, 6)], finished=frozenset({"r"}))
    assert out.invalid_block_ids == frozenset()
    assert all(os.path.exists(engine.worker.path_for(k)) for k in keys)

    fresh = MiniEngine(storage_config(tmp_path), fill_seed=4, first_block=16)
    loaded = fresh.prefill(Request("c", long))
    assert loaded["num_external"] == 6 * BLOCK_SIZE
    reference = _contextual_reference(long, 6)
    for layer_index, name in enumerate(LAYERS):
        for i in range(6):
            assert torch.equal(fresh.kv_caches[name][loaded["block_ids"][i]],
                               reference[i][layer_index]), (name, i)


def test_blocks_stored_for_other_extra_keys_are_not_loaded(tmp_path, rng):
    """``Request.extra_keys`` (a LoRA adapter, an image, a cache salt) decide
    the KV as much as the token ids: blocks a producer stored for the same
    tokens with other keys are not offered; with the same keys they are. The
    keys were ignored before: the consumer loaded all five blocks of
    another adapter's or image's KV."""
    tokens = _prompt(rng, 5 * BLOCK_SIZE + 2)
    stored = (("lora", "sql"), ("mm", "img-1", 3))
    MiniEngine(storage_config(tmp_path, "kv_producer"), fill_seed=1).prefill(
        Request("p1", tokens, None, stored))
    consumer = MiniEngine(storage_config(tmp_path, "kv_consumer"), fill_seed=2, first_block=7)
    for rid, keys in (("other-adapter", (("lora", "chat"), ("mm", "img-1", 3))),
                      ("other-image", (("lora", "sql"), ("mm", "img-2", 3))), ("no-keys", ())):
        assert consumer.scheduler.get_num_new_matched_tokens(Request(rid, tokens, None, keys), 0) == (0, False), rid
    loaded = consumer.prefill(Request("same", tokens, None, stored))
    assert loaded["num_external"] == 5 * BLOCK_SIZE
    _assert_holds_expected(consumer, tokens, loaded["block_ids"], range(5))
