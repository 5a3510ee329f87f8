"""The head and rank mapping of heterogeneous tensor parallel (``topology``),
over a table of (producer TP, consumer TP, KV heads, MLA) cases."""

from __future__ import annotations

import itertools

import pytest

from rdma_kv.connector.rdma.topology import Read, heads_of, plan_ranks
from rdma_kv.errors import ConfigError


@pytest.mark.parametrize(("tp", "heads", "expected"), [
    (1, 4, [range(0, 4)]),
    (2, 4, [range(0, 2), range(2, 4)]),
    (4, 2, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
    (8, 1, [range(0, 1)] * 8),
])
def test_heads_are_sharded_as_vllm_does(tp, heads, expected):
    assert [heads_of(r, tp, heads) for r in range(tp)] == expected


@pytest.mark.parametrize(("d", "dtp", "ptp", "heads", "reads", "readers"), [
    # equal sizes: whole blocks from the same rank
    (1, 2, 2, 4, [Read(1, 0, 0, 2)], {1: 1}),
    # P2 -> D1: both halves, one from each producer rank
    (0, 1, 2, 4, [Read(0, 0, 0, 2), Read(1, 2, 0, 2)], {0: 1, 1: 1}),
    # P1 -> D2: each consumer rank reads its half of producer rank 0, which counts two readers
    (0, 2, 1, 4, [Read(0, 0, 0, 2)], {0: 2}),
    (1, 2, 1, 4, [Read(0, 0, 2, 2)], {0: 2}),
    # P4 -> D2
    (1, 2, 4, 8, [Read(2, 0, 0, 2), Read(3, 2, 0, 2)], {2: 1, 3: 1}),
    # P2 -> D8 with 8 heads: a head each, four consumer ranks per producer rank
    (5, 8, 2, 8, [Read(1, 0, 1, 1)], {1: 4}),
    # consumer replicas (D4 of 2 heads): each replica reads its head once
    (3, 4, 1, 2, [Read(0, 0, 1, 1)], {0: 4}),
    # producer replicas (P4 of 2 heads) -> D1: one read per head, the other
    # replicas only released (by consumer rank p mod 1 = 0)
    (0, 1, 4, 2, [Read(0, 0, 0, 1), Read(2, 1, 0, 1)], {0: 1, 1: 1, 2: 1, 3: 1}),
    # producer replicas -> D2: replicas spread over the consumer ranks
    (0, 2, 4, 2, [Read(0, 0, 0, 1)], {0: 1, 2: 1}),
    (1, 2, 4, 2, [Read(3, 0, 0, 1)], {1: 1, 3: 1}),
])
def test_plans(d, dtp, ptp, heads, reads, readers):
    plan = plan_ranks(d, dtp, ptp, heads)
    assert list(plan.reads) == reads
    assert plan.readers == readers


def test_mla_is_one_whole_read_spread_over_producer_ranks():
    plan = plan_ranks(3, 4, 2, 1, mla=True)
    assert plan.reads == (Read(1, 0, 0, 1),) and plan.whole(plan.reads[0])
    assert plan.readers == {1: 2}


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("dtp", [1, 2, 4, 8])
@pytest.mark.parametrize("ptp", [1, 2, 4, 8])
def test_every_head_is_read_once_and_every_producer_rank_is_called(ptp, dtp, heads):
    plans = [plan_ranks(d, dtp, ptp, heads) for d in range(dtp)]
    callers = {p: set() for p in range(ptp)}
    for d, plan in enumerate(plans):
        got = []
        for read in plan.reads:
            theirs = heads_of(read.rank, ptp, heads)
            remote = list(theirs)[read.remote_first:read.remote_first + read.count]
            assert len(remote) == read.count
            got += remote
        # every head the rank owns, in order, each read once
        assert got == list(heads_of(d, dtp, heads))
        assert [r.local_first for r in plan.reads] == list(itertools.accumulate(
            [0] + [r.count for r in plan.reads[:-1]]))
        for p in plan.readers:
            callers[p].add(d)
    for p, who in callers.items():
        assert who, f"producer rank {p} is never released"
        for d in who:
            assert plans[d].readers[p] == len(who)


@pytest.mark.parametrize(("args", "match"), [
    ((0, 3, 2, 4), "consumer tp_size 3 and the model's 4 KV heads"),
    ((0, 2, 3, 4), "producer tp_size 3"),
    ((2, 2, 2, 4), "consumer rank 2 is outside tp_size 2"),
    ((0, 1, 1, 0), "0 KV heads"),
])
def test_refusals_say_what_is_wrong(args, match):
    with pytest.raises(ConfigError, match=match):
        plan_ranks(*args)
