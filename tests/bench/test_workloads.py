"""Batch and coalescing math (no processes, no UCX)."""

import numpy as np
import pytest

from rdma_kv.bench.workloads import PRESETS, Workload, coalesce, op_count, batch, preset
from rdma_kv.errors import ConfigError

SMALL = Workload("t", "kv", num_layers=3, regions_per_layer=2, blocks_per_request=5,
                 block_nbytes=64, pool_blocks=11, seed=7)


def test_offsets_follow_layer_outermost_layout():
    p = batch(SMALL, 0)
    assert p.descriptor_count == 3 * 2 * 5
    assert p.buffer_nbytes == 3 * 2 * 11 * 64
    lo = p.local_offsets.reshape(3, 2, 5)
    for layer in range(3):
        for region in range(2):
            blocks = lo[layer, region] // 64 - (layer * 2 + region) * 11
            assert ((blocks >= 0) & (blocks < 11)).all()
    assert (p.local_offsets == p.local_slots.astype(np.uint64) * 64).all()
    assert (p.remote_offsets == p.remote_slots.astype(np.uint64) * 64).all()
    assert (p.lengths == 64).all() and p.nbytes == 30 * 64


def test_random_ids_are_distinct_seeded_and_vary_per_rep():
    a, b = batch(SMALL, 0), batch(SMALL, 0)
    assert (a.local_slots == b.local_slots).all() and (a.remote_slots == b.remote_slots).all()
    first = a.local_slots[:5]
    assert len(set(first.tolist())) == 5
    assert not np.array_equal(a.local_slots, a.remote_slots)
    assert not np.array_equal(batch(SMALL, 1).local_slots, a.local_slots)
    assert not np.array_equal(batch(SMALL.replace(seed=8), 0).local_slots, a.local_slots)


def test_contiguous_order_coalesces_to_one_op_per_region():
    w = SMALL.replace(block_order="contiguous")
    p = batch(w, 3)
    assert (p.local_slots == p.remote_slots).all()
    lo, ro, ln = coalesce(p.local_offsets, p.remote_offsets, p.lengths)
    assert lo.shape[0] == 6 and (ln == 5 * 64).all()
    assert int(ln.sum()) == p.nbytes


def test_coalesce_needs_both_sides_contiguous():
    lo = np.array([0, 8, 16, 100], dtype=np.uint64)
    ro = np.array([0, 8, 40, 48], dtype=np.uint64)
    ln = np.array([8, 8, 8, 8], dtype=np.uint64)
    mlo, mro, mln = coalesce(lo, ro, ln)
    assert mlo.tolist() == [0, 16, 100] and mro.tolist() == [0, 40, 48] and mln.tolist() == [16, 8, 8]
    empty = coalesce(lo[:0], ro[:0], ln[:0])
    assert all(a.size == 0 for a in empty)
    with pytest.raises(ConfigError):
        coalesce(lo, ro[:2], ln)


def test_presets_match_the_issue_table():
    r, c, one, big = (PRESETS[n] for n in ("kv-random", "kv-contiguous", "kv-one-block", "contiguous-256m"))
    assert r.descriptor_count == 16384 and r.transfer_nbytes == 512 << 20
    assert op_count(batch(c, 0)) == 64
    assert one.descriptor_count == 64 and one.transfer_nbytes == 64 * 32 * 1024
    assert big.descriptor_count == 1 and big.transfer_nbytes == 256 << 20
    assert all(w.buffer_nbytes <= int(1.2 * (1 << 30)) for w in PRESETS.values())
    assert op_count(batch(r, 0)) > 16000  # random ids rarely line up on both sides


def test_invalid_workloads_are_rejected():
    with pytest.raises(ConfigError, match="blocks_per_request"):
        SMALL.replace(blocks_per_request=12)
    with pytest.raises(ConfigError, match="kind"):
        Workload("x", "weird")
    with pytest.raises(ConfigError, match="unknown workload"):
        preset("nope")
    with pytest.raises(ConfigError, match="unknown workload keys"):
        Workload.from_dict({"name": "x", "kind": "kv", "bogus": 1})
