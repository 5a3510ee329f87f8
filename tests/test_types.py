"""The type checker over the whole package (transport, connector, vLLM
adapter, harness, CLI, benchmarks) and the maintained benchmarks in
``bench/`` (not ``bench/experiments/``), with pyproject.toml's settings: a
type error anywhere in them fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["src/rdma_kv", "bench"]


@pytest.mark.timeout(300)
def test_checked_layers_are_type_clean(tmp_path):
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), *CHECKED],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, f"mypy {' '.join(CHECKED)}:\n{result.stdout}{result.stderr}"
