"""Fixtures for the security tests: the RDMA test helpers (fakes,
rdma_testutil) on sys.path, a seeded RNG that prints its seed, and a
summary of the fuzz cases run (for docs/reliability.md)."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "rdma"))
sys.path.insert(0, os.path.dirname(__file__))

from fuzz_counts import COUNTS, SEEDS  # noqa: E402


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int(os.environ.get("RDMA_KV_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"{request.node.nodeid}: seed {seed} (rerun with RDMA_KV_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def pytest_terminal_summary(terminalreporter):
    if COUNTS:
        total = sum(v for k, v in COUNTS.items() if not k.endswith("_escapes"))  # sub-counts
        terminalreporter.write_line(f"fuzz cases run: {total} ({dict(sorted(COUNTS.items()))})")
        terminalreporter.write_line(f"fuzz seeds: {SEEDS}; default campaigns are derandomized")
