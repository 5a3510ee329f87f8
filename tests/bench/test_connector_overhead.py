"""bench/connector_overhead.py at a small size: both geometries, two reps
each, with its JSON. Every stage present and consistent, the raw read and
the connector's posting the same operations. No assertion on time (that is
the benchmark's to report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "connector_overhead.py"

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(300)]


def test_both_geometries_report_every_stage(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--reps", "2", "--geometry", "tiny,8b", "--tokens", "40",
                           "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert [r["geometry"] for r in data["results"]] == ["tiny", "8b"]
    assert set(data["load_average"]) == {"before", "after"}
    for result in data["results"]:
        assert result["blocks"] == -(-40 // result["shape"]["block_size"])
        assert len(result["rows"]) == 2
        for row in result["rows"]:
            assert row["ops"] == row["raw_ops"] > 0, row  # the same blocks, the same operations
            assert min(row[k] for k in ("start_s", "transfer_s", "finish_s", "confirm_s", "raw_s")) >= 0, row
            assert row["start_s"] + row["transfer_s"] + row["finish_s"] <= row["total_s"] + 1e-6, row
    assert "connector (bind -> reported)" in proc.stdout
