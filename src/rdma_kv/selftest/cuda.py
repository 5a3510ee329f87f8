"""The CUDA checks, per visible GPU, in a check process of their own.

For GPU ``i`` (its reads pair it with GPU ``i+1``, itself when there is one):

- ``cuda:i.register``: a KV cache of torch CUDA tensors (every layer a view
  of one allocation, as vLLM allocates it) registered through the
  connector's own ``RdmaWorker.register_kv_caches`` with the real agent;
  ``ucp_mem_query`` must say CUDA (the agent refuses anything else, and the
  refusal is reported, never raised);
- ``cuda:i.gpu-gpu``, ``cuda:i.gpu-host``, ``cuda:i.host-gpu``: two
  processes, prepared lists, KV-shaped reads GPU -> GPU (cuda_ipc where UCX
  offers it, else what UCX picks; the protocol UCX chose is reported),
  GPU -> host and host -> GPU, bit-exact, GB/s; GPU -> GPU FAILs when UCX
  carried it by software emulation (no zero-copy path: a GPU KV cache would
  move at TCP speed);
- ``cuda:i.pump-context``: the reader's agent, made on a thread whose
  current context is GPU ``i``'s, recorded it, and its pumps progressed
  those device reads to completion (a pump without a context fails them:
  ai-dynamo/nixl#2102);
- ``cuda:i.push-fence``: push mode's layer fence (``connector.rdma.fences``)
  on the real stream: recorded behind a kernel still running, it has not
  passed; once waited for, it has, and the kernel's writes are in memory
  (a layer-wise write posted at that point sends the stored layer);

then ``layout`` (``layout.py``) on GPU 0.

May import: the standard library, rdma_kv.errors, rdma_kv.connector,
rdma_kv.selftest; torch and the transport lazily (torch only here, in the
check process).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from rdma_kv.connector.geometry import KVCacheGeometry, Region
from rdma_kv.connector.rdma.fences import stream_fences
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, normalize_dtype
from rdma_kv.selftest.groups import settings_from
from rdma_kv.selftest.layout import layout_check
from rdma_kv.selftest.pair import ReadSpec, Reads, device_scope, kv_workload, run_reads
from rdma_kv.selftest.report import Check, Status
from rdma_kv.selftest.supervise import Deadline, Sink, UcxLog

__all__ = ["cuda_group", "fence_check", "kv_cache_shape", "kv_caches", "pump_check", "register_check"]

MiB = 1 << 20

# What an operator does when GPU -> GPU reads are not zero-copy (measured on
# an H200 without NVLink: UCX's cuda_ipc get is off by default there).
GPU_GPU_HINT = ("rdma-kv asks UCX for cuda_ipc gets (CUDA_IPC_ENABLE_GET_ZCOPY=y): check that "
                "UCX_CUDA_IPC_ENABLE_GET_ZCOPY is not set to n/off, that ucx_options/UCX_TLS keep cuda_ipc "
                "(or an RDMA transport with GPUDirect), and that both processes see the GPUs (deploy.md, section 10)")


def kv_cache_shape(quick: bool) -> tuple[int, ...]:
    """``[layers, 2, num_blocks, block_size, kv_heads, head_size]`` (fp16):
    16 MiB quick, 256 MiB otherwise."""
    return (4 if quick else 16, 2, 64 if quick else 256, 16, 8, 128)


def kv_caches(whole: Any) -> tuple[dict[str, Any], KVCacheConfig]:
    """Per-layer views of one ``[layers, 2, blocks, block_size, heads, head]``
    allocation (FlashAttention's layout per layer) and its KV-cache config."""
    layers, _, blocks, block_size, heads, head = tuple(whole.shape)
    names = tuple(f"layer.{i}" for i in range(layers))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head,
                             dtype=normalize_dtype(whole.dtype))
    nbytes = math.prod(whole.shape) * whole.element_size()
    config = KVCacheConfig(blocks, (KVCacheTensor(nbytes, names),), (KVCacheGroupSpec(names, spec),))
    return {name: whole[i] for i, name in enumerate(names)}, config


