"""bench/lone_request.py at a small size: both engines read every rep's
blocks (the bench checks each rep's bytes and fails on a wrong one), the
stages come out in the order they happen, and the ratio is NIXL's. No
assertion on time (that is the benchmark's to report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rdma_kv.bench import nixl_peer

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lone_request.py"

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(300)]


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "lone.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--reps", "30", "--blocks", "4", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    rk = data["rdma_kv"]
    assert 0 < rk["call"]["p50_us"] <= rk["return"]["p50_us"], rk
    assert rk["done"]["p50_us"] <= rk["settled"]["p50_us"] <= rk["return"]["p50_us"], rk
    return data


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_rdma_kv_alone_reports_its_stages_in_order(tmp_path, progress):
    data = _run(tmp_path, "--no-nixl", "--progress", progress)
    assert data["progress"] == progress and "nixl" not in data and "return_ratio" not in data


@pytest.mark.skipif(nixl_peer.nixl_available() is not None, reason="nixl is not importable")
def test_against_nixl_both_engines_take_turns(tmp_path):
    data = _run(tmp_path)
    nx = data["nixl"]
    assert 0 < nx["build"]["p50_us"] <= nx["transfer"]["p50_us"] <= nx["return"]["p50_us"], nx
    assert data["return_ratio"] == pytest.approx(data["rdma_kv"]["return"]["p50_us"] / nx["return"]["p50_us"])


def test_too_few_reps_are_refused():
    proc = subprocess.run([sys.executable, str(BENCH), "--reps", "20", "--no-nixl"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--reps must be more than 20" in proc.stderr
