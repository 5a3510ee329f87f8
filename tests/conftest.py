"""Fixtures shared by every test directory: a seeded RNG that prints its
seed (``RDMA_KV_TEST_SEED=<n>`` replays a run)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = int(os.environ.get("RDMA_KV_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"{request.node.nodeid}: seed {seed} (rerun with RDMA_KV_TEST_SEED={seed})")
    return np.random.default_rng(seed)
