"""The harness engine's block pool: what vLLM's KV-cache manager does for
the connector's purposes, a free list (least recently freed reused first)
and a prefix cache of full blocks keyed by their seed chain.

Imports the standard library only.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

__all__ = ["BlockPool"]


class BlockPool:
    """Free list (LRU) plus a prefix cache of full blocks keyed by their seed chain."""

    def __init__(self, num_blocks: int) -> None:
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.refs = [0] * num_blocks
        self.cached: dict[int, int] = {}  # chain key -> block id
        self.key_of: dict[int, int] = {}  # block id -> chain key

    def hits(self, keys: Sequence[int]) -> list[int]:
        out = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def allocate(self, hits: Sequence[int], count: int) -> list[int] | None:
        fresh = [b for b in self.free if b not in hits]
        if len(fresh) < count:
            return None
        for block in hits:
            self.refs[block] += 1
            self.free.pop(block, None)
        out = []
        for block in fresh[:count]:
            self.free.pop(block)
            old = self.key_of.pop(block, None)  # evict its cache entry: it is being overwritten
            if old is not None and self.cached.get(old) == block:
                del self.cached[old]
            self.refs[block] = 1
            out.append(block)
        return list(hits) + out

    def cache(self, key: int, block: int) -> None:
        if key not in self.cached:
            self.cached[key] = block
            self.key_of[block] = key

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None  # most recently freed last: evicted last

    @property
    def num_free(self) -> int:
        return len(self.free)
