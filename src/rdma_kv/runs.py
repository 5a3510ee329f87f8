"""Merging contiguous runs: the one Python reference.

A list of spans (start, length), read on one or more sides at once (the
local and the remote addresses of a read, say), splits into runs: span
``i + 1`` joins span ``i``'s run when, on every side, it starts where span
``i`` ends and lies in the same region. One run is one operation to post.

:func:`run_starts` is the rule; ``transport.descriptors.coalesce`` (explicit
descriptors) and ``connector.rdma.slots.count_runs`` (runs of block ids)
call it, and tests compare against it. The C shim merges by the same rule
as it posts (``rk_post_indexed`` in ``transport/csrc/shim.c``).

Imports numpy only: like ``errors``, it sits below every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["run_starts"]


def run_starts(lengths: np.ndarray, sides: Sequence[tuple[np.ndarray, np.ndarray | None]]) -> np.ndarray:
    """Indices of the spans that start a run (always ``0`` when there is a
    span). ``sides``: per side, the spans' starts and their regions (None:
    one region). The lengths are the same on every side."""
    n = len(lengths)
    if n == 0:
        return np.empty(0, dtype=np.intp)
    brk = np.zeros(n, dtype=bool)
    brk[0] = True
    for starts, regions in sides:
        brk[1:] |= starts[1:] != starts[:-1] + lengths[:-1]
        if regions is not None:
            brk[1:] |= regions[1:] != regions[:-1]
    return np.flatnonzero(brk)
