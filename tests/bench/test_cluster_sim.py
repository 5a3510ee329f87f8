"""bench/cluster_sim.py at a small size, as CI can afford: 300 simulated
consumer ranks (beyond the 256 connections one producer rank used to
admit), each from its own loopback address, against one real producer
engine that also serves a real consumer's verified loads. No refusal, no
failed call, every CONFIRM of a real lease HELD, every real load verified.
No assertion on latency (that is the benchmark's to report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cluster_sim.py"

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_300_simulated_ranks_are_all_served_while_real_loads_verify(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--ranks", "300", "--duration", "6", "--confirm-rate", "100",
         "--renew-s", "2", "--procs", "2", "--threads", "8", "--idle-loads", "3", "--load-gap", "0.5",
         "--out", str(out)],
        capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (row,) = json.loads(out.read_text())["runs"]
    assert row["connected"] == 300 and row["errors"] == {}, row
    side = row["sidechannel"]
    assert side["open"] == 301 and side["authenticated"] == 301, side  # 300 ranks + the real consumer
    assert not any(k.startswith(("refused", "evicted", "closed")) for k in side), side
    assert row["answers"].get("confirm:HELD") == row["confirms"] > 0, row
    assert row["renews"] > 0
    real = row["real_loads"]
    assert real["failed"] == 0 and real["verified"] >= 3, real
