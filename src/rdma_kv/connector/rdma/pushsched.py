"""Push mode, the producer's scheduler side: the prefills under a router's
transfer id (concurrent dispatch) and each step's chunks of them.

:class:`PushPrefills` remembers, per prefill whose params carry a
``transfer_id`` (vllm-router's moriio mode), the id and the blocks the
prefill holds so far; every step it turns the scheduled chunks of those
prefills into :class:`meta.LayerPushSpec` records (with the digest of the
prefill's prompt), which the workers use to write each layer's complete
blocks to the decodes of that prompt registered under the id while the
forward pass runs (``pushreg``). Models with one KV-cache group
only (a hybrid model's concurrent push is refused: ``pushreg.register``).

:func:`router_payload` is what this engine registers with such a router's
discovery (``discovery``).

Imports the standard library and the connector's ``types``, ``rdma.meta``,
``rdma.params`` and ``rdma.settings``.
"""

from __future__ import annotations

from typing import Any

from rdma_kv.connector.rdma.meta import LayerPushSpec
from rdma_kv.connector.rdma.params import (
    RemoteDecodeRequest,
    format_router_address,
    parse_kv_transfer_params,
    request_prompt_digest,
)
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.types import BlockIds, Request, RequestId, SchedulerOutput
from rdma_kv.errors import ConfigError

__all__ = ["PushPrefills", "router_payload"]


class PushPrefills:
    """Prefills under a transfer id -> (the id, their blocks so far, their prompt's digest)."""

    def __init__(self, num_groups: int) -> None:
        self._num_groups = num_groups
        self._tracked: dict[RequestId, tuple[str, list[int], bytes]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tracked

    def note(self, request: Request) -> None:
        """``request`` is a prefill under a router's transfer id: its steps
        go to the workers as ``layer_pushes``. Bad params are reported where
        they are used (the scheduler's parse)."""
        try:
            parsed = parse_kv_transfer_params(request.kv_transfer_params)
        except ConfigError:
            return
        if isinstance(parsed, RemoteDecodeRequest) and parsed.transfer_id and self._num_groups == 1:
            self._tracked[request.request_id] = (parsed.transfer_id, [], request_prompt_digest(request))

    def forget(self, request_id: RequestId) -> bytes | None:
        """Stop tracking ``request_id``; its prompt's digest, if it was tracked."""
        tracked = self._tracked.pop(request_id, None)
        return tracked[2] if tracked is not None else None

    def step(self, output: SchedulerOutput) -> tuple[LayerPushSpec, ...]:
        """This step's chunks of the tracked prefills: the blocks each holds
        (a request resumed from preemption starts its list again) and the
        tokens ``[start, end)`` it computes."""
        if not self._tracked:
            return ()
        out = []
        scheduled: list[tuple[RequestId, tuple[BlockIds, ...] | None, int, bool]] = [
            (n.request_id, n.block_ids, n.num_computed_tokens, True) for n in output.scheduled_new_reqs]
        scheduled += [(c.request_id, c.new_block_ids, c.num_computed_tokens, c.resumed_from_preemption)
                      for c in output.scheduled_cached_reqs]
        for rid, new_blocks, computed, replace in scheduled:
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            transfer_id, blocks, digest = tracked
            if new_blocks:
                if replace:
                    blocks.clear()
                blocks.extend(int(b) for b in new_blocks[0])
            count = output.num_scheduled_tokens.get(rid, 0)
            if count > 0:
                out.append(LayerPushSpec(transfer_id, rid, tuple(blocks), computed, computed + count, digest))
        return tuple(out)


def router_payload(settings: RdmaSettings, producer: bool, port: int, engine_id: str) -> dict[str, Any]:
    """This engine as a concurrently dispatching router registers it: its
    role, HTTP address, side channel (``params.format_router_address``) and
    transfer mode (WRITE in push mode)."""
    return {"type": "P" if producer else "D", "http_address": settings.router_http_address,
            "zmq_address": format_router_address(settings.advertise_host, port, engine_id, settings.tp_size),
            "transfer_mode": "WRITE" if settings.mode == "push" else "READ", "tp_size": settings.tp_size,
            "dp_size": 1}
