"""Setup for the RDMA connector tests: this directory on sys.path (fakes,
rdma_testutil); ``rng`` comes from tests/conftest.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

