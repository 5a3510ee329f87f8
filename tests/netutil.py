"""Ports for servers a test starts: ``rdma_kv.bench.ports`` (below the
kernel's ephemeral range; its docstring says why)."""

from rdma_kv.bench.ports import ephemeral_range, free_base_port, free_port

__all__ = ["ephemeral_range", "free_base_port", "free_port"]
