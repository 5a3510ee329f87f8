"""bench/step_cost.py at a small size: both geometries, two batch sizes, two
reps, with its JSON. Every hook it times was called, the admitting step
posted every load, and the figures are consistent. No assertion on time
(that is the benchmark's to report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "step_cost.py"

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(300)]


def test_both_geometries_time_every_hook(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--batch", "1,3", "--geometry", "tiny,8b", "--reps", "2",
                           "--tokens", "40", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert [r["geometry"] for r in data["results"]] == ["tiny", "8b"]
    for result in data["results"]:
        assert list(result["batches"]) == ["1", "3"]
        for batch in result["batches"].values():
            assert len(batch["rows"]) == 2
            for row in batch["rows"]:
                # the admitting step ran each scheduler hook of an admission and planned the loads
                for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                             "start_load_kv"):
                    assert row[f"{hook}_us"] > 0, (hook, row)
                assert row["admit_us"] == pytest.approx(row["admit_scheduler_us"] + row["admit_worker_us"])
                assert row["after_get_finished_us"] > 0 and row["after_us"] >= row["after_get_finished_us"]
                assert row["posting_step_us"] > 0 and row["wall_ms"] * 1e3 >= row["posting_step_us"]
    assert "admit us" in proc.stdout and proc.stdout.count("loads |") == 2
