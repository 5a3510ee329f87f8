"""``rdma-kv info``'s CUDA memory line: what a UCP context made with this
environment supports (``ucp_context_attr_t.memory_types``). Here UCX has no
GPU driver, so the real answer is host only; the CUDA answers come from a
context whose memory-type mask the test sets."""

from __future__ import annotations

import pytest

from rdma_kv.cli.info import Report, cuda_memory_support, render

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

HOST, CUDA = 1 << 0, 1 << 1  # bits of ucs_memory_type_t


def with_mask(monkeypatch, mask):
    from rdma_kv.transport import ucx

    monkeypatch.setattr(ucx.Context, "memory_types", lambda self: mask)


def test_this_host_reports_host_only_and_no_error_without_a_gpu():
    report = Report(cuda="no CUDA device")
    cuda_memory_support(report)
    assert report.context_memory_types == ["host"]
    assert report.cuda_memory.startswith("not supported: this UCX has no usable CUDA transport")
    assert not [f for f in report.findings if f.level == "error"]
    assert "CUDA memory   not supported" in render(report)


def test_cuda_in_the_context_mask_is_reported_supported(monkeypatch):
    with_mask(monkeypatch, HOST | CUDA)
    report = Report(cuda="available")
    cuda_memory_support(report)
    assert report.context_memory_types == ["host", "cuda"]
    assert report.cuda_memory == "supported (context memory types: host, cuda)"
    assert not report.findings


def test_cuda_transports_left_out_of_ucx_tls_are_an_error_on_a_gpu_host(monkeypatch):
    with_mask(monkeypatch, HOST)
    monkeypatch.setenv("UCX_TLS", "rc,sm,self")
    report = Report(cuda="available", transports=[{"md": "cuda_cpy", "transport": "cuda_copy", "device": "cuda",
                                                   "type": "accelerator"}])
    cuda_memory_support(report)
    assert report.cuda_memory == ("not supported: UCX has CUDA transports but UCX_TLS leaves them out; "
                                  "add cuda_copy (UCX_TLS=rc,sm,self)")
    (finding,) = report.findings
    assert finding.level == "error" and "would be refused at register_kv_caches" in finding.message


NO_SUCH_TL = "rdmakvnosuchtl"
"""A transport name no UCX has: UCX answers it as it answers one this UCX lacks."""


def test_an_environment_no_ucp_context_can_be_made_in_is_an_error(monkeypatch):
    """Found by a review of the CLI: with ``UCX_TLS`` naming only a
    transport this UCX lacks (``rc`` on the wheel's UCX), no UCP context
    can be made, so no agent either: an engine started so fails at once.
    (The test names a transport no UCX has, so that it holds on a host
    with verbs too.) ``rdma-kv info`` said so as a *warning* ("cannot create a UCP context
    to query memory types"), exit status 2, "warnings only". Now an error
    (exit 1) naming ``UCX_TLS``."""
    from rdma_kv.cli.info import exit_code

    monkeypatch.setenv("UCX_TLS", NO_SUCH_TL)
    report = Report(cuda="no CUDA device")
    cuda_memory_support(report)
    (finding,) = report.findings
    assert finding.level == "error" and f"UCX_TLS={NO_SUCH_TL}" in finding.message, finding
    assert exit_code(report) == 1
