"""Baseline: the kernel's own cross-process copy, batched ``process_vm_readv``.

This is what UCX's ``cma`` transport does underneath on one host, minus
UCX: the reader hands the kernel up to IOV_MAX (1024) descriptors per
syscall and the kernel copies straight from the target's pages. It bounds
what any one-sided read engine can reach between two processes here.

With ``threads=N`` (the ``cma-tN`` rows of ``rdma-kv bench --lanes N``) the
batch is cut into N slices of about equal bytes (runs of iovec pairs, or
page-aligned pieces of each pair when there are fewer pairs than threads),
read by N threads at once (ctypes drops the GIL for the syscall). The time
reported is the longest *single thread's* syscall span, as if all started
together: no wake-up or hand-off is counted, so it is the kernel's own
limit for N readers, a bound no N-worker engine can beat.

Owns the cma backend: ``target`` / ``reader`` child bodies for
``runner.run_pair`` and ``run_backend(workload, reps) -> Result``.
Imports numpy, ctypes, the stdlib and ``rdma_kv.bench`` siblings only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from typing import Any

import numpy as np

from rdma_kv.bench import runner
from rdma_kv.bench.runner import BenchError, Channel
from rdma_kv.bench.report import Result
from rdma_kv.bench.workloads import Workload, coalesce, batch

NAME = "cma"
IOV_MAX = 1024  # Linux UIO_MAXIOV: entries per iovec array per syscall
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

# struct iovec {void *iov_base; size_t iov_len;} as a numpy record: a batch's
# descriptors become iovec arrays with two vectorised adds, no Python loop.
IOVEC = np.dtype([("base", np.uint64), ("len", np.uint64)])


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong,
    ]
    return libc


def allow_ptrace_from_any() -> None:
    """Let a sibling read us under Yama ptrace_scope=1 (no-op without Yama)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)  # EINVAL without Yama: fine


