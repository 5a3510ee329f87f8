"""Child bodies of the scale curves (:mod:`rdma_kv.bench.scale`): targets
(producers) and the one reader (consumer), for rdma-kv, NIXL and the
kernel's two-thread copy limit (``cma-t2``).

A target registers a pool of ``pool_blocks`` blocks, fills it with its own
pattern (seed ``seed + index``) per rep and sends its address and agent
metadata. The reader registers ``local_blocks`` blocks, adds every target
as a peer with one prepared list per side (made once, untimed, then one
small warm-up read per peer), and per rep posts one read per request of
the requests, then waits for all; it returns the span (first post to last
completion) and each request's latency from the first post.

Imports numpy, the stdlib and ``rdma_kv.bench`` siblings; the transport
and NIXL only inside these functions (the child processes).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from rdma_kv.bench import runner, scale
from rdma_kv.bench.cma import page_aligned_buffer
from rdma_kv.bench.runner import BenchError, Channel

WAIT_S = 120.0  # one rep's reads
TARGET_PROGRESS_S = 0.001  # a NIXL target progresses its worker this often while idle
CMA_THREADS = 2  # cma-t2: the kernel's copy on two threads, as two lanes copy here


def _requests(start: dict[str, Any], msg: dict[str, Any]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    return scale.draw_requests(start["seed"], int(msg["rep"]), int(msg["producers"]), int(msg["concurrency"]),
                               int(msg["blocks"]), start["pool_blocks"])


def _serve(chan: Channel, start: dict[str, Any], local: np.ndarray, run: Any, close: Any, who: str) -> None:
    """Reader loop: ``run(requests) -> (t_first_post, [completion times])`` per rep."""
    while True:
        msg, _ = chan.recv()
        if msg["type"] == "rep":
            requests = _requests(start, msg)
            local[: len(requests) * int(msg["blocks"]) * start["block_nbytes"]].fill(0)
            t0, done = run(requests)
            scale.verify(local, requests, start["seed"], int(msg["rep"]), start["block_nbytes"], who)
            nbytes = sum(len(ids) for _, ids, _ in requests) * start["block_nbytes"]
            chan.send({"type": "rep_result", "rep": msg["rep"], "nbytes": nbytes, "span_s": max(done) - t0,
                       "latencies_s": [t - t0 for t in done]})
        elif msg["type"] == "close":
            close()
            chan.send({"type": "closed"})
            return
        else:
            raise BenchError(f"{who}: unexpected message {msg['type']!r}")


# --- rdma-kv ---------------------------------------------------------------------------------


def _descs(base: int, count: int, size: int) -> Any:
    from rdma_kv.transport import DescList

    return DescList.slots(base, count, size)


def rdmakv_target(chan: Channel, start: dict[str, Any]) -> None:
    from rdma_kv.transport import Agent, AgentConfig

    agent = Agent(f"scale-target-{start['index']}", AgentConfig(progress="thread"))
    buf = page_aligned_buffer(start["pool_blocks"] * start["block_nbytes"])
    agent.register(buf)
    filler = runner.PatternFiller(buf, start["seed"] + start["index"])
    chan.send({"type": "ready", "address": buf.ctypes.data}, agent.metadata())
    runner.serve_target(chan, filler.fill, agent.close)


def rdmakv_reader(chan: Channel, start: dict[str, Any]) -> None:
    from rdma_kv.transport import Agent, AgentConfig

    size = start["block_nbytes"]
    agent = Agent("scale-reader", AgentConfig(progress=start.get("reader_progress", "poll")))
    local = page_aligned_buffer(start["local_blocks"] * size)
    agent.register(local)
    local_prep = agent.prep_local(_descs(local.ctypes.data, start["local_blocks"], size))
    remotes = []
    zero = np.zeros(1, dtype=np.int64)
    for _ in range(start["targets"]):
        msg, blob = chan.expect("peer")
        if blob is None:
            raise BenchError("rdma-kv reader: a target sent no agent metadata")
        name = agent.add_peer(blob)
        prep = agent.prep_remote(name, _descs(int(msg["address"]), start["pool_blocks"], size))
        agent.read_prepared(local_prep, zero, prep, zero).wait(60)  # wire-up, untimed
        remotes.append(prep)

    def run(requests: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        xfers = [agent.read_prepared(local_prep, local_ids, remotes[p], remote_ids, timeout_s=WAIT_S)
                 for p, local_ids, remote_ids in requests]
        for x in xfers:
            x.wait(WAIT_S)
        return t0, [x.settled if x.settled is not None else time.perf_counter() for x in xfers]

    chan.send({"type": "ready"})
    _serve(chan, start, local, run, agent.close, "rdma-kv reader")


# --- the kernel's copy on two threads -----------------------------------------------------


def cma_target(chan: Channel, start: dict[str, Any]) -> None:
    from rdma_kv.bench.cma import allow_ptrace_from_any

    allow_ptrace_from_any()
    buf = page_aligned_buffer(start["pool_blocks"] * start["block_nbytes"])
    filler = runner.PatternFiller(buf, start["seed"] + start["index"])
    chan.send({"type": "ready", "address": buf.ctypes.data, "pid": os.getpid()})
    runner.serve_target(chan, filler.fill, lambda: None)


def cma_reader(chan: Channel, start: dict[str, Any]) -> None:
    """Every block of every request of a point, as batched
    ``process_vm_readv`` (1,024 iovecs a call) from each producer, cut into
    ``CMA_THREADS`` shares of about equal bytes read at once; the span is
    the longest share's syscalls alone (no hand-off counted), every
    request's latency that span: the bound for any two-worker engine."""
    from rdma_kv.bench.cma import _libc, build_iovecs, read_batched

    size = start["block_nbytes"]
    local = page_aligned_buffer(start["local_blocks"] * size)
    peers: list[tuple[int, int]] = []
    for _ in range(start["targets"]):
        msg, _ = chan.expect("peer")
        peers.append((int(msg["pid"]), int(msg["address"])))
    libc = _libc()

    def run(plan: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[float, list[float]]:
        # Each request's blocks are one share's at a time, whole: shares alternate by request.
        shares: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[] for _ in range(CMA_THREADS)]
        for i, (p, local_ids, remote_ids) in enumerate(plan):
            pid, base = peers[p]
            lengths = np.full(len(local_ids), size, dtype=np.uint64)
            liov, riov = build_iovecs(local.ctypes.data, base, local_ids.astype(np.uint64) * np.uint64(size),
                                      remote_ids.astype(np.uint64) * np.uint64(size), lengths)
            shares[i % CMA_THREADS].append((pid, liov, riov))
        spans = [0.0] * CMA_THREADS

        def read(k: int) -> None:
            t0 = time.perf_counter()
            for pid, liov, riov in _batched(shares[k]):
                read_batched(libc, pid, liov, riov)
            spans[k] = time.perf_counter() - t0

        threads = [threading.Thread(target=read, args=(k,)) for k in range(1, CMA_THREADS)]
        for t in threads:
            t.start()
        read(0)
        for t in threads:
            t.join(WAIT_S)
        span = max(spans)
        return 0.0, [span] * len(plan)

    chan.send({"type": "ready"})
    _serve(chan, start, local, run, lambda: None, "cma reader")


