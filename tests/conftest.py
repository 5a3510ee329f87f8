"""Fixtures shared by every test directory: a seeded RNG that prints its
seed (``RDMA_KV_TEST_SEED=<n>`` replays a run).

torch runs one intra-op thread in the test process and, through
``OMP_NUM_THREADS``, in the children the tests start (unless set already).
The suite runs several processes on a machine's few cores, and torch's
default (a thread per core) makes every small tensor op wait at a barrier
for threads that have no core: the push campaign took 77 s with two
threads beside another job, 6 s with one (same seed)."""

from __future__ import annotations

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = int(os.environ.get("RDMA_KV_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"{request.node.nodeid}: seed {seed} (rerun with RDMA_KV_TEST_SEED={seed})")
    return np.random.default_rng(seed)
