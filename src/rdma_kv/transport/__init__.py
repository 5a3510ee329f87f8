"""rdma_kv.transport: UCX made Pythonic -- registration, remote keys, peers,
descriptor lists and batched one-sided reads and writes.

It speaks addresses, lengths, peers and handles; it knows nothing of
blocks, layers or requests. ``Agent`` is the façade (one per process).
Importing this package does not load UCX; creating an ``Agent`` does.

May import: numpy, msgspec, cffi (through _lib), rdma_kv.errors.
"""

from rdma_kv.transport.agent import Agent, AgentConfig, AgentStats, Notification
from rdma_kv.transport.descriptors import ChainedRead, DescList, PreparedDescList, PreparedList, coalesce
from rdma_kv.transport.memory import MemoryKind, MemoryRegion
from rdma_kv.transport.transfer import Transfer, XferOp, XferState

__all__ = [
    "Agent",
    "AgentConfig",
    "AgentStats",
    "ChainedRead",
    "DescList",
    "MemoryKind",
    "MemoryRegion",
    "Notification",
    "PreparedDescList",
    "PreparedList",
    "Transfer",
    "XferOp",
    "XferState",
    "coalesce",
]
