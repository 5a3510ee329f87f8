"""Benchmark machinery for rdma-kv: workloads, the two-process runner,
baselines (batched ``process_vm_readv``, NIXL, ``ucx_perftest``) and reports.

Importing this package is cheap: it never imports ``rdma_kv.transport``,
NIXL or UCX; each backend loads its dependency inside its own child
processes. Imports numpy and the stdlib.
"""

from rdma_kv.bench.report import Result
from rdma_kv.bench.workloads import PRESETS, Batch, Workload, batch, coalesce, preset

__all__ = ["PRESETS", "Batch", "Result", "Workload", "batch", "coalesce", "preset"]