def register_check(name: str, whole: Any, settings: RdmaSettings,
                   transport_factory: Callable[[str, RdmaSettings], Any] | None = None) -> Check:
    """Register the KV cache ``whole`` (see ``kv_caches``) as a consumer
    engine's worker does, with the real agent unless ``transport_factory``
    says otherwise; PASS when UCX mapped it as CUDA memory."""
    from rdma_kv.connector.config import KVRole, KVTransferConfig
    from rdma_kv.connector.rdma.connector import agent_transport
    from rdma_kv.connector.rdma.worker import RdmaWorker

    factory = transport_factory or agent_transport
    made: list[Any] = []

    def recording(agent_name: str, s: RdmaSettings) -> Any:
        made.append(factory(agent_name, s))
        return made[-1]

    device = str(whole.device)
    caches, kv_config = kv_caches(whole)
    nbytes = kv_config.kv_cache_tensors[0].size
    size = f"{nbytes / MiB:.0f} MiB" if nbytes >= MiB else f"{nbytes >> 10} KiB"
    what = f"a {size} KV cache on {device} ({len(caches)} layers, views of one allocation)"
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=KVRole.CONSUMER, engine_id="selftest", kv_port=0)
    # No side channel is opened (consumer), so no secret is needed to register.
    worker = RdmaWorker(config, dataclasses.replace(settings, auth_secret_env=None, auth_secret_file=None),
                        kv_config, recording)
    try:
        worker.register_kv_caches(caches)
        # The KV cache's registrations (the worker also registers host arrays of its own: held words).
        base = whole.untyped_storage().data_ptr()
        regions = [r for r in made[-1].regions if r.base < base + nbytes and base < r.base + r.nbytes]
        options = dict(made[-1].config.ucx_options) if hasattr(made[-1], "config") else {}
    except Exception as exc:  # report, never raise: this is a diagnostic
        return Check.failed(name, f"the connector's register_kv_caches refused {what}: {type(exc).__name__}: {exc}")
    finally:
        worker.shutdown()
    kinds = sorted({region.kind.value for region in regions})
    figures: dict[str, Any] = {"nbytes": nbytes, "regions": len(regions), "memory_types": kinds,
                               "net_devices": options.get("NET_DEVICES", "")}
    if kinds != ["cuda"]:
        return Check.failed(name, f"{what} was registered but ucp_mem_query says {', '.join(kinds)}, not cuda: "
                            "UCX would move it as that memory type", **figures)
    devices = f"; NET_DEVICES={figures['net_devices']}" if figures["net_devices"] else ""
    return Check.passed(name, f"{what} registered through the connector's register_kv_caches: {len(regions)} "
                        f"region(s), ucp_mem_query says cuda{devices}", **figures)


def pump_check(name: str, reads: Reads) -> Check:
    """What the device reads of one GPU say about the reader's pumps."""
    lanes = {"lanes": reads.lanes}
    if reads.cuda_context is None:
        return Check.failed(name, "no CUDA context was current on the thread that made the reader's agent (after "
                            "it allocated on the GPU): its pumps had none to make current, and UCX's CUDA "
                            "transports need one in every thread that progresses a worker (ai-dynamo/nixl#2102)",
                            **lanes)
    context = f"{reads.cuda_context:#x}"
    failed = [c.name for c in reads.checks if c.status is not Status.PASS]
    if failed or not reads.checks:
        return Check.failed(name, f"context {context} was recorded, but the device reads its pumps progressed did "
                            f"not pass: {', '.join(failed) or 'none ran'}", context=context, **lanes)
    workers = max(w if isinstance(w := c.figures.get("workers"), int) else 1 for c in reads.checks)
    return Check.passed(name, f"the reader's agent recorded context {context} on its creating thread; its pumps "
                        f"({reads.lanes} lane(s), progress thread) made it current and completed "
                        f"{len(reads.checks)} device reads bit-exact on up to {workers} worker(s)",
                        context=context, workers=workers, **lanes)


