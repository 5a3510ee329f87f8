"""The one Python run-merging rule (``rdma_kv.runs``) against a per-span
loop, and the three callers against it."""

from __future__ import annotations

import numpy as np

from rdma_kv.connector.rdma.slots import count_runs
from rdma_kv.runs import run_starts
from rdma_kv.transport.descriptors import coalesce


def _loop_starts(lengths, sides):
    out = []
    for i in range(len(lengths)):
        if i == 0 or any(starts[i] != starts[i - 1] + lengths[i - 1]
                         or (regions is not None and regions[i] != regions[i - 1])
                         for starts, regions in sides):
            out.append(i)
    return out


def _spans(rng, n):
    """Spans that are often contiguous: random lengths, random small gaps."""
    lengths = rng.integers(1, 4, n).astype(np.int64) * 64
    gaps = rng.choice([0, 0, 0, 64], n).astype(np.int64)
    starts = np.cumsum(np.concatenate(([0], lengths[:-1] + gaps[:-1])))
    return starts, lengths


def test_run_starts_match_a_per_span_loop(rng):
    for n in (0, 1, 2, 7, 100):
        lstarts, lengths = _spans(rng, n)
        rstarts = lstarts + rng.choice([0, 0, 0, 64], n).cumsum()
        regions = rng.choice([0, 0, 0, 1], n).cumsum()
        for sides in ([(lstarts, None)], [(lstarts, None), (rstarts, regions)]):
            assert run_starts(lengths, sides).tolist() == _loop_starts(lengths, sides)


def test_coalesce_and_count_runs_follow_the_rule(rng):
    lstarts, lengths = _spans(rng, 200)
    rstarts = lstarts[::-1].copy()  # no two consecutive spans contiguous remotely...
    rstarts[50:100] = np.cumsum(np.concatenate(([10**6], lengths[50:99])))  # ...but these
    starts = run_starts(lengths, [(lstarts, None), (rstarts, None)])
    la, ra, ln, _, _ = coalesce(lstarts.astype(np.uint64), rstarts.astype(np.uint64),
                                lengths.astype(np.uint64), None, None)
    assert la.tolist() == lstarts[starts].tolist() and int(ln.sum()) == int(lengths.sum())
    local_ids = np.array([0, 1, 2, 5, 6, 9], dtype=np.int64)
    remote_ids = np.array([3, 4, 0, 1, 2, 3], dtype=np.int64)  # runs: 0-1, 2, 5-6, 9
    ones = np.ones(local_ids.size, dtype=np.int64)
    assert count_runs(local_ids, remote_ids, rows=3) == 3 * 4 == 3 * len(
        run_starts(ones, [(local_ids, None), (remote_ids, None)]))
    assert count_runs(local_ids[:0], remote_ids[:0], rows=3) == 0