def _batched(share: list[tuple[int, np.ndarray, np.ndarray]]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """One share's iovecs joined per producer (fewer, fuller syscalls)."""
    by_pid: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for pid, liov, riov in share:
        by_pid.setdefault(pid, []).append((liov, riov))
    return [(pid, np.concatenate([lv for lv, _ in pairs]), np.concatenate([rv for _, rv in pairs]))
            for pid, pairs in by_pid.items()]


# --- NIXL ------------------------------------------------------------------------------------


def _nixl_agent(name: str, progress_thread: bool) -> Any:
    from rdma_kv.bench.nixl_peer import DEFAULT_OPTIONS, _agent

    return _agent(name, dict(DEFAULT_OPTIONS, progress_thread=progress_thread, telemetry=False))


def _nixl_list(base: int, count: int, size: int) -> np.ndarray:
    arr = np.zeros((count, 3), dtype=np.uint64)
    arr[:, 0] = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(size)
    arr[:, 1] = size
    return arr


def nixl_target(chan: Channel, start: dict[str, Any]) -> None:
    # No progress thread: it spins a core (rdma_kv.bench.scale says why).
    # The target still needs progress for wire-up, so its command loop
    # progresses the worker (get_new_notifs does) between messages.
    agent = _nixl_agent(f"scale-target-{start['index']}", False)
    buf = page_aligned_buffer(start["pool_blocks"] * start["block_nbytes"])
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    filler = runner.PatternFiller(buf, start["seed"] + start["index"])
    chan.send({"type": "ready", "address": buf.ctypes.data}, agent.get_agent_metadata())
    while True:
        if not chan.poll(TARGET_PROGRESS_S):
            agent.get_new_notifs()
            continue
        msg, _ = chan.recv()
        if msg["type"] == "fill":
            filler.fill(int(msg["rep"]))
            chan.send({"type": "filled", "rep": msg["rep"]})
        elif msg["type"] == "close":
            agent.deregister_memory(reg)
            chan.send({"type": "closed"})
            return
        else:
            raise BenchError(f"nixl target: unexpected message {msg['type']!r}")


def nixl_reader(chan: Channel, start: dict[str, Any]) -> None:
    from rdma_kv.bench.nixl_peer import _warm_up

    size = start["block_nbytes"]
    agent = _nixl_agent("scale-reader", False)
    local = page_aligned_buffer(start["local_blocks"] * size)
    reg = agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _nixl_list(local.ctypes.data, start["local_blocks"], size),
                                    "DRAM")
    remotes, names = [], []
    for _ in range(start["targets"]):
        msg, blob = chan.expect("peer")
        name = agent.add_remote_agent(blob)
        handle = agent.prep_xfer_dlist(name, _nixl_list(int(msg["address"]), start["pool_blocks"], size), "DRAM")
        agent.make_connection(name)
        _warm_up(agent, local_h, handle)
        remotes.append(handle)
        names.append(name)

    def run(requests: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        handles = []
        for p, local_ids, remote_ids in requests:
            h = agent.make_prepped_xfer("READ", local_h, local_ids, remotes[p], remote_ids)
            handles.append((h, agent.transfer(h)))
        done: list[float | None] = [None] * len(handles)
        for i, (_, state) in enumerate(handles):
            if state == "DONE":
                done[i] = time.perf_counter()
            elif state != "PROC":
                raise BenchError(f"NIXL READ {i} ended in state {state!r}")
        end = time.monotonic() + WAIT_S
        while any(d is None for d in done):
            if time.monotonic() > end:
                raise BenchError(f"NIXL: {sum(d is None for d in done)} reads not done after {WAIT_S} s")
            for i, (h, _) in enumerate(handles):
                if done[i] is None:
                    state = agent.check_xfer_state(h)
                    if state == "DONE":
                        done[i] = time.perf_counter()
                    elif state != "PROC":
                        raise BenchError(f"NIXL READ {i} ended in state {state!r}")
        for h, _ in handles:
            h.release()
        return t0, [float(d) for d in done if d is not None]

    def close() -> None:
        local_h.release()
        for handle, name in zip(remotes, names):
            handle.release()
            agent.remove_remote_agent(name)
        agent.deregister_memory(reg)

    chan.send({"type": "ready"})
    _serve(chan, start, local, run, close, "nixl reader")
