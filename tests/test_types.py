"""The type checker over the layers that are clean: the transport, the
engine-neutral connector (with the RDMA connector), the vLLM adapter, the
harness, the CLI and the bottom modules. A type error there fails the
suite; the benchmarks are not yet checked (``mypy`` with no arguments lists
what is left)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["src/rdma_kv/transport", "src/rdma_kv/connector", "src/rdma_kv/vllm", "src/rdma_kv/harness",
           "src/rdma_kv/cli", "src/rdma_kv/errors.py", "src/rdma_kv/runs.py"]


@pytest.mark.timeout(300)
def test_checked_layers_are_type_clean(tmp_path):
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), *CHECKED],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, f"mypy {' '.join(CHECKED)}:\n{result.stdout}{result.stderr}"
