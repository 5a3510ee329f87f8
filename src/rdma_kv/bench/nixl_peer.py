"""Baseline: NIXL (``nixl-cu12==1.5.1``, UCX backend) on the identical batches.

NIXL is an optional bench dependency, never a library dependency: it is
imported only inside the two child processes, and a missing NIXL turns into
``BackendUnavailableError`` (the runner reports the backend as skipped).

Driven the way NIXL's authors drive a KV transfer (vLLM's NixlConnector):
each side's buffer registered once; on the reader, one *prepared*
descriptor list per side covering every (layer, region, pool block) slot,
made once outside the timed region; each repetition builds its request
from block-table indices with ``make_prepped_xfer`` (timed as *prep*),
posts it with ``transfer`` (timed as *post*) and polls
``check_xfer_state`` to completion (post-to-completion = *seconds*). With
``notify`` every request carries a ``notif_msg``, as NixlConnector's reads
do; the target checks at close that one arrived per repetition.
NIXL merges indices that are consecutive on both sides inside one
prepared run (``makeXferReq``); the operations it really posted come
from its transfer telemetry (``descCount``).

List modes: ``blocks`` (Nx3, one descriptor per slot, vLLM's layout) and
``strided`` (Nx5, NIXL >= 1.5 compressed list: one dense run per region,
which is what lets NIXL merge consecutive blocks).

Imports numpy, the stdlib and ``rdma_kv.bench`` siblings; ``nixl`` lazily.
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

NAME = "nixl"
DEFAULT_OPTIONS: dict[str, Any] = {
    "list_mode": "strided",  # "blocks" | "strided"
    "progress_thread": False,  # reader's: it polls check_xfer_state itself
    # The target only waits while the reader reads; NIXL's progress thread (the
    # Python API starts it with pthrDelay=0) would spin one of the host's cores
    # for the whole run, beside a reader that shares them, where rdma-kv's
    # target sleeps on its event fd. Without it the target progresses UCX
    # (wire-up, notifications) from its command loop: get_new_notifs every
    # millisecond while it waits, as the scale bench's NIXL targets do.
    "target_progress_thread": False,
    "telemetry": True,  # needed for descCount (ops NIXL really posted)
    "num_threads": 0,  # NIXL's own default; vLLM's NixlConnector passes 4
    "split_batch_size": 0,  # with num_threads: split requests from this many descriptors on; 0: NIXL's 1024
    "notify": False,  # a notif_msg on every transfer
}
NOTIFY_WAIT_S = 10.0  # at close, how long the target waits for the last notifications
_LIST_MODES = ("blocks", "strided")


def nixl_available() -> str | None:
    """None if NIXL imports here, else the reason it does not."""
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # ImportError, or a broken wheel (missing .so)
        return f"nixl is not importable ({type(exc).__name__}: {exc}); install it with " \
               f"`pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1`"
    return None


def _agent(name: str, options: dict[str, Any]) -> Any:
    import logging
    import os

    from nixl._api import nixl_agent, nixl_agent_config

    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL logs an INFO line per agent and backend; in a sweep of tens of
        # runs they bury the progress bar. NIXL_LOG_LEVEL still wins.
        logging.getLogger("nixl").setLevel(logging.WARNING)

    threads = int(options["num_threads"])
    split = int(options.get("split_batch_size") or 0) if threads > 0 else 0
    config = nixl_agent_config(
        enable_prog_thread=bool(options["progress_thread"]),
        enable_listen_thread=False,
        capture_telemetry=bool(options["telemetry"]),
        num_threads=threads,
        backends=[] if split else ["UCX"],
    )
    agent = nixl_agent(name, config)
    if split:
        # The UCX backend's thread pool splits a request over its num_threads
        # workers only from split_batch_size descriptors on (NIXL's default:
        # 1024); a backend parameter, so the backend is made here with it.
        agent.create_backend("UCX", {"num_threads": str(threads), "split_batch_size": str(split)})
    if "UCX" not in agent.backends:
        raise BenchError(f"NIXL agent {name!r} has no UCX backend (plugins: {agent.get_plugin_list()})")
    return agent


def _register(agent: Any, buf: np.ndarray) -> Any:
    return agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")


def prepared_list(workload: Workload, base: int, mode: str) -> np.ndarray:
    """Every slot of one side as a NIXL descriptor array (Nx3 or Nx5)."""
    size, slots = workload.slot_nbytes, workload.num_slots
    if mode == "blocks" or workload.kind == "contiguous":
        arr = np.zeros((slots, 3), dtype=np.uint64)
        arr[:, 0] = np.uint64(base) + np.arange(slots, dtype=np.uint64) * np.uint64(size)
        arr[:, 1] = size
        return arr
    # (address, len, dev, stride, count): one dense run of pool blocks per region.
    regions = workload.num_regions
    arr = np.zeros((regions, 5), dtype=np.uint64)
    arr[:, 0] = np.uint64(base) + np.arange(regions, dtype=np.uint64) * np.uint64(size * workload.pool_blocks)
    arr[:, 1] = size
    arr[:, 3] = size
    arr[:, 4] = workload.pool_blocks
    return arr


# --- child bodies ------------------------------------------------------------------


def target(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    options = dict(DEFAULT_OPTIONS, **start["options"])
    agent = _agent("bench-target", dict(options, progress_thread=options["target_progress_thread"]))
    buf = page_aligned_buffer(workload.buffer_nbytes)
    reg = _register(agent, buf)
    filler = runner.PatternFiller(buf, workload.seed)
    chan.send({"type": "ready", "address": buf.ctypes.data, "nbytes": buf.nbytes}, agent.get_agent_metadata())
    fills = []
    got: list[bytes] = []

    def fill(rep: int) -> None:
        fills.append(rep)
        filler.fill(rep)

    def poll() -> list[bytes]:
        for msgs in agent.get_new_notifs().values():  # also progresses the worker
            got.extend(bytes(m) for m in msgs)
        return got

    def close() -> None:
        if options["notify"]:
            runner.await_notifications(poll, [f"rep{r}".encode() for r in fills], NOTIFY_WAIT_S, "nixl target")
        agent.deregister_memory(reg)

    runner.serve_target(chan, fill, close, idle=None if options["target_progress_thread"] else poll)


def reader(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    options = dict(DEFAULT_OPTIONS, **start["options"])
    if options["list_mode"] not in _LIST_MODES:
        raise BenchError(f"nixl list_mode {options['list_mode']!r} is not one of {_LIST_MODES}")
    agent = _agent("bench-reader", options)
    peer, metadata = chan.expect("peer")
    remote_name = agent.add_remote_agent(metadata)
    local = page_aligned_buffer(workload.buffer_nbytes)
    reg = _register(agent, local)
    mode = options["list_mode"]
    t0 = time.perf_counter()
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", prepared_list(workload, local.ctypes.data, mode), "DRAM")
    remote_h = agent.prep_xfer_dlist(remote_name, prepared_list(workload, int(peer["address"]), mode), "DRAM")
    prep_dlist_s = time.perf_counter() - t0
    agent.make_connection(remote_name)
    _warm_up(agent, local_h, remote_h)

    notify = bool(options["notify"])

    def run_rep(rep: int) -> dict[str, Any]:
        p = batch(workload, rep)
        local.fill(0)
        msg = f"rep{rep}".encode() if notify else b""
        t0 = time.perf_counter()
        handle = agent.make_prepped_xfer("READ", local_h, p.local_slots, remote_h, p.remote_slots, notif_msg=msg)
        t1 = time.perf_counter()
        state = agent.transfer(handle)
        t2 = time.perf_counter()
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        t3 = time.perf_counter()
        if state != "DONE":
            raise BenchError(f"NIXL READ of {workload.name} rep {rep} ended in state {state!r}")
        record: dict[str, Any] = {
            "seconds": t3 - t1,
            "prep_seconds": t1 - t0,
            "post_seconds": t2 - t1,
            "nbytes": p.nbytes,
            "descriptors": p.descriptor_count,
        }
        if options["telemetry"]:
            tel = agent.get_xfer_telemetry(handle)
            record["ops"] = int(tel.descCount)
            record["nixl_post_us"] = float(tel.postDuration)
            record["nixl_xfer_us"] = float(tel.xferDuration)
        else:
            record["ops"] = p.descriptor_count  # unknown without telemetry: report the request size
        handle.release()
        runner.verify(local, p, "nixl reader")
        return record

    def close() -> None:
        local_h.release()
        remote_h.release()
        agent.deregister_memory(reg)
        agent.remove_remote_agent(remote_name)

    chan.send({"type": "ready", "config": dict(options, prep_xfer_dlist_s=prep_dlist_s, nixl_version=_version(),
                                               **_loaded_ucx())})
    runner.serve_reader(chan, run_rep, close)


def _warm_up(agent: Any, local_h: Any, remote_h: Any) -> None:
    """One small READ so endpoint wire-up and rkey unpacking are not timed."""
    idx = np.zeros(1, dtype=np.int32)
    handle = agent.make_prepped_xfer("READ", local_h, idx, remote_h, idx)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    handle.release()
    if state != "DONE":
        raise BenchError(f"NIXL warm-up READ ended in state {state!r}")


def _loaded_ucx() -> dict[str, str]:
    """The UCX this process's NIXL runs on (NIXL's wheel bundles its own, not
    the libucx rdma-kv loads): ``ucx_version`` and ``ucx_library``, as the
    rdma-kv reader reports its own; empty strings where they cannot be read."""
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            path = next(line.split()[-1] for line in fh if "/libucp" in line and ".so" in line)
        fn = ctypes.CDLL(path).ucp_get_version_string  # loaded already: the same handle
        fn.restype = ctypes.c_char_p
        return {"ucx_version": fn().decode(), "ucx_library": path}
    except (OSError, StopIteration, AttributeError):
        return {"ucx_version": "", "ucx_library": ""}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl-cu12")
    except PackageNotFoundError:
        return "unknown"


# --- backend ----------------------------------------------------------------------------


def run_backend(workload: Workload, reps: int, **options: Any) -> Result:
    """NIXL READ of ``workload``'s plans, ``reps`` times (skipped if NIXL is absent)."""
    reason = nixl_available()
    if reason:
        return Result.skipped(NAME, workload.name, reason)
    records, config = runner.run_pair(__name__, workload, reps, dict(DEFAULT_OPTIONS, **options))
    return Result.from_records(NAME, workload, records, config=config.get("config", {}))
