"""Setup for the security tests: the RDMA test helpers (fakes,
rdma_testutil) on sys.path and a summary of the fuzz cases run (for
docs/reliability.md); ``rng`` comes from tests/conftest.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "rdma"))
sys.path.insert(0, os.path.dirname(__file__))

from fuzz_counts import COUNTS, SEEDS  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if COUNTS:
        total = sum(v for k, v in COUNTS.items() if not k.endswith("_escapes"))  # sub-counts
        terminalreporter.write_line(f"fuzz cases run: {total} ({dict(sorted(COUNTS.items()))})")
        terminalreporter.write_line(f"fuzz seeds: {SEEDS}; default campaigns are derandomized")