def page_aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, pre-faulted, page-aligned uint8 buffer (pages touched now,
    so no first-touch fault lands inside a timed region)."""
    page = os.sysconf("SC_PAGE_SIZE")
    raw = np.zeros(nbytes + page, dtype=np.uint8)
    start = (-raw.ctypes.data) % page
    buf = raw[start : start + nbytes]
    buf.fill(0)
    return buf


def build_iovecs(
    local_base: int, remote_base: int, local_offsets: np.ndarray, remote_offsets: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    local = np.empty(lengths.shape[0], dtype=IOVEC)
    remote = np.empty(lengths.shape[0], dtype=IOVEC)
    local["base"] = local_offsets + np.uint64(local_base)
    remote["base"] = remote_offsets + np.uint64(remote_base)
    local["len"] = lengths
    remote["len"] = lengths
    return local, remote


def read_batched(libc: ctypes.CDLL, pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """Copy every (remote -> local) iovec pair, IOV_MAX per syscall; return syscalls made."""
    n = local.shape[0]
    lp, rp = local.ctypes.data, remote.ctypes.data
    total = np.add.reduceat(local["len"], np.arange(0, n, IOV_MAX)).tolist()
    syscalls = 0
    for k, start in enumerate(range(0, n, IOV_MAX)):
        count = min(IOV_MAX, n - start)
        off = start * IOVEC.itemsize
        got = libc.process_vm_readv(pid, lp + off, count, rp + off, count, 0)
        syscalls += 1
        if got != total[k]:
            err = ctypes.get_errno()
            # A short count means a fault part way (bad remote range): no retry.
            raise BenchError(
                f"process_vm_readv(pid={pid}, {count} iovecs from #{start}) returned {got}, "
                f"expected {total[k]} bytes: {os.strerror(err) if got < 0 else 'short read'}"
            )
    return syscalls


PAGE = 4096


def split_iovecs(local: np.ndarray, remote: np.ndarray, parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``parts`` (local, remote) iovec slices of about equal bytes: runs of
    pairs, or with fewer pairs than parts each pair cut at page boundaries.
    Empty slices are dropped."""
    n = local.shape[0]
    if n >= parts:
        ends = np.cumsum(local["len"], dtype=np.uint64)
        total = int(ends[-1])
        splits = {int(np.searchsorted(ends, total * k // parts, side="right")) for k in range(1, parts)}
        bounds = sorted({0, n} | splits)
        return [(local[a:b], remote[a:b]) for a, b in zip(bounds, bounds[1:])]
    pieces: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = [([], []) for _ in range(parts)]
    for lv, rv in zip(local.tolist(), remote.tolist()):
        size = int(lv[1])
        cuts = sorted({0, size} | {size * k // parts // PAGE * PAGE for k in range(1, parts)})
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            pieces[k][0].append((lv[0] + a, b - a))
            pieces[k][1].append((rv[0] + a, b - a))
    return [(np.array(lp, dtype=IOVEC), np.array(rp, dtype=IOVEC)) for lp, rp in pieces if lp]


class ThreadedReads:
    """``threads`` readers started once; each ``read`` hands every one a
    slice and returns (syscalls, longest single-thread span in seconds)."""

    def __init__(self, libc: ctypes.CDLL, pid: int, threads: int) -> None:
        self._libc, self._pid, self._n = libc, pid, threads
        self._start = threading.Barrier(threads)
        self._end = threading.Barrier(threads)
        self._work: list[tuple[np.ndarray, np.ndarray]] = []
        self._out: list[tuple[int, float, BaseException | None]] = [(0, 0.0, None)] * threads
        self._stop = False
        self._helpers = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(1, threads)]
        for t in self._helpers:
            t.start()

    def _one(self, k: int) -> None:
        syscalls, span, err = 0, 0.0, None
        if k < len(self._work):
            try:
                t0 = time.perf_counter()
                syscalls = read_batched(self._libc, self._pid, *self._work[k])
                span = time.perf_counter() - t0
            except BaseException as exc:  # re-raised by read() in the caller's thread
                err = exc
        self._out[k] = (syscalls, span, err)

    def _loop(self, k: int) -> None:
        while True:
            self._start.wait()
            if self._stop:
                return
            self._one(k)
            self._end.wait()

    def read(self, local: np.ndarray, remote: np.ndarray) -> tuple[int, float]:
        self._work = split_iovecs(local, remote, self._n)
        self._start.wait(30)
        self._one(0)
        self._end.wait(30)
        for _, _, err in self._out:
            if err is not None:
                raise err
        return sum(o[0] for o in self._out), max(o[1] for o in self._out)

    def close(self) -> None:
        self._stop = True
        self._start.wait(30)
        for t in self._helpers:
            t.join(5)


# --- child bodies ------------------------------------------------------------------


def target(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    allow_ptrace_from_any()
    buf = page_aligned_buffer(workload.buffer_nbytes)
    filler = runner.PatternFiller(buf, workload.seed)
    chan.send({"type": "ready", "pid": os.getpid(), "address": buf.ctypes.data, "nbytes": buf.nbytes})
    runner.serve_target(chan, filler.fill, lambda: None)


def reader(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    merge = bool(start["options"].get("coalesce", True))
    threads = int(start["options"].get("threads", 1))
    peer, _ = chan.expect("peer")
    pid, remote_base = int(peer["pid"]), int(peer["address"])
    libc = _libc()
    local = page_aligned_buffer(workload.buffer_nbytes)
    local_base = local.ctypes.data
    pool = ThreadedReads(libc, pid, threads) if threads > 1 else None
    chan.send({"type": "ready", "config": {"coalesce": merge, "iov_max": IOV_MAX, "threads": threads}})

    def run_rep(rep: int) -> dict[str, Any]:
        p = batch(workload, rep)
        local.fill(0)  # nothing stale can pass verification; pages stay resident
        t0 = time.perf_counter()
        lo, ro, ln = (
            coalesce(p.local_offsets, p.remote_offsets, p.lengths)
            if merge
            else (p.local_offsets, p.remote_offsets, p.lengths)
        )
        liov, riov = build_iovecs(local_base, remote_base, lo, ro, ln)
        t1 = time.perf_counter()
        if pool is None:
            syscalls = read_batched(libc, pid, liov, riov)
            seconds = time.perf_counter() - t1
        else:
            syscalls, seconds = pool.read(liov, riov)
        runner.verify(local, p, "cma reader")
        return {
            "seconds": seconds,
            "prep_seconds": t1 - t0,
            "ops": int(ln.shape[0]),
            "nbytes": p.nbytes,
            "descriptors": p.descriptor_count,
            "syscalls": syscalls,
        }

    runner.serve_reader(chan, run_rep, pool.close if pool is not None else lambda: None)


# --- backend ----------------------------------------------------------------------------


def run_backend(workload: Workload, reps: int, **options: Any) -> Result:
    """Batched process_vm_readv of ``workload``'s plans, ``reps`` times."""
    records, config = runner.run_pair(__name__, workload, reps, options)
    return Result.from_records(NAME, workload, records, config=config.get("config", {}))
