"""Fixtures for the fault and soak tests: the RDMA test helpers on sys.path
and a seeded RNG that prints its seed."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "rdma"))
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int(os.environ.get("RDMA_KV_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"{request.node.nodeid}: seed {seed} (rerun with RDMA_KV_TEST_SEED={seed})")
    return np.random.default_rng(seed)
