"""``cuda:N.register``: a CUDA KV cache through the connector's own
``register_kv_caches`` with the real agent; what ``ucp_mem_query`` says
decides, and a wrong memory type is a FAIL *reported*, never raised. No
GPU: fake CUDA tensors over host memory (tests/fake_cuda.py), and a
``ucp_mem_query`` that answers what the test says, as
tests/transport/test_memory_types.py does."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCudaTensor, QueryAnswers

from rdma_kv.connector.rdma.connector import agent_transport
from rdma_kv.selftest import Status
from rdma_kv.selftest.cuda import pump_check, register_check
from rdma_kv.selftest.pair import Reads
from rdma_kv.selftest.report import Check
from rdma_kv.selftest.run import default_settings

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]


def fake_kv(index: int = 0) -> FakeCudaTensor:
    """[layers, 2, blocks, block_size, heads, head] fp16, claiming cuda:index."""
    return FakeCudaTensor(torch.zeros(3, 2, 8, 16, 2, 8, dtype=torch.float16), index)


def answering(mem_type: str | None, made: list, kv: FakeCudaTensor | None = None):
    """The real agent; its ucp_mem_query answers ``mem_type`` (None: UCX's
    own answer) for every mapping, or (``kv``) for the KV cache's only."""
    within = None if kv is None else (kv.untyped_storage().data_ptr(), kv.untyped_storage().nbytes())

    def factory(name, settings):
        agent = agent_transport(name, settings)
        if mem_type is not None:
            agent._core.memory._lib = QueryAnswers(agent._core.memory._lib, mem_type, within)
        made.append(agent)
        return agent
    return factory


@pytest.mark.parametrize("mem_type", [None, "HOST"], ids=["ucx-detects-host", "mem-query-says-host"])
def test_cuda_memory_mapped_as_host_is_a_reported_fail(mem_type):
    made: list = []
    check = register_check("cuda:0.register", fake_kv(), default_settings(), answering(mem_type, made))
    assert check.status is Status.FAIL
    assert check.detail.startswith("the connector's register_kv_caches refused a 24 KiB KV cache on cuda:0 (3 layers")
    assert "declared cuda memory but UCX maps it as host memory" in check.detail
    assert "cuda_copy in UCX_TLS" in check.detail  # what to do
    assert made and all(agent.closed for agent in made)  # the worker shut its agent down


def test_cuda_memory_that_mem_query_calls_cuda_passes_with_its_figures():
    made: list = []
    kv = fake_kv(2)
    check = register_check("cuda:2.register", kv, default_settings(), answering("CUDA", made, kv))
    assert check.status is Status.PASS, check.detail
    assert "registered through the connector's register_kv_caches: 1 region(s), ucp_mem_query says cuda" in check.detail
    assert check.figures["memory_types"] == ["cuda"] and check.figures["regions"] == 1
    assert check.figures["nbytes"] == 3 * 2 * 8 * 16 * 2 * 8 * 2
    assert all(agent.closed for agent in made)


def test_the_ranks_nic_reaches_the_registering_agent():
    import dataclasses

    settings = dataclasses.replace(default_settings(), ucx_net_devices="lo")
    kv = fake_kv()
    check = register_check("cuda:0.register", kv, settings, answering("CUDA", [], kv))
    assert check.status is Status.PASS and check.figures["net_devices"] == "lo"


def test_pump_context_fails_without_a_context_and_passes_on_device_reads():
    read = Check.passed("cuda:0.gpu-gpu", "bit-exact", workers=2)
    assert pump_check("p", Reads((read,), None, 2)).status is Status.FAIL
    assert "nixl#2102" in pump_check("p", Reads((read,), None, 2)).detail
    failed = pump_check("p", Reads((read, Check.failed("cuda:0.host-gpu", "timeout")), 0xC0, 2))
    assert failed.status is Status.FAIL and "cuda:0.host-gpu" in failed.detail
    ok = pump_check("p", Reads((read,), 0xC0, 2))
    assert ok.status is Status.PASS and ok.figures == {"context": "0xc0", "workers": 2, "lanes": 2}


def test_the_cuda_group_skips_when_torch_sees_no_gpu_saying_why(tmp_path):
    """What the CUDA check process reports on a host with a GPU driver whose
    torch sees no device (here: the CPU build), run in-process."""
    from rdma_kv.selftest.cuda import cuda_group
    from rdma_kv.selftest.groups import profile_of
    from rdma_kv.selftest.supervise import Collect

    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    sink = Collect()
    cuda_group({"connector": profile_of(default_settings()), "ucx_log": str(tmp_path / "log"), "quick": True,
                "seed": 0, "deadline_s": 60.0, "cuda_ipc": False}, sink)
    (check,) = sink.checks
    assert check.name == "cuda" and check.status is Status.SKIP
    assert f"torch {torch.__version__} sees no CUDA device" in check.detail
