"""The rdma-kv backend: ``rdma_kv.transport.Agent`` on the identical batches.

Driven like the NIXL backend, so the two compare one to one: each side's
buffer registered once; on the reader one *prepared* list per side covering
every (layer, region, pool block) slot, made once outside the timed region;
each repetition reads by block-table indices with ``read_prepared``, with
a notification when ``notify`` is set (the target checks at close that one
arrived per repetition).
Timings per rep (``rep_times``): *prep* is the Python work before the C
call (index gathering, argument marshalling), *post* the C post loop
(``rk_submit``), *seconds* from the C call's entry to the completion the
reader saw, return to Python included, the span NIXL's ``transfer`` +
``check_xfer_state`` covers.

Imports numpy, the stdlib, ``rdma_kv.bench`` siblings, and
``rdma_kv.transport`` inside the child processes only.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rdma_kv.bench import runner
from rdma_kv.bench.cma import page_aligned_buffer
from rdma_kv.bench.runner import BenchError, Channel
from rdma_kv.bench.report import Result
from rdma_kv.bench.workloads import Workload, batch

NAME = "rdma-kv"
DEFAULT_OPTIONS: dict[str, Any] = {
    "progress": "poll",  # reader: waits by driving progress itself, as NIXL's reader does
    "target_progress": "thread",  # the idle target sleeps on its event fd
    "ucx_options": {},
    "lanes": None,  # reader's workers per transfer (AgentConfig.lanes); None: AgentConfig's default
    "notify": False,  # a notification on every transfer, as NixlConnector's reads carry
}
NOTIFY_WAIT_S = 10.0  # at close, how long the target waits for the last notifications


def _agent(name: str, progress: str, ucx_options: dict[str, str], lanes: int | None = None) -> Any:
    from rdma_kv.transport import Agent, AgentConfig

    extra: dict[str, Any] = {} if lanes is None else {"lanes": lanes}
    return Agent(name, AgentConfig(progress=progress, ucx_options=dict(ucx_options), **extra))


def slot_descs(workload: Workload, base: int) -> Any:
    """Every slot of one side as a DescList (one descriptor per slot)."""
    from rdma_kv.transport import DescList

    return DescList.slots(base, workload.num_slots, workload.slot_nbytes)


def rep_times(t0: float, t2: float, xfer: Any) -> dict[str, float]:
    """One rep's timings from the caller's clock reads around the call
    (``t0``) and after ``wait`` (``t2``): *seconds* from the shim's entry
    (``xfer.started``, the same ``perf_counter`` clock) to the completion the
    reader saw -- the post loop, the return to Python and the wait, as NIXL's
    *seconds* runs from its ``transfer()`` call -- and *prep* the Python work
    before it. The two add up to the whole call."""
    return {"seconds": t2 - xfer.started, "prep_seconds": xfer.started - t0, "post_seconds": xfer.post_s}


# --- child bodies ------------------------------------------------------------------


def target(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    options = dict(DEFAULT_OPTIONS, **start["options"])
    agent = _agent("bench-target", options["target_progress"], options["ucx_options"])
    buf = page_aligned_buffer(workload.buffer_nbytes)
    agent.register(buf)
    filler = runner.PatternFiller(buf, workload.seed)
    fills = []

    def fill(rep: int) -> None:
        fills.append(rep)
        filler.fill(rep)

    def close() -> None:
        if options["notify"]:
            got: list[bytes] = []

            def poll() -> list[bytes]:
                got.extend(n.payload for n in agent.get_notifications())
                return got

            runner.await_notifications(poll, [f"rep{r}".encode() for r in fills], NOTIFY_WAIT_S, "rdma-kv target")
        agent.close()

    chan.send({"type": "ready", "address": buf.ctypes.data, "nbytes": buf.nbytes}, agent.metadata())
    runner.serve_target(chan, fill, close)


def warm_up(agent: Any, local_prep: Any, remote_prep: Any, workload: Workload) -> list[Any]:
    """Untimed reads that wire up every worker's endpoint and pump: one
    slot (the own worker: a lone small read stays there), then, with lanes,
    one read striped over all of them (``lanes * lane_min_bytes``, or every
    slot if the workload has fewer bytes). A read of one slot alone left the
    lanes' first use inside the first timed rep. Returns the reads."""
    zero = np.zeros(1, dtype=np.int64)
    reads = [agent.read_prepared(local_prep, zero, remote_prep, zero)]
    reads[0].wait(60)
    cfg = agent.config
    if cfg.lanes > 1:
        n = min(workload.num_slots, -(-cfg.lanes * cfg.lane_min_bytes // workload.slot_nbytes))
        idx = np.arange(n, dtype=np.int64)
        reads.append(agent.read_prepared(local_prep, idx, remote_prep, idx))
        reads[-1].wait(60)
    return reads


def reader(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    options = dict(DEFAULT_OPTIONS, **start["options"])
    agent = _agent("bench-reader", options["progress"], options["ucx_options"], options["lanes"])
    notify = bool(options["notify"])
    peer, metadata = chan.expect("peer")
    remote = agent.add_peer(metadata)
    local = page_aligned_buffer(workload.buffer_nbytes)
    agent.register(local)
    t0 = time.perf_counter()
    local_prep = agent.prep_local(slot_descs(workload, local.ctypes.data))
    remote_prep = agent.prep_remote(remote, slot_descs(workload, int(peer["address"])))
    prep_list_s = time.perf_counter() - t0
    warm_up(agent, local_prep, remote_prep, workload)

    def run_rep(rep: int) -> dict[str, Any]:
        p = batch(workload, rep)
        local.fill(0)
        t0 = time.perf_counter()
        xfer = agent.read_prepared(local_prep, p.local_slots, remote_prep, p.remote_slots,
                                   notify=f"rep{rep}".encode() if notify else None)
        xfer.wait(120)
        t2 = time.perf_counter()
        if xfer.nbytes != p.nbytes:
            raise BenchError(f"rdma-kv moved {xfer.nbytes} bytes, the batch says {p.nbytes}")
        runner.verify(local, p, "rdma-kv reader")
        return dict(rep_times(t0, t2, xfer), ops=xfer.ops_posted, nbytes=p.nbytes, descriptors=p.descriptor_count)

    from rdma_kv.transport._lib import library_path, ucx_version

    chan.send({"type": "ready", "config": dict(options, lanes=agent.config.lanes, prep_lists_s=prep_list_s,
                                               ucx_version=ucx_version(), ucx_library=library_path() or "")})
    runner.serve_reader(chan, run_rep, agent.close)


# --- backend ----------------------------------------------------------------------------


def run_backend(workload: Workload, reps: int, **options: Any) -> Result:
    """rdma-kv READ of ``workload``'s plans, ``reps`` times."""
    records, config = runner.run_pair(__name__, workload, reps, dict(DEFAULT_OPTIONS, **options))
    return Result.from_records(NAME, workload, records, config=config.get("config", {}))
