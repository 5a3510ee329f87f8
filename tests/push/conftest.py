"""Setup for the push-mode tests: the RDMA tests' helpers (fakes,
rdma_testutil) on sys.path; ``rng`` comes from tests/conftest.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "rdma"))