def fence_check(name: str, torch: Any, device: str) -> Check:
    """Push mode's layer fence on ``device``'s current stream (see the module)."""
    try:
        with device_scope(device):
            layer = torch.zeros(MiB // 2, dtype=torch.float16, device=device)
            region = Region(layer.data_ptr(), 2 * layer.numel(), device, ("layer",))
            record = stream_fences(KVCacheGeometry((region,), ()))
            if record is None:
                return Check.failed(name, f"stream_fences gave no fence for a KV cache on {device}: layer-wise "
                                    "pushes would post before the GPU stored the layer")
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time queued ahead of the store
            layer.fill_(3.0)               # the attention kernel storing the layer
            fence = record()
            early = fence.query()
            fence.synchronize()
            late, stored = fence.query(), bool((layer == 3.0).all().item())
    except Exception as exc:  # a CUDA error is this check's FAIL, not the group's end
        return Check.failed(name, f"the layer fence on {device} raised {type(exc).__name__}: {exc}")
    if early or not late or not stored:
        return Check.failed(name, f"the layer fence on {device}'s stream: passed before the kernel ran={early}, "
                            f"passed after waiting={late}, the kernel's writes in memory={stored}")
    return Check.passed(name, f"a layer fence recorded behind a running kernel on {device} had not passed; "
                        "after waiting it had, with the kernel's writes in memory")


def cuda_group(params: dict[str, Any], sink: Sink) -> None:
    """Every CUDA check of every visible GPU (a check process's body)."""
    try:
        import torch
    except ImportError:
        sink.add(Check.skipped("cuda", "a GPU driver is present but torch is not installed in this environment: the "
                               "CUDA checks use torch CUDA tensors (install torch, or make the kit's venv with "
                               "--system-site-packages to use the host's)"))
        return
    if not torch.cuda.is_available():
        sink.add(Check.skipped("cuda", f"a GPU driver is present but torch {torch.__version__} sees no CUDA device "
                               f"(CPU build, or CUDA_VISIBLE_DEVICES hides them)"))
        return
    settings = settings_from(params["connector"])
    log = UcxLog(params["ucx_log"])
    quick, count = bool(params["quick"]), torch.cuda.device_count()
    workload = kv_workload(quick, int(params["seed"]))
    for i in range(count):
        deadline = Deadline(float(params["deadline_s"]))  # per GPU: run.py scales the group's by the count
        device, peer = f"cuda:{i}", f"cuda:{(i + 1) % count}"
        sink.begin(f"{device}.register")
        with device_scope(device):
            whole = torch.zeros(kv_cache_shape(quick), dtype=torch.float16, device=device)
            sink.add(register_check(f"{device}.register", whole, settings))
        del whole
        # UCX picks the transport (cuda_ipc between processes on one node, where
        # it offers it); the label says whether it could, the protocol what it did.
        ipc = "cuda_ipc offered" if params["cuda_ipc"] else "UCX offers no cuda_ipc: its own pick"
        reads = run_reads([ReadSpec(f"{device}.gpu-gpu", device, peer, label=f"{peer} -> {device} ({ipc})",
                                    zero_copy=True, hint=GPU_GPU_HINT),
                           ReadSpec(f"{device}.gpu-host", "host", peer),
                           ReadSpec(f"{device}.host-gpu", device, "host")],
                          workload, sink, deadline, ucx_options=dict(settings.for_device(device).ucx_options),
                          lanes=settings.lanes, log=log)
        sink.begin(f"{device}.pump-context")
        sink.add(pump_check(f"{device}.pump-context", reads))
        sink.begin(f"{device}.push-fence")
        sink.add(fence_check(f"{device}.push-fence", torch, device))
    sink.begin("layout")
    sink.add(layout_check(torch, "cuda:0"))
