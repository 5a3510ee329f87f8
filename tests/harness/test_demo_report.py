"""The demo's verdict (``rdma_kv.harness.demo._report``) from the decode
engine's results, without engines: what makes it print VERIFIED."""

from __future__ import annotations

import argparse

import pytest

from rdma_kv.harness.demo import _report
from rdma_kv.harness.engine import ModelShape

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64)


def row(rid: str, prompt: int, hit: int, loaded: int, **kw: object) -> dict[str, object]:
    return {"request_id": rid, "status": "finished", "num_prompt_tokens": prompt, "local_hit_tokens": hit,
            "external_tokens": loaded, "load_failed": False, "bad_blocks": [], "load_s": 0.01, **kw}


def report(rows: list[dict[str, object]]) -> int:
    loaded = [r for r in rows if r["external_tokens"]]
    stats = {"requests": [{"request_id": r["request_id"], "nbytes": 4096, "transfer_s": 0.001,
                           "num_blocks": 1, "ops_posted": 1} for r in loaded],
             "totals": {"nbytes": 4096 * len(loaded), "transfer_s": 0.001 * len(loaded),
                        "ops_posted": len(loaded), "block_runs": len(loaded)}}
    status_p = {"held": 0, "leases": 0, "free_blocks": SHAPE.num_blocks}
    status_d = {"free_blocks": SHAPE.num_blocks, "inflight_loads": 0}
    return _report(rows, stats, status_p, status_d, argparse.Namespace(verbose=True), SHAPE)


def test_loads_partial_and_full_hits_verify(capsys):
    assert report([row("a", 10, 0, 10), row("b", 10, 8, 2), row("c", 8, 8, 0)]) == 0
    assert "VERIFIED" in capsys.readouterr().out


@pytest.mark.parametrize("declined", [row("b", 10, 0, 0), row("b", 10, 4, 0)], ids=["no hit", "partial hit"])
def test_a_request_computed_locally_instead_of_loaded_fails(capsys, declined):
    # Before: a request whose connector offered nothing (the consumer declined
    # the params and computed locally) passed as a "full hit"; with every
    # request so, the demo moved 0 MiB and printed VERIFIED
    # (repro/demo_declined_load_verified.py).
    assert report([row("a", 10, 0, 10), declined]) == 1
    out = capsys.readouterr().out
    assert "1 computed by the decode engine instead of loaded" in out and "FAILED" in out
    assert "computed locally" in out
