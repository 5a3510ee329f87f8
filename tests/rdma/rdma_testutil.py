"""Helpers for the RDMA connector tests."""

from __future__ import annotations

import time


def wait_until(predicate, timeout_s=10.0, step=None, what="condition"):
    """Call ``step()`` until ``predicate()``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.001)
