"""A one-sided read over a Soft-RoCE device (``rdma_rxe``) with the agent's
UCX context restricted to it (``NET_DEVICES``), where the kernel offers one
and the loaded UCX has verbs. Skips cleanly elsewhere (no RDMA support in
the kernel, or the libucx wheel, which is built without verbs)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

IB_CLASS = pathlib.Path("/sys/class/infiniband")


def rxe_device() -> str | None:
    """The first Soft-RoCE device (its driver is rdma_rxe), or None."""
    if not IB_CLASS.is_dir():
        return None
    for dev in sorted(IB_CLASS.iterdir()):
        driver = (dev / "device" / "driver").resolve().name if (dev / "device").exists() else ""
        if dev.name.startswith("rxe") or driver == "rdma_rxe":
            return dev.name
    return None


def test_read_over_soft_roce(make_agent):
    device = rxe_device()
    if device is None:
        pytest.skip(f"no Soft-RoCE device ({IB_CLASS} absent or without rxe*: the kernel has no rdma_rxe)")
    options = {"NET_DEVICES": f"{device}:1", "TLS": "rc,self"}
    try:
        a = make_agent("a", ucx_options=options)
        b = make_agent("b", ucx_options=options)
    except Exception as exc:  # the loaded UCX has no verbs transport
        pytest.skip(f"UCX cannot use {device} over rc: {exc}")
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    from rdma_kv.transport import DescList

    a.register(dst)
    b.register(src)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    offsets = np.arange(0, src.nbytes, 64 << 10)
    a.read("b", DescList.from_regions(dst.ctypes.data, offsets, 64 << 10),
           DescList.from_regions(src.ctypes.data, offsets, 64 << 10), timeout_s=30.0).wait(timeout_s=30.0)
    assert np.array_equal(src, dst)
