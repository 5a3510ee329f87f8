"""Registration knows its memory: the agent maps without a memory-type hint,
asks UCX what it detected (``ucp_mem_query``) and refuses memory mapped as
another type than the caller declared. No GPU: fake CUDA tensors over host
memory, and a ``ucp_mem_query`` that answers what the test says."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import FakeCudaTensor, QueryAnswers

from rdma_kv.errors import RegistrationError

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]


def test_host_memory_declared_cuda_is_refused_naming_both_types(make_agent):
    agent = make_agent("a", progress="poll")
    buf = np.zeros(1 << 16, dtype=np.uint8)
    with pytest.raises(RegistrationError, match=r"declared cuda memory but UCX maps it as host") as err:
        agent.register((buf.ctypes.data, buf.nbytes), memory_type="cuda")
    assert "this context supports: host" in str(err.value)
    assert agent.regions == ()


def test_fake_cuda_tensor_is_refused_when_ucx_maps_it_as_host(make_agent):
    agent = make_agent("a", progress="poll")
    kv = FakeCudaTensor(torch.zeros(4, 1024))
    with pytest.raises(RegistrationError, match="declared cuda memory"):
        agent.register(kv)
    assert agent.regions == ()


def test_mem_query_answering_host_for_cuda_memory_is_refused_and_unmapped(make_agent):
    agent = make_agent("a", progress="poll")
    agent._core.memory._lib = spy = QueryAnswers(agent._core.memory._lib, "HOST")
    kv = FakeCudaTensor(torch.zeros(4, 1024))
    with pytest.raises(RegistrationError, match="declared cuda memory but UCX maps it as host"):
        agent.register(kv)
    assert spy.unmapped == 1 and agent.regions == ()


def test_mem_query_is_what_decides(make_agent):
    """The same fake CUDA tensor is accepted when UCX says CUDA (or managed),
    and a host array is refused when UCX says CUDA: the check reads the query."""
    agent = make_agent("a", progress="poll")
    real = agent._core.memory._lib
    for answer in ("CUDA", "CUDA_MANAGED"):
        agent._core.memory._lib = QueryAnswers(real, answer)
        region = agent.register(FakeCudaTensor(torch.zeros(1024)))
        assert region.kind.value == answer.lower().replace("_", "-")
        agent._core.memory._lib = real
        agent.deregister(region)
    agent._core.memory._lib = QueryAnswers(real, "CUDA")
    with pytest.raises(RegistrationError, match="declared host memory but UCX maps it as cuda"):
        agent.register(np.zeros(4096, dtype=np.uint8))
    agent._core.memory._lib = real


def test_declared_type_must_be_valid_and_agree_with_the_object(make_agent):
    agent = make_agent("a", progress="poll")
    arr = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(RegistrationError, match="valid values: host, cuda"):
        agent.register((arr.ctypes.data, arr.nbytes), memory_type="vram")
    with pytest.raises(RegistrationError, match="contradicts the host ndarray"):
        agent.register(arr, memory_type="cuda")
    region = agent.register((arr.ctypes.data, arr.nbytes), memory_type="host")
    assert region.kind.value == "host"
    with pytest.raises(RegistrationError, match="declared cuda memory but lies in"):
        agent.register((arr.ctypes.data, 64), memory_type="cuda")
