"""MemoryRegistry.deregister removes the region from its list *before*
ucp_mem_unmap; when the unmap fails (check_status raises) the rest is
skipped: the generation does not move, the table and memory-handle array
are not rebuilt. The agent then says the region is not registered
(agent.regions, its metadata, a retry of deregister), yet its table still
accepts local descriptors inside it (prep_local), and close() never unmaps
it. Correct behaviour asserted: after a failed deregister the registry is
consistent -- either the region is still registered (and a retry works), or
it is gone everywhere (descriptors into it refused).

The unmap failure is injected by wrapping the registry's cffi lib. Found by
an adversarial review; the region is now unmapped before it is removed, so
a failure leaves it registered and a retry unmaps it."""
from __future__ import annotations

import numpy as np
import pytest

from rdma_kv.errors import RdmaKVError
from rdma_kv.transport import Agent, AgentConfig
from rdma_kv.transport.descriptors import DescList


class FailingUnmap:
    def __init__(self, lib):
        self._lib = lib
        self.fail = True

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def ucp_mem_unmap(self, context, memh):
        if self.fail:
            return self._lib.UCS_ERR_IO_ERROR if hasattr(self._lib, "UCS_ERR_IO_ERROR") else -3
        return self._lib.ucp_mem_unmap(context, memh)


@pytest.mark.ucx
def test_a_failed_unmap_leaves_the_registry_consistent():
    agent = Agent("unmap", AgentConfig(ucx_options={"NET_DEVICES": "lo"}))
    try:
        a = np.zeros(1 << 16, dtype=np.uint8)
        b = np.zeros(1 << 16, dtype=np.uint8)
        ra = agent.register(a)
        agent.register(b)
        registry = agent._core.memory
        wrapper = FailingUnmap(registry._lib)
        registry._lib = wrapper
        with pytest.raises(RdmaKVError):
            agent.deregister(ra)
        wrapper.fail = False
        registered = ra in agent.regions
        try:
            agent.prep_local(DescList([a.ctypes.data], [4096]))
            accepted = True
        except RdmaKVError:
            accepted = False
        print(f"after the failed unmap: region listed={registered}, table accepts descriptors into it={accepted}, "
              f"table={registry.table.describe()}")
        assert registered == accepted, (
            f"inconsistent registry after a failed deregister: region listed in agent.regions={registered}, "
            f"but prep_local of a descriptor inside it accepted={accepted} ({registry.table.describe()})")
        assert registered and ra.base in [r.base for r in registry.infos()]  # still published
        agent.deregister(ra)  # a retry unmaps it
        assert ra not in agent.regions
        with pytest.raises(RdmaKVError):
            agent.prep_local(DescList([a.ctypes.data], [4096]))
    finally:
        agent.close()
