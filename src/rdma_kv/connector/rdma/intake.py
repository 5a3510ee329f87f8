"""What a decode request's ``kv_transfer_params`` ask of this engine's KV
cache, checked at the scheduler's edge: which blocks of each KV-cache group
a load reads (``blocks_to_read``), whether the producer's block lists fit
the prompt (``remote_blocks_problem``), and where a decode dispatched with
its prefill loads from (``concurrent_load``). Pure functions of the params,
the request and the engine's KV-cache specs; the scheduler (``scheduler``)
decides what to do with the answer.

Imports the connector's ``config``, ``specs``, ``types``, ``rdma.meta``,
``rdma.params`` and ``rdma.remotes``, and ``rdma_kv.errors``.
"""

from __future__ import annotations

from collections.abc import Sequence

from rdma_kv.connector.config import KVRole
from rdma_kv.connector.rdma.meta import PeerAddress
from rdma_kv.connector.rdma.params import ConcurrentPrefill, router_address
from rdma_kv.connector.rdma.remotes import Concurrent
from rdma_kv.connector.specs import KVCacheSpec
from rdma_kv.connector.types import BlockId, BlockIds, EngineId, RequestId
from rdma_kv.errors import ConfigError

__all__ = ["blocks_to_read", "concurrent_load", "remote_blocks_problem"]


def blocks_to_read(spec: KVCacheSpec, num_prompt_tokens: int, num_computed: int,
                   local_blocks: Sequence[BlockId], remote_blocks: Sequence[BlockId]
                   ) -> tuple[BlockIds, BlockIds, int] | str:
    """One KV-cache group's part of a load: ``(local, remote, skipped)``,
    the blocks to read into and from, and how many of the prompt's blocks
    are not read because they lie before the group's sliding window; or why
    the group cannot be loaded.

    ``local_blocks`` are all the request's blocks of the group, from token 0
    (vLLM's ``get_blocks``: leading placeholders where a window skips).
    ``remote_blocks`` are the producer's, ending with the block of the last
    prompt token (``RemotePrefillParams.remote_block_ids``). Blocks before
    ``num_computed`` (a local prefix hit) are not read either, nor counted
    as skipped by the window.
    """
    bs = spec.block_size
    if num_computed % bs:
        return f"num_computed_tokens={num_computed} is not a multiple of block size {bs}"
    last = -(-num_prompt_tokens // bs)
    computed = num_computed // bs
    window = spec.num_skipped_blocks(num_prompt_tokens)
    first = max(computed, window)
    if len(local_blocks) < last:
        return (f"{len(local_blocks)} blocks allocated for a {num_prompt_tokens}-token prompt, "
                f"{last} needed at block size {bs}")
    remote = tuple(remote_blocks[:last])
    offset = last - len(remote)  # the producer's list starts at this block of the prompt
    if first < last and first < offset:
        return (f"the producer sent blocks {offset}..{last - 1} of the prompt, but block {first} "
                "is needed (a producer without the same sliding window, or an old one)")
    return (tuple(local_blocks[first:last]), remote[first - offset:] if first < last else (),
            max(0, min(window, last) - computed))


def remote_blocks_problem(specs: Sequence[KVCacheSpec], num_prompt_tokens: int,
                          remote_block_ids: Sequence[Sequence[BlockId]]) -> str | None:
    """Why the producer's block lists (one per KV-cache group) cannot serve
    a ``num_prompt_tokens``-token prompt on an engine with ``specs``; None
    when they can."""
    if len(remote_block_ids) != len(specs):
        return (f"kv_transfer_params['remote_block_ids'] has {len(remote_block_ids)} "
                f"KV-cache group(s), this engine has {len(specs)}; both engines must "
                "run the same model with the same hybrid KV-cache manager setting")
    for g, (spec, ids) in enumerate(zip(specs, remote_block_ids)):
        last = -(-num_prompt_tokens // spec.block_size)
        needed = last - spec.num_skipped_blocks(num_prompt_tokens)
        if len(ids) < needed:
            where = f" of KV-cache group {g}" if len(specs) > 1 else ""
            return (f"kv_transfer_params['remote_block_ids']{where} has {len(ids)} blocks; the "
                    f"{num_prompt_tokens}-token prompt needs {needed} at block size "
                    f"{spec.block_size} (a producer with a larger --block-size sends fewer "
                    "blocks: start both engines with the same --block-size)")
    return None


def concurrent_load(request_id: RequestId, parsed: ConcurrentPrefill, *, consumer: bool, kv_role: KVRole | None,
                    mode: str, num_groups: int) -> Concurrent:
    """A decode dispatched with its prefill: the producer is the one the
    router named in the request id. ConfigError (the request is computed
    locally) when this engine cannot take it."""
    if not consumer:
        raise ConfigError(f"this engine's kv_role is {kv_role!r}; loading needs kv_consumer or kv_both")
    if mode != "push":
        raise ConfigError(f"transfer_id {parsed.transfer_id!r} without the producer's params: a router "
                          "dispatched the decode with its prefill, which needs mode 'push' on both engines "
                          "(kv_connector_extra_config); this engine runs mode 'pull'")
    if num_groups != 1:
        raise ConfigError("concurrent dispatch (a transfer_id without the producer's params) serves "
                          f"models with one KV-cache group; this engine has {num_groups} (a hybrid "
                          "model): use a router that dispatches sequentially (its NIXL protocol)")
    address = router_address(request_id)
    if address is None:
        raise ConfigError(f"transfer_id {parsed.transfer_id!r} without the producer's params, and the "
                          f"request id {request_id[:200]!r} names no prefill address "
                          "('___prefill_addr_...___decode_addr_', set by vllm-router's moriio mode)")
    host, port, engine, tp = address
    return Concurrent(parsed.transfer_id, PeerAddress(EngineId(engine), host, port, tp))
