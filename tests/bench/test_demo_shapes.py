"""bench/demo_shapes.py at a small size: one round of a short demo and its
replays. The demo's table parses into loads whose bytes are the shape's
(the bench refuses a mismatch), each side reports its figures and the
replays check every byte they moved. No assertion on time (that is the
benchmark's to report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "demo_shapes.py"

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(300)]


def test_one_round_of_a_short_demo_and_its_replays(tmp_path):
    out = tmp_path / "shapes.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--rounds", "1", "--requests", "10", "--max-tokens", "200",
                           "--concurrency", "4", "--num-blocks", "256", "--json", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["loads"] >= 1 and row["mib"] > 0
    for side in ("demo", "replay_c1", "replay_c4"):
        if side != "demo":
            assert row[side]["wall_gbps"] > 0, (side, row[side])
        st = row[side]
        assert 0 < st["p10_gbps"] <= st["median_gbps"], (side, st)
        assert st["aggregate_gbps"] > 0, (side, st)
    assert "demo / replay c4" in proc.stdout


def test_a_replay_of_another_shape_is_refused():
    proc = subprocess.run([sys.executable, str(BENCH), "--rounds", "1", "--requests", "4", "--max-tokens", "100",
                           "--num-blocks", "256", "--block-bytes", "32768"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode != 0
    assert "pass its shape" in proc.stderr, proc.stderr[-2000:]
