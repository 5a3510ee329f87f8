"""rdma_kv.selftest: does rdma-kv work on this host, end to end?

``rdma-kv selftest`` and ``run_selftest()`` check, each as one line with
PASS, FAIL or SKIP and the reason:

- UCX: the library loaded (wheel or system), its version, transports and
  devices by memory type (``ucx.py``);
- host memory: two processes, the real ``Agent``, prepared lists, a
  KV-shaped read and a notified one, bit-exact, GB/s (``groups.py``,
  ``pair.py``);
- CUDA, per visible GPU (skipped without a driver, saying so): a torch
  CUDA KV cache registered through the connector's own code with
  ``ucp_mem_query`` saying CUDA, GPU -> GPU and GPU <-> host reads between
  two processes, the pumps' CUDA context in practice (``cuda.py``); the
  KV layouts the handshake relies on, on real CUDA tensors (``layout.py``);
- NICs: per device of the rank's ``ucx_net_devices`` (or every RDMA device
  UCX reports), a loopback read through that device (``groups.py``): over
  verbs the HCA loops it back (a PASS says it proves the HCA, not the link
  or switch); over tcp the kernel routes it over ``lo``, so the NIC is not
  exercised: a SKIP that the summary line names.

Groups that move data run in check processes of their own under a
deadline: a hang is killed and a crash is reported (``supervise.py``).
The JSON report and the exit status are in ``report.py``.

    from rdma_kv.selftest import SelftestOptions, run_selftest, exit_status
    checks = run_selftest(SelftestOptions(quick=True), on_check=print)

Sits beside ``cli`` and ``bench`` above the layers: may import
rdma_kv.transport, rdma_kv.connector and rdma_kv.bench, never rdma_kv.vllm;
rdma_kv.cli only in ``__main__`` (``python -m rdma_kv.selftest`` is
``rdma-kv selftest``). Importing it loads neither UCX nor torch.
"""

from rdma_kv.selftest.report import Check, Status, exit_status, render, summary, to_json, write_json
from rdma_kv.selftest.run import SelftestOptions, run_selftest

__all__ = ["Check", "SelftestOptions", "Status", "exit_status", "render", "run_selftest", "summary", "to_json",
           "write_json"]
