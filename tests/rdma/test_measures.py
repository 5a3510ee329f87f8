"""A load's measures (``stats.LoadMeasures``): replaced, never changed in
place, and by the same rules as ``dataclasses.replace``, which they
replace on the load's path (``_evolve``)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from rdma_kv.connector.rdma.stats import MEASURES, LoadMeasures, LoadRecord


def test_with_add_and_at_least_match_dataclasses_replace():
    rng = random.Random(7)
    m = LoadMeasures()
    for _ in range(300):
        names = rng.sample(MEASURES, rng.randint(0, 4))
        values = {name: rng.choice([0, 1, 2.5, 1e-6, 10**9]) for name in names}
        before = m
        m = before.with_(**values)
        assert m == dataclasses.replace(before, **values) and m is not before
        assert type(m) is LoadMeasures
        summed = m.add(**values)
        assert summed == dataclasses.replace(m, **{k: (getattr(m, k) or 0) + v for k, v in values.items()})
        top = m.at_least(**{k: v / 2 for k, v in values.items()})
        assert top == m  # (each value at least half itself)
    assert before == dataclasses.replace(before)  # nothing was changed in place


def test_a_measure_that_does_not_exist_is_refused_by_name():
    with pytest.raises(TypeError, match="bogus"):
        LoadMeasures().with_(bogus=1.0)
    with pytest.raises(AttributeError, match="bogus"):  # (add reads the measure first)
        LoadMeasures().add(nbytes=1, bogus=1.0)


def test_a_record_keeps_its_own_fields_when_replaced():
    """``LoadRecord`` is a ``LoadMeasures``: replaced the slow, general way."""
    rec = LoadRecord.of("r", LoadMeasures(nbytes=3), ok=True, total_s=0.5, error=None)
    again = rec.with_(transfer_s=0.25)
    assert type(again) is LoadRecord
    assert (again.request_id, again.ok, again.total_s, again.nbytes, again.transfer_s) == ("r", True, 0.5, 3, 0.25)
