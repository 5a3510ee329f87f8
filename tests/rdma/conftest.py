"""Setup for the RDMA connector tests: this directory on sys.path (fakes,
rdma_testutil); ``fabric``, a fresh fake transport fabric; ``rng`` comes
from tests/conftest.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fakes import FakeFabric  # noqa: E402


@pytest.fixture
def fabric():
    return FakeFabric()

