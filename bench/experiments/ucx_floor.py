"""The floor under issue 29's "call -> posted <= 30 us cold": what UCX
itself and one Python -> C call cost with the CPU caches cold.

Same request as ``fixed_cost.py`` (64 random 32 KiB slots, one 2 MiB
block; the target a child process with a progress thread; the reader
polling, one worker (`lanes=1`), so that every operation goes on the one endpoint),
each rep with the caches swept (1 GiB overwritten) or not (``--modes``).
Per rep, in turns:

- ``ucx``: a C loop of 64 bare ``ucp_get_nbx`` calls on the same endpoint,
  remote key and slot tables as rdma-kv's route (no checks, no batch
  record, no merging; a request pointer kept per operation), timed in C
  from its first call to its last return: the cost of posting the request
  that no library on UCX can go under.
- ``crossing``: one Python call of an empty cffi function (the clock
  read), timed from Python: the cost of entering C from Python at all.
- ``rdma-kv``: ``read_prepared`` as shipped, from the shim's own clock
  reads: ``build`` (call -> first operation) and ``post`` (the post loop),
  and ``call`` (call -> returned).

Reaches into the reader's route (``remote.route``): an experiment.

    .venv/bin/python bench/experiments/ucx_floor.py [--reps 100] [--modes cold,warm] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cffi import FFI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixed_cost import DESCS, SLOT_BYTES, SLOTS, _addrs, _rdmakv_target, _target  # noqa: E402

from rdma_kv.bench.cma import page_aligned_buffer  # noqa: E402
from rdma_kv.transport import Agent, AgentConfig, DescList  # noqa: E402

CDEF = """
uint64_t floor_now(void);
uint64_t floor_gets(const void *route, uint64_t n, const int64_t *li, const int64_t *ri, void **reqs, int memh);
int floor_wait(const void *route, void **reqs, uint64_t n, uint64_t max_rounds);
"""

SOURCE = r"""
#include <time.h>
#include <ucp/api/ucp.h>
#include "shim.h"

uint64_t floor_now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* n bare gets on worker 0 of the route, every pair at the route's uniform length. */
uint64_t floor_gets(const void *route, uint64_t n, const int64_t *li, const int64_t *ri, void **reqs, int memh)
{
    const rk_route_t *r = (const rk_route_t *)route;
    ucp_request_param_t p;
    uint64_t t0, i;
    uint32_t reg;

    t0 = floor_now();
    p.op_attr_mask = UCP_OP_ATTR_FLAG_MULTI_SEND;
    if (memh && r->memhs != NULL) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    }
    for (i = 0; i < n; ++i) {
        reg = r->remote.reg != NULL ? r->remote.reg[ri[i]] : 0;
        if (memh && r->memhs != NULL) {
            p.memh = r->memhs[r->local.reg != NULL ? r->local.reg[li[i]] : 0];
        }
        reqs[i] = ucp_get_nbx(r->eps[0], (void *)(uintptr_t)r->local.addr[li[i]], r->uniform,
                              r->remote.addr[ri[i]], r->rkeys[0][reg], &p);
    }
    return floor_now() - t0;
}

/* Progress until every request completed; 0 if all did, else -1. */
int floor_wait(const void *route, void **reqs, uint64_t n, uint64_t max_rounds)
{
    const rk_route_t *r = (const rk_route_t *)route;
    uint64_t i, round;
    int bad = 0;

    for (i = 0; i < n; ++i) {
        if (reqs[i] == NULL) {
            continue;
        }
        if (UCS_PTR_IS_ERR(reqs[i])) {
            bad = 1;
            continue;
        }
        for (round = 0; ucp_request_check_status(reqs[i]) == UCS_INPROGRESS && round < max_rounds; ++round) {
            ucp_worker_progress(r->workers[0]);
        }
        bad |= ucp_request_check_status(reqs[i]) != UCS_OK;
        ucp_request_free(reqs[i]);
    }
    return bad ? -1 : 0;
}
"""


def build() -> Any:
    """Compile the floor's C (against the same UCX headers as the shim) and load it."""
    from rdma_kv.transport import _build
    from rdma_kv.transport._lib import load

    load()  # libucx's loader brings in libucp first (the soname the module links)
    include_dir, lib_dir = _build.ucx_prefix()
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source("_ucx_floor", SOURCE, include_dirs=[str(_build.CSRC)], library_dirs=[lib_dir],
                   libraries=["ucp", "uct", "ucs"], extra_compile_args=["-isystem", include_dir, "-O2"])
    tmp = tempfile.mkdtemp(prefix="ucx-floor-")
    path = ffi.compile(tmpdir=tmp)
    sys.path.insert(0, tmp)
    import importlib

    module = importlib.import_module("_ucx_floor")
    assert Path(path).exists()
    return module


