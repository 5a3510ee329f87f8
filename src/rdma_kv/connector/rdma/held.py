"""The RDMA connector's scheduler, producer side: the leases it granted and
has not yet heard finished, the blocks each holds, and memory pressure.

A block several leases hold counts once (vLLM's prefix cache gives
requests with a common prefix the same physical blocks): ending one of
those leases frees only the blocks no other lease holds. **Memory
pressure** is a request the engine asked about in a step and left waiting
while it needs more blocks than are free (``bind_free_blocks``; with no
count bound, any request left waiting): vLLM also leaves requests for the
next step with blocks to spare (the step's token budget with chunked
prefill off, the encoder's budget, data-parallel prefill pacing), and no
lease need end for those. Under pressure, while leases hold more than
``lease_max_share`` of the KV cache, the oldest are ended (their consumers
get GONE and recompute), so held blocks cannot starve new prefills.

Imports the standard library and the connector's ``types`` and
``rdma.lograte``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator

from rdma_kv.connector.rdma.lograte import RateLimitedWarnings
from rdma_kv.connector.types import BlockId, GroupBlockIds, RequestId

__all__ = ["HeldLeases"]

logger = logging.getLogger("rdma_kv.connector.rdma.scheduler")


class HeldLeases:
    """Leases granted and not yet reported finished, oldest grant first,
    with the blocks each holds per KV-cache group; and the requests waiting
    for blocks this step."""

    def __init__(self, num_blocks: int, max_share: float) -> None:
        self._num_blocks = num_blocks
        self._max_share = max_share
        self._held: dict[RequestId, tuple[int, GroupBlockIds]] = {}
        """request id -> (lease generation, the blocks it holds per group)."""
        self._refs: collections.Counter[tuple[int, BlockId]] = collections.Counter()
        """(group, block id) -> the leases holding it."""
        self._waiting: dict[RequestId, int] = {}
        """Asked about this step and not yet given blocks, with the blocks each
        one's tokens fill."""
        self._free_blocks: Callable[[], int] | None = None
        self._warnings = RateLimitedWarnings(logger, "lease reclaims", burst=1, window_s=10.0)
        self.reclaimed = 0
        """Leases ended under memory pressure (for stats and tests)."""

    def __contains__(self, rid: object) -> bool:
        return rid in self._held

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self._held)

    def generation(self, rid: RequestId) -> int | None:
        """The generation of ``rid``'s lease while it is held, else None."""
        held = self._held.get(rid)
        return None if held is None else held[0]

    def hold(self, rid: RequestId, generation: int, blocks: GroupBlockIds) -> None:
        self._held[rid] = (generation, blocks)
        self._refs.update((g, b) for g, ids in enumerate(blocks) for b in ids)

    def end(self, rid: RequestId) -> int:
        """Lease ``rid`` ended (released, expired, reclaimed): its generation."""
        generation, blocks = self._held.pop(rid)
        for key in ((g, b) for g, ids in enumerate(blocks) for b in ids):
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]  # no other lease holds it: freed with this one
        return generation

    def num_blocks(self) -> int:
        """Blocks held (a block several leases hold, once)."""
        return len(self._refs)

    # ------------------------------------------------------------------ pressure

    def bind_free_blocks(self, free_blocks: Callable[[], int]) -> None:
        """Learn how to read the engine's free KV-cache blocks (vLLM: its block pool's)."""
        self._free_blocks = free_blocks

    def waiting(self, rid: RequestId, blocks: int) -> None:
        """The engine asked about ``rid``, whose tokens fill ``blocks``."""
        self._waiting[rid] = blocks

    def given(self, rid: RequestId) -> None:
        """``rid`` got blocks, waits on another request, or finished."""
        self._waiting.pop(rid, None)

    def step(self) -> list[tuple[RequestId, int]]:
        """At the end of a step: the leases ended under memory pressure,
        oldest first, as (request id, generation)."""
        if not self._waiting:
            return []
        short = self._free_blocks is None or max(self._waiting.values()) > self._free_blocks()
        self._waiting.clear()
        limit = int(self._max_share * self._num_blocks)
        if not short or self._max_share >= 1 or len(self._refs) <= limit:
            return []
        ended: list[tuple[RequestId, int]] = []
        freed = 0
        for rid in list(self._held):
            if len(self._refs) <= limit:
                break
            held = len(self._refs)
            ended.append((rid, self.end(rid)))
            freed += held - len(self._refs)
        self.reclaimed += len(ended)
        self._warnings.warn(
            "pressure", "requests wait for KV-cache blocks while leases hold more than lease_max_share=%g "
            "of %d blocks: ended the %d oldest lease(s) (%d blocks); their decodes recompute",
            self._max_share, self._num_blocks, len(ended), freed)
        return ended
