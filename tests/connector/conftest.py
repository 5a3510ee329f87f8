"""Fixtures for the connector tests: a clean process-wide transfer state
around every test (``rng`` comes from tests/conftest.py)."""

from __future__ import annotations

import pytest

from rdma_kv.connector import has_kv_transfer_group, reset_kv_transfer_state


@pytest.fixture(autouse=True)
def clean_transfer_state():
    reset_kv_transfer_state()
    yield
    leaked = has_kv_transfer_group()
    reset_kv_transfer_state()
    assert not leaked, "test left a KV transfer group initialized"
