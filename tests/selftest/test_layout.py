"""The layout checks the handshake relies on (``selftest/layout.py``) run on
real tensors; the selftest runs them on CUDA, here they run on the CPU (the
same strides, the same code)."""

from __future__ import annotations

import pytest
import torch

from rdma_kv.connector.geometry import Layout
from rdma_kv.selftest import Status
from rdma_kv.selftest.layout import CASES, Case, layout_check

pytestmark = pytest.mark.timeout(60)


def test_every_gpu_layout_is_read_from_its_strides_and_nhd_is_told_from_hnd():
    check = layout_check(torch, "cpu")
    assert check.status is Status.PASS, check.detail
    assert check.figures["layouts"] == [c.name for c in CASES]
    assert "the handshake refuses NHD vs HND" in check.detail


def test_a_layout_read_wrongly_is_a_reported_fail():
    wrong = Case("FlashAttention NHD read as HND", (2, 8, 16, 4, 32), None, Layout.KV_FIRST, "HND")
    check = layout_check(torch, "cpu", cases=[*CASES, wrong])
    assert check.status is Status.FAIL
    assert "FlashAttention NHD read as HND: strides" in check.detail and "expected kv_first HND" in check.detail


def test_a_device_that_cannot_be_used_is_a_reported_fail():
    check = layout_check(torch, "cuda:99")  # no such device anywhere: raises inside, reported
    assert check.status is Status.FAIL and check.detail.startswith("on cuda:99: ")