def run(reps: int, cold: bool) -> dict[str, list[float]]:
    mod = build()
    ffi, lib = mod.ffi, mod.lib
    rows: dict[str, list[float]] = {k: [] for k in ("ucx", "ucx+memh", "crossing", "enter", "build", "post", "call")}
    with _target(_rdmakv_target) as parent:
        md, addr = parent.recv()
        with Agent("floor-reader", AgentConfig(progress="poll", lanes=1)) as reader:
            dst = page_aligned_buffer(SLOTS * SLOT_BYTES)
            reader.register(dst)
            peer = reader.add_peer(md)
            local = reader.prep_local(DescList(_addrs(dst.ctypes.data), SLOT_BYTES))
            remote = reader.prep_remote(peer, DescList(_addrs(addr), SLOT_BYTES))
            one = np.zeros(1, dtype=np.int64)
            reader.read_prepared(local, one, remote, one).wait(10)  # wire-up, and the route
            route = remote.route.c
            out = reader._core.inflight.out
            reqs = ffi.new("void *[]", DESCS)
            sweep = np.zeros(1 << 30, dtype=np.uint8) if cold else None
            rng = np.random.default_rng(0)
            for rep in range(reps):
                li = rng.choice(SLOTS, DESCS, replace=False).astype(np.int64)
                ri = rng.choice(SLOTS, DESCS, replace=False).astype(np.int64)
                lp, rp = ffi.from_buffer("int64_t[]", li), ffi.from_buffer("int64_t[]", ri)
                order = ["ucx", "ucx+memh", "rdma-kv"]
                for first in order[rep % 3:] + order[:rep % 3]:
                    if sweep is not None:
                        sweep.fill(rep & 0xFF)
                    if first.startswith("ucx"):
                        rows[first].append(lib.floor_gets(route, DESCS, lp, rp, reqs, first == "ucx+memh") / 1e3)
                        if lib.floor_wait(route, reqs, DESCS, 10_000_000) != 0:
                            raise SystemExit("a bare get failed")
                    else:
                        t0 = time.perf_counter_ns()
                        xfer = reader.read_prepared(local, li, remote, ri)
                        t1 = time.perf_counter_ns()
                        xfer.wait(10)
                        rows["enter"].append((int(out[5]) - t0) / 1e3)
                        rows["build"].append((int(out[6]) - t0) / 1e3)
                        rows["post"].append((int(out[7]) - int(out[6])) / 1e3)
                        rows["call"].append((t1 - t0) / 1e3)
                if sweep is not None:
                    sweep.fill(rep & 0xFF)
                t0 = time.perf_counter_ns()
                lib.floor_now()
                rows["crossing"].append((time.perf_counter_ns() - t0) / 1e3)
            parent.send("stop")
            parent.recv()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--modes", default="cold,warm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {}
    keys = ("ucx", "ucx+memh", "crossing", "enter", "build", "post", "call")
    print(f"{'caches':8}" + "".join(f"{k:>15}" for k in keys) + f"   (us, median / p90 of {args.reps})")
    for mode in args.modes.split(","):
        rows = run(args.reps, mode == "cold")
        summary = {k: (statistics.median(v), float(np.percentile(v, 90))) for k, v in rows.items()}
        result[mode] = summary
        print(f"{mode:8}" + "".join(f"{summary[k][0]:.1f}/{summary[k][1]:.1f}".rjust(15) for k in keys), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"reps": args.reps, "descs": DESCS, "slot_bytes": SLOT_BYTES,
                                               "medians_p90_us": result}, indent=1))


if __name__ == "__main__":
    main()
