"""Which transport UCX chose, read from its ``PROTO_INFO`` tables, and the
GPU -> GPU read's verdict on it: software emulation is a FAIL where a
zero-copy path is the point.

The tables below are copied from UCX 1.22's output on an H200 (no NVLink,
libucx-cu12 wheel, 2026-11-26): device memory is named ``cuda/GPU0`` and
``cuda/dev[0]``, not ``<type> memory``; an earlier parser missed those
tables, so the selftest's GPU -> GPU line said nothing of the TCP emulation
that carried it at 0.3 GB/s."""

from __future__ import annotations

import pytest

from rdma_kv.selftest.pair import ReadSpec, kv_workload, run_reads
from rdma_kv.selftest.protocols import read_protocols
from rdma_kv.selftest.report import Status
from rdma_kv.selftest.supervise import Collect, Deadline

P = "[1795669218.801477] [vm:7391 :0]   "

H200_TABLES = "\n".join(P + line for line in [
    "+---------------------------------+---------------------------------------------------------------------+",
    "| selftest-reader intra-node cfg#1 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |",
    "+--------+--------------------+-----------------------------------------+",
    "| Range  |    Description     |                 Config                  |",
    "+--------+--------------------+-----------------------------------------+",
    "| 0..inf | software emulation | tcp/lo                                  |",
    "+--------+--------------------+-----------------------------------------+",
    "| selftest-reader intra-node cfg#1                                        |",
    "| remote memory read by ucp_get*(multi) into host memory from cuda/dev[0] |",
    "| Range  |    Description     |                  Config                   |",
    "| 0..inf | software emulation | tcp/lo                                    |",
    "| selftest-reader intra-node cfg#1                         |",
    "| remote memory read by ucp_get*(multi) into host memory from host |",
    "| Range  | Description |              Config               |",
    "| 0..inf | zero-copy   | cma/memory                        |",
    "| selftest-reader intra-node cfg#1                                |",
    "| remote memory write by ucp_put* from host memory to cuda/dev[0] |",
    "| Range  |    Description     |              Config               |",
    "| 0..inf | software emulation | tcp/lo                            |",
])

WITH_GET_ZCOPY = "\n".join(P + line for line in [
    "| remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |",
    "| Range  | Description |      Config       |",
    "| 0..inf | zero-copy   | cuda_ipc/cuda     |",
])


def test_device_memory_tables_are_read_and_writes_are_not_reads():
    assert read_protocols(H200_TABLES) == {
        ("cuda", "cuda"): ["software emulation tcp/lo"],
        ("host", "cuda"): ["software emulation tcp/lo"],
        ("host", "host"): ["zero-copy cma/memory"],
    }
    assert read_protocols(WITH_GET_ZCOPY) == {("cuda", "cuda"): ["zero-copy cuda_ipc/cuda"]}


class CannedLog:
    """A ``UcxLog`` that returns the given tables once (UCX's own stdout is
    C-buffered inside pytest; the selftest's check process has it in a file)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def take(self) -> str:
        text, self.text = self.text, ""
        return text


def host_table(description: str, config: str) -> str:
    return "\n".join(P + line for line in [
        "| remote memory read by ucp_get*(multi) into host memory from host |",
        "| Range  | Description |      Config       |",
        f"| 0..inf | {description} | {config} |",
    ])


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("description, config, zero_copy, status", [
    ("software emulation", "tcp/lo", True, Status.FAIL),
    ("software emulation", "tcp/lo", False, Status.PASS),
    ("zero-copy", "cma/memory", True, Status.PASS),
])
def test_a_read_that_must_be_zero_copy_fails_when_ucx_emulates_it(description, config, zero_copy, status):
    """A real two-process read (host memory standing in for the GPU); the
    protocol comes from the table UCX would print. Emulated, a read that
    must be zero-copy FAILs with the hint; another read PASSes."""
    sink = Collect()
    reads = run_reads([ReadSpec("read", "host", "host", zero_copy=zero_copy, hint="do this")], kv_workload(True),
                      sink, Deadline(240), ucx_options={}, lanes=1, log=CannedLog(host_table(description, config)))
    (check,) = reads.checks
    assert check.status is status, check.detail
    assert check.figures["ucx_protocol"] == f"{description} {config}"
    assert ("do this" in check.detail) == (status is Status.FAIL)
    assert "bit-exact" in check.detail
