"""When a layer's KV is in memory: the fences of push mode's layer-wise
writes on CUDA KV caches.

vLLM calls ``save_kv_layer`` right after a layer's attention forward was
*enqueued*. On a host KV cache the layer is stored by then (the CPU ran
the forward). On a GPU the kernel that stores it may not have run yet, and
a one-sided write posted then would send the blocks' old contents, with no
error anywhere (vllm-rbln #1024: "a write issued too early reads a
half-written block and reports no error"). So on CUDA each layer handed
over gets a fence, an event recorded on the device's current stream (the
stream the forward runs on), and its writes are posted only once the fence
has passed (``pushreg.ConcurrentDispatch``):

- at a later ``save_kv_layer`` of the same step, if the GPU has got that
  far (``query``, which never blocks);
- else at ``wait_for_save``, which waits for one last fence recorded
  behind the whole forward pass (``synchronize``) and then posts every
  layer still waiting. Only a step with layer-wise writes to make waits.

The writes themselves are ordered after nothing on the GPU: UCX's CUDA
transports copy on their own streams, which is why the fence is needed.

May import: the standard library, the connector's ``geometry``; torch
only when a KV cache is on CUDA (it is then already imported).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rdma_kv.connector.geometry import KVCacheGeometry

__all__ = ["Fence", "FenceFactory", "stream_fences"]


class Fence(Protocol):
    """A point on a stream (``torch.cuda.Event`` is one)."""

    def query(self) -> bool:
        """Whether the work before the fence has finished (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Wait until the work before the fence has finished."""
        ...


FenceFactory = Callable[[], Fence]
"""Records a fence behind the work enqueued so far."""


def stream_fences(geometry: KVCacheGeometry) -> FenceFactory | None:
    """The fences layer-wise writes from ``geometry``'s KV cache need: None
    for a host KV cache (a layer is stored when it is handed over), events
    on the current stream of its device for a CUDA one. ValueError for a
    KV cache spread over several devices (layer-wise writes are then off:
    every block is written at the seal, after the step's output was
    synchronised)."""
    if all(region.memory_type == "host" for region in geometry.regions):
        return None
    devices = {region.device for region in geometry.regions}
    if len(devices) != 1:
        raise ValueError(f"the KV cache spans devices {sorted(devices)}; layer-wise writes need one device's stream")
    (device,) = devices
    import torch  # a CUDA KV cache: torch made it

    dev = torch.device(device)
    cuda: Any = torch.cuda  # (torch.cuda.Event is untyped)

    def record() -> Fence:
        event = cuda.Event()
        event.record(cuda.current_stream(dev))
        fence: Fence = event
        return fence

    return record
