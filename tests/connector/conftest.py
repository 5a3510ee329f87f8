"""Fixtures for the connector tests: a seeded RNG that prints its seed, and
a clean process-wide transfer state around every test."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from rdma_kv.connector import has_kv_transfer_group, reset_kv_transfer_state


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int(os.environ.get("RDMA_KV_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"{request.node.nodeid}: seed {seed} (rerun with RDMA_KV_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def clean_transfer_state():
    reset_kv_transfer_state()
    yield
    leaked = has_kv_transfer_group()
    reset_kv_transfer_state()
    assert not leaked, "test left a KV transfer group initialized"
