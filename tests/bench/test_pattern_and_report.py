"""Data pattern, verification, report statistics and perftest parsing (in process)."""

import json

import numpy as np
import pytest

from rdma_kv.bench import runner
from rdma_kv.bench.perftest import parse_final
from rdma_kv.bench.report import Result, table, to_json
from rdma_kv.bench.workloads import Workload, batch

W = Workload("t", "kv", num_layers=2, blocks_per_request=4, block_nbytes=256, pool_blocks=9, seed=3)


def _read(target: np.ndarray, p) -> np.ndarray:
    local = np.zeros_like(target)
    for lo, ro, n in zip(p.local_offsets.tolist(), p.remote_offsets.tolist(), p.lengths.tolist()):
        local[lo : lo + n] = target[ro : ro + n]
    return local


@pytest.mark.parametrize("rep", [0, 1, 4])
def test_verify_accepts_a_correct_read_and_rejects_a_wrong_one(rep):
    target = np.zeros(W.buffer_nbytes, dtype=np.uint8)
    filler = runner.PatternFiller(target, W.seed)
    for r in range(rep + 1):  # incremental refill must equal a fresh fill
        filler.fill(r)
    fresh = np.zeros_like(target)
    runner.PatternFiller(fresh, W.seed).fill(rep)
    assert np.array_equal(target, fresh)
    p = batch(W, rep)
    local = _read(target, p)
    runner.verify(local, p)
    local[int(p.local_offsets[5]) + 17] ^= 1
    with pytest.raises(runner.VerificationError, match="descriptor 5"):
        runner.verify(local, p)
    with pytest.raises(runner.VerificationError):  # stale rep's data
        runner.verify(_read(target, p), batch(W, rep + 1))


def test_verify_contiguous_workload():
    w = Workload("c", "contiguous", nbytes=1 << 16)
    target = np.zeros(w.buffer_nbytes, dtype=np.uint8)
    runner.PatternFiller(target, 0).fill(2)
    p = batch(w, 2)
    runner.verify(target.copy(), p)
    with pytest.raises(runner.VerificationError):
        runner.verify(np.zeros_like(target), p)


def test_result_statistics_and_table():
    r = Result("cma", "t", descriptors=4, seconds=[0.5, 1.0, 2.0], prep_seconds=[1e-6] * 3,
               ops=[4, 4, 4], nbytes=[10**9] * 3)
    n = Result("nixl", "t", descriptors=4, seconds=[1.0] * 3, prep_seconds=[4e-6] * 3,
               post_seconds=[1e-6] * 3, ops=[2] * 3, nbytes=[10**9] * 3)
    assert r.median_gbps == 1.0 and r.min_gbps == 0.5 and r.max_gbps == 2.0
    assert n.prep_us_per_desc == pytest.approx(1.0) and n.post_us_per_desc == pytest.approx(0.25)
    text = table([n, r, Result.skipped("rdma-kv", "t", "not built")])
    assert "skipped" in text and "not built" in text and "1.00" in text
    data = json.loads(to_json([r, n]))
    assert data["results"][0]["summary"]["median_gbps"] == 1.0


def test_parse_perftest_final_line():
    out = "junk\nFinal:                  2000      4.637    12.630    12.630     2474.36    2474.36       79180       79180\n"
    assert parse_final(out) == (4.637, 12.630, 2474.36, 79180.0)
    with pytest.raises(runner.BenchError):
        parse_final("no final here")
