"""Baseline: the kernel's own cross-process copy, batched ``process_vm_readv``.

This is what UCX's ``cma`` transport does underneath on one host, minus
UCX: the reader hands the kernel up to IOV_MAX (1024) descriptors per
syscall and the kernel copies straight from the target's pages. It bounds
what any one-sided read engine can reach between two processes here.

Owns the cma backend: ``target`` / ``reader`` child bodies for
``harness.run_pair`` and ``run_backend(workload, reps) -> Result``.
Imports numpy, ctypes, the stdlib and ``rdma_kv.bench`` siblings only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from typing import Any

import numpy as np

from rdma_kv.bench import harness
from rdma_kv.bench.harness import BenchError, Channel
from rdma_kv.bench.report import Result
from rdma_kv.bench.workloads import Workload, coalesce, plan

NAME = "cma"
IOV_MAX = 1024  # Linux UIO_MAXIOV: entries per iovec array per syscall
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

# struct iovec {void *iov_base; size_t iov_len;} as a numpy record: a plan's
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


# --- child bodies ------------------------------------------------------------------


def target(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    allow_ptrace_from_any()
    buf = page_aligned_buffer(workload.buffer_nbytes)
    filler = harness.PatternFiller(buf, workload.seed)
    chan.send({"type": "ready", "pid": os.getpid(), "address": buf.ctypes.data, "nbytes": buf.nbytes})
    harness.serve_target(chan, filler.fill, lambda: None)


def reader(chan: Channel, start: dict[str, Any]) -> None:
    workload = Workload.from_dict(start["workload"])
    merge = bool(start["options"].get("coalesce", True))
    peer, _ = chan.expect("peer")
    pid, remote_base = int(peer["pid"]), int(peer["address"])
    libc = _libc()
    local = page_aligned_buffer(workload.buffer_nbytes)
    local_base = local.ctypes.data
    chan.send({"type": "ready", "config": {"coalesce": merge, "iov_max": IOV_MAX}})

    def run_rep(rep: int) -> dict[str, Any]:
        p = plan(workload, rep)
        local.fill(0)  # nothing stale can pass verification; pages stay resident
        t0 = time.perf_counter()
        lo, ro, ln = (
            coalesce(p.local_offsets, p.remote_offsets, p.lengths)
            if merge
            else (p.local_offsets, p.remote_offsets, p.lengths)
        )
        liov, riov = build_iovecs(local_base, remote_base, lo, ro, ln)
        t1 = time.perf_counter()
        syscalls = read_batched(libc, pid, liov, riov)
        t2 = time.perf_counter()
        harness.verify(local, p, "cma reader")
        return {
            "seconds": t2 - t1,
            "prep_seconds": t1 - t0,
            "ops": int(ln.shape[0]),
            "nbytes": p.nbytes,
            "descriptors": p.descriptor_count,
            "syscalls": syscalls,
        }

    harness.serve_reader(chan, run_rep, lambda: None)


# --- backend ----------------------------------------------------------------------------


def run_backend(workload: Workload, reps: int, **options: Any) -> Result:
    """Batched process_vm_readv of ``workload``'s plans, ``reps`` times."""
    records, config = harness.run_pair(__name__, workload, reps, options)
    return Result.from_records(NAME, workload, records, config=config.get("config", {}))
