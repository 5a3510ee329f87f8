"""``AgentConfig``: the settings of one transfer agent, checked at construction.

May import: rdma_kv.errors, rdma_kv.transport.lanes (for MAX_LANES).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rdma_kv.errors import ConfigError
from rdma_kv.transport.lanes import MAX_LANES

PROGRESS_MODES = ("thread", "poll")

# The most lanes the default gives (AgentConfig(lanes=N) goes up to MAX_LANES).
# Two is all this project could measure (2 CPUs, CMA: docs/benchmarks.md),
# and a lane adds bandwidth only on an idle core of its own. Where more
# cores are idle and a fabric has queue pairs to fill, set lanes explicitly.
DEFAULT_LANES_CAP = 2


def default_lanes() -> int:
    """Lanes an agent gets unless told: the CPUs the calling thread may run
    on (``sched_getaffinity(0)``: a thread pinned to one core gets one
    lane), at most ``DEFAULT_LANES_CAP``. Small transfers stay on one
    worker anyway: a part is at least ``lane_min_bytes``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API: count the CPUs
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, DEFAULT_LANES_CAP, MAX_LANES))


@dataclass(frozen=True)
class AgentConfig:
    """Agent settings. ``ucx_options`` are UCX settings without the ``UCX_``
    prefix, applied to this agent's context only."""

    progress: str = "thread"
    ucx_options: dict[str, str] = field(default_factory=dict)
    transfer_timeout_s: float = 30.0
    max_inflight: int = 16384
    notif_slots: int = 4096
    notif_max_bytes: int = 1024
    spin_s: float = 0.0002
    # progress="thread": a completion is left this long to a caller that
    # settles anyway (one woken in wait(), a connector's step, settle())
    # before the service thread takes the interpreter lock for it; so
    # completion callbacks nobody drives run at most this much later, and
    # the service thread competes with a busy caller at most once per
    # interval instead of once per completion (docs/benchmarks.md).
    settle_delay_s: float = 0.0002
    # Workers that carry one large transfer in parallel (lanes.py); each extra
    # lane is a worker, an endpoint per peer and a C progress thread (pump).
    # Default: default_lanes(), from the CPUs the creating process may use.
    lanes: int = field(default_factory=default_lanes)
    # Stripe only into parts at least this large: each lane's part costs its
    # pump a wake-up and a second post loop, a fixed cost that only a part of
    # about 1 MiB or more earns back in parallel bytes (docs/design.md,
    # "Lanes", has the measurements behind the default).
    lane_min_bytes: int = 1 << 20
    # A transfer too small to stripe goes whole to one worker -- polling: the
    # one with the fewest bytes posted and not yet complete; with pumps: the
    # next in turn -- so that concurrent requests copy on every worker at
    # once; False keeps every such transfer on the agent's own worker.
    spread: bool = True
    # With spread, a transfer posted while nothing else is in flight stays on
    # the own worker, which its caller drives (a lane's pump would have to
    # wake up for it: a lone 512 KiB request's p99 0.55-0.59 -> 0.20 ms,
    # docs/benchmarks.md); True sends every one to the next worker in turn.
    spread_alone: bool = False
    # A second endpoint to every peer on every worker, for transfers too small
    # to stripe (under 2 x lane_min_bytes): UCX serves an endpoint's operations
    # in order and a worker's endpoints in turn, so a small request no longer
    # waits behind every operation of a large one posted before it (on CMA a
    # 512 KiB read behind 24 MiB: 6.9 ms -> 0.25 ms; the demo's mixed loads:
    # p10 GB/s about 3x, docs/benchmarks.md). It doubles the endpoints (on
    # InfiniBand the queue pairs, on both sides): off by default.
    express: bool = False
    # close() first lets what is in flight finish for this long: force-closing
    # an endpoint with CMA gets still queued can trip a UCX assertion
    # (arbiter group not empty) when the worker is destroyed.
    close_drain_s: float = 1.0

    def __post_init__(self) -> None:
        if self.progress not in PROGRESS_MODES:
            raise ConfigError(f"progress={self.progress!r} is not valid; valid values: {', '.join(PROGRESS_MODES)}")
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {self.lanes}")
        if self.lane_min_bytes < 1:
            raise ConfigError(f"lane_min_bytes must be >= 1, got {self.lane_min_bytes}")
        if not self.spin_s >= 0:  # also rejects NaN
            raise ConfigError(f"spin_s must be >= 0 seconds, got {self.spin_s}")
        if not 0 <= self.settle_delay_s <= 1.0:  # also rejects NaN
            raise ConfigError(f"settle_delay_s must be between 0 and 1 second, got {self.settle_delay_s}")
        if self.close_drain_s < 0:
            raise ConfigError(f"close_drain_s must be >= 0, got {self.close_drain_s}")
        if not self.transfer_timeout_s > 0:
            raise ConfigError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        for name in ("max_inflight", "notif_slots", "notif_max_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
