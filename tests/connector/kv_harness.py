"""Test helpers for the connector tests: a tiny model's KV cache, a
deterministic "forward pass", a mini engine that drives a scheduler-side and
a worker-side connector in the contract's call order, and a fake connector
(loaded by module path, which also exercises the factory's fallback).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rdma_kv.connector import (
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVConnectorBase,
    KVConnectorFactory,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    NewRequestData,
    Request,
    SchedulerOutput,
)

NUM_LAYERS = 4
NUM_HEADS = 2
HEAD_SIZE = 8
BLOCK_SIZE = 4
NUM_BLOCKS = 32
LAYERS = tuple(f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS))
SPEC = FullAttentionSpec(
    block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS, head_size=HEAD_SIZE, dtype="bfloat16"
)


def cpu_kv_caches(num_blocks: int = NUM_BLOCKS, fill_seed: int | None = None):
    """vLLM's CPU layout: every layer a [num_blocks, heads, block, 2*head]
    view of ONE allocation, layer outermost. Filled with seeded noise so a
    block that is never written is noticed."""
    whole = torch.empty(
        NUM_LAYERS, num_blocks, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.bfloat16
    )
    if fill_seed is not None:
        gen = torch.Generator().manual_seed(fill_seed)
        whole.copy_(torch.randn(whole.shape, generator=gen))
    else:
        whole.zero_()
    caches = {name: whole[i] for i, name in enumerate(LAYERS)}
    config = KVCacheConfig(
        num_blocks,
        (KVCacheTensor(whole.numel() * whole.element_size(), LAYERS),),
        (KVCacheGroupSpec(LAYERS, SPEC),),
    )
    return caches, config


def expected_block(tokens: Sequence[int], block_index: int, layer: int) -> torch.Tensor:
    """The KV a model computes for block ``block_index``: a function of the
    token prefix up to the block's end (like real attention KV)."""
    prefix = np.asarray(tokens[: (block_index + 1) * BLOCK_SIZE], dtype="<i8").tobytes()
    seed = int.from_bytes(hashlib.sha256(prefix + bytes([layer])).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def storage_config(path: str, role: str = "kv_both", **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="StorageConnector",
        kv_role=role,
        kv_connector_extra_config={"storage_path": str(path), **extra},
    )


class MiniEngine:
    """Drives one scheduler-side and one worker-side connector in the
    contract's order, with a CPU-layout KV cache and a fake forward pass
    that writes ``expected_block`` into every block it computes."""

    def __init__(self, config: KVTransferConfig, fill_seed: int = 0, first_block: int = 0):
        self.kv_caches, self.kv_cache_config = cpu_kv_caches(fill_seed=fill_seed)
        self.scheduler = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )
        self.worker = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.register(self.kv_caches)
        # Allocation starts at ``first_block`` so two engines use different ids.
        self.free = list(range(first_block, NUM_BLOCKS)) + list(range(first_block))
        self.pending_finished: set[str] = set()
        self.outputs: list[KVConnectorOutput] = []
        self.computed_blocks: dict[str, list[int]] = {}

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register the worker's KV caches and hand the scheduler the
        worker's handshake metadata, as an engine does at start-up."""
        self.kv_caches = dict(kv_caches)
        self.worker.register_kv_caches(self.kv_caches)
        handshake = self.worker.get_handshake_metadata()
        if handshake is not None:
            self.scheduler.set_xfer_handshake_metadata({0: handshake})

    def step(self, scheduler_output: SchedulerOutput, compute: Mapping[str, tuple] = {}) -> tuple:
        meta = self.scheduler.build_connector_meta(scheduler_output)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        for layer_index, name in enumerate(LAYERS):
            self.worker.wait_for_layer_load(name)
            for tokens, block_ids, first in compute.values():
                for i in range(first, len(block_ids)):
                    if (i + 1) * BLOCK_SIZE <= len(tokens):  # full blocks only
                        self.kv_caches[name][block_ids[i]] = expected_block(tokens, i, layer_index)
            self.worker.save_kv_layer(name, self.kv_caches[name], None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(scheduler_output.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        output = KVConnectorOutput.of(sending, recving, errors)
        self.scheduler.update_connector_output(output)
        self.outputs.append(output)
        return meta, output

    def prefill(self, request: Request) -> dict[str, Any]:
        """Admit, load what the connector offers, compute the rest, finish."""
        num_external, load_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        assert num_external is not None and not load_async
        num_blocks = -(-request.num_prompt_tokens // BLOCK_SIZE)
        block_ids = [self.free.pop(0) for _ in range(num_blocks)]
        blocks = KVCacheBlocks.of(block_ids)
        self.scheduler.update_state_after_alloc(request, blocks, num_external)
        request.num_computed_tokens = num_external
        output = SchedulerOutput(
            scheduled_new_reqs=(NewRequestData.from_request(request, blocks),),
            num_scheduled_tokens={request.request_id: request.num_prompt_tokens - num_external},
            finished_req_ids=frozenset(self.pending_finished),
        )
        self.pending_finished.clear()
        first = num_external // BLOCK_SIZE
        meta, out = self.step(
            output, {request.request_id: (request.prompt_token_ids, block_ids, first)}
        )
        request.num_computed_tokens = request.num_prompt_tokens
        delay, params = self.scheduler.request_finished(request, block_ids)
        self.pending_finished.add(request.request_id)
        self.computed_blocks[request.request_id] = block_ids
        return {
            "num_external": num_external, "block_ids": block_ids, "meta": meta,
            "output": out, "delay_free": delay, "params": params,
        }


# --- a fake connector, loaded through kv_connector_module_path -------------------


class FakeMetadata(KVConnectorMetadata):
    def __init__(self, step: int):
        self.step = step


class FakeConnector(KVConnectorBase):
    """Scripted through its extra config and attributes; records every call."""

    def __init__(self, config, role, kv_cache_config):
        super().__init__(config, role, kv_cache_config)
        self.calls: list[tuple] = []
        self.matched = config.get_extra("matched_tokens", 0)
        self.load_async = config.get_extra("load_async", False, type=bool)
        self.delay_free = config.get_extra("delay_free", False, type=bool)
        self.params = dict(config.get_extra("params", {}))
        self.done_sending: set[str] = set()
        self.done_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.handshake: Any = None
        self.steps = 0
        self.fail_shutdown = config.get_extra("fail_shutdown", False, type=bool)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return self.matched, self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, blocks.get_block_ids(), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.steps += 1
        return FakeMetadata(self.steps)

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids)))
        return self.delay_free, (dict(self.params) or None)

    def update_connector_output(self, connector_output):
        self.calls.append(("output", connector_output))

    def set_xfer_handshake_metadata(self, metadata):
        self.calls.append(("handshake", dict(metadata)))

    def register_kv_caches(self, kv_caches):
        self.calls.append(("register", sorted(kv_caches)))

    def get_handshake_metadata(self):
        return self.handshake

    def bind_connector_metadata(self, connector_metadata):
        assert isinstance(connector_metadata, FakeMetadata)
        self.calls.append(("bind", connector_metadata.step))
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context=None, **kwargs):
        self.calls.append(("start_load",))

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait_layer", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs):
        self.calls.append(("save_layer", layer_name))

    def wait_for_save(self):
        self.calls.append(("wait_save",))

    def get_finished(self, finished_req_ids):
        sending, self.done_sending = self.done_sending, set()
        recving, self.done_recving = self.done_recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self):
        errors, self.load_errors = self.load_errors, set()
        return errors

    def get_kv_connector_stats(self):
        return {"steps": self.steps}

    def shutdown(self):
        self.calls.append(("shutdown",))
        if self.fail_shutdown:
            raise RuntimeError("fake shutdown failure")

    def names(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


def fake_child(**extra: Any) -> dict[str, Any]:
    """A child config dict for MultiConnector that loads FakeConnector by module path."""
    return {
        "kv_connector": "FakeConnector",
        "kv_connector_module_path": "kv_harness",
        "kv_connector_extra_config": extra,
    }


class NotAConnector:
    pass


class AbstractConnector(KVConnectorBase):
    def start_load_kv(self, forward_context=None, **kwargs):
        pass
