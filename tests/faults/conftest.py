"""Setup for the fault and soak tests: the RDMA test helpers on sys.path
(``rng`` comes from tests/conftest.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "rdma"))
sys.path.insert(0, os.path.dirname(__file__))

