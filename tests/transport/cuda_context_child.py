"""Child of test_cuda_context.py, run with the stub libcuda preloaded: makes
a context current on the main thread (as torch does when it initialises
CUDA), runs two agents with pumps (one with lanes) through a striped read,
and prints the stub's per-thread records as JSON on its last line. With
``fail`` (and STUB_CU_SET_FAIL set), reports the agent's refusal to start.
With ``callers``, threads of the caller's own, one with no context and one
with another context current, wait on a pumped agent whose pumps are held
(so they help), drive a polling agent, and close both agents; it reports
each caller's thread and its context before and after. With ``stuck``,
every pump of an agent connected to a peer blocks inside
ucp_worker_progress (the stub stalls it) and the agent is closed: it
reports how long the close took, what it logged, whether anything used
the stuck workers, and whether the pumps' threads end once released."""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from rdma_kv.errors import TransferError
from rdma_kv.transport import Agent, AgentConfig, DescList
from rdma_kv.transport._lib import load

CTX = 0x5EED0000
OTHER = 0x0DDC0000  # a caller thread's own context (another device's, say)
NBYTES = 8 << 20


def records(cuda: ctypes.CDLL) -> list[dict]:
    out = []
    for i in range(cuda.stub_threads()):
        tid, name, ctx = ctypes.c_long(), ctypes.create_string_buffer(16), ctypes.c_uint64()
        counts = (ctypes.c_uint64 * 5)()
        assert cuda.stub_thread(i, ctypes.byref(tid), name, ctypes.byref(ctx), counts) == 0
        out.append({"tid": tid.value, "name": name.value.decode(), "ctx_set": ctx.value,
                    "sets": counts[0], "progress": counts[1], "progress_bare": counts[2],
                    "progress_other": counts[3], "pushes": counts[4]})
    return out


def main() -> None:
    cuda = ctypes.CDLL("libcuda.so.1")  # the preloaded stub
    cuda.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    assert cuda.cuCtxSetCurrent(CTX) == 0
    if sys.argv[1:] == ["fail"]:  # the stub fails every later cuCtxSetCurrent
        try:
            Agent("a", AgentConfig(ucx_options={"NET_DEVICES": "lo"})).close()
        except TransferError as exc:
            print(json.dumps({"error": str(exc), "threads": records(cuda)}))
            return
        raise SystemExit("the agent started although its pump could not set the CUDA context")
    options = {"NET_DEVICES": "lo"}
    src = np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)
    dst = np.zeros(NBYTES, dtype=np.uint8)
    with Agent("a", AgentConfig(ucx_options=options, lanes=3, lane_min_bytes=1 << 20)) as a, \
            Agent("b", AgentConfig(ucx_options=options, lanes=1)) as b:
        a.register(dst)
        b.register(src)
        a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        offsets = np.arange(0, NBYTES, 1 << 20)
        xfer = a.read("b", DescList.from_regions(dst.ctypes.data, offsets, 1 << 20),
                      DescList.from_regions(src.ctypes.data, offsets, 1 << 20), timeout_s=30.0)
        xfer.wait(timeout_s=30.0)
        assert np.array_equal(src, dst)
        pumps = 1 + len(a._core.lanes) + 1
        # Every one of a's pumps held off its worker, nobody in wait(): a's
        # service thread, a Python thread, progresses the workers itself.
        lib = load()[1]
        held = [a._core.driver.pump.handle] + [lane.pump.handle for lane in a._core.lanes]
        for pump in held:
            lib.rk_pump_hold(pump, 1)
        try:
            dst[:] = 0
            done = threading.Event()
            xfer = a.read("b", DescList.from_regions(dst.ctypes.data, offsets, 1 << 20),
                          DescList.from_regions(src.ctypes.data, offsets, 1 << 20), timeout_s=30.0)
            xfer.add_done_callback(lambda _: done.set())
            assert done.wait(60.0), "the read with every pump held did not complete"
            assert np.array_equal(src, dst)
        finally:
            for pump in held:
                lib.rk_pump_hold(pump, -1)
    print(json.dumps({"ctx": CTX, "pumps": pumps, "main": threading.get_native_id(), "threads": records(cuda)}))


def current(cuda: ctypes.CDLL) -> int:
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return int(ctx.value or 0)


def on_thread(cuda: ctypes.CDLL, role: str, ctx: int, fn: Callable[[], object]) -> dict:
    """Run ``fn`` on a new thread with ``ctx`` current (0: none); its tid and
    its current context before and after."""
    out: dict = {"role": role}

    def run() -> None:
        try:
            if ctx:
                assert cuda.cuCtxSetCurrent(ctx) == 0
            out["tid"], out["before"] = threading.get_native_id(), current(cuda)
            fn()
            out["after"] = current(cuda)
        except BaseException as exc:  # reported, not lost with the thread
            out["error"] = repr(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120.0)
    assert not thread.is_alive(), f"{role}: did not return within 120 s"
    assert "error" not in out, f"{role}: {out['error']}"
    return out


def progressed(cuda: ctypes.CDLL, tid: int) -> int:
    return sum(t["progress"] for t in records(cuda) if t["tid"] == tid)


def callers(cuda: ctypes.CDLL) -> None:
    options = {"NET_DEVICES": "lo"}
    lib = load()[1]
    src = np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)
    dst = np.zeros(NBYTES, dtype=np.uint8)
    offsets = np.arange(0, NBYTES, 1 << 20)
    threads = []
    spares: list[Agent] = []
    a = Agent("a", AgentConfig(ucx_options=options, lanes=3, lane_min_bytes=1 << 20))
    p = Agent("p", AgentConfig(ucx_options=options, progress="poll", lanes=2, lane_min_bytes=1 << 20))
    b = Agent("b", AgentConfig(ucx_options=options, lanes=1))
    try:
        b.register(src)
        for reader in (a, p):
            reader.register(dst)
            reader.add_peer(b.metadata())
            b.add_peer(reader.metadata())

        def read(reader: Agent) -> None:
            dst[:] = 0
            reader.read("b", DescList.from_regions(dst.ctypes.data, offsets, 1 << 20),
                        DescList.from_regions(src.ctypes.data, offsets, 1 << 20), timeout_s=60.0).wait(60.0)
            assert np.array_equal(src, dst)

        read(a)
        # a's pumps held: a caller blocked in wait() progresses their workers
        # itself (the service thread too, once they are 20 ms stale: a caller
        # that comes later than that may find its read done, so try again).
        held = [a._core.driver.pump.handle] + [lane.pump.handle for lane in a._core.lanes]
        for pump in held:
            lib.rk_pump_hold(pump, 1)
        try:
            for role, ctx in (("waits, no context", 0), ("waits, another context", OTHER)):
                for _ in range(20):
                    out = on_thread(cuda, role, ctx, lambda: read(a))
                    if progressed(cuda, out["tid"]):
                        break
                threads.append(out)
        finally:
            for pump in held:
                lib.rk_pump_hold(pump, -1)
        threads.append(on_thread(cuda, "polls, no context", 0, lambda: read(p)))

        def close_busy(reader: Agent) -> None:
            """Close with a read in flight. Without one, a close may progress
            nothing: UCX completes a flushing endpoint close in place when
            nothing is outstanding on it, and a polling agent with nothing in
            flight has nothing else to progress. A polling agent's read stays
            in flight until a caller settles it (nobody but this caller does),
            so its close drains it: it progresses its worker, always."""
            reader.read("b", DescList.from_regions(dst.ctypes.data, offsets, 1 << 20),
                        DescList.from_regions(src.ctypes.data, offsets, 1 << 20), timeout_s=60.0)
            reader.close()

        # A pumped agent's read may be settled by its service thread before
        # the close begins (and its endpoints then close in place): try again
        # with a fresh agent, as the waits above do.
        closer = a
        for tries in range(1, 21):
            if tries > 1:
                closer = Agent(f"a{tries}", AgentConfig(ucx_options=options, lanes=3, lane_min_bytes=1 << 20))
                spares.append(closer)
                closer.register(dst)
                closer.add_peer(b.metadata())
                read(closer)  # every endpoint wired up, as a's
            out = on_thread(cuda, "closes, no context", 0, lambda: close_busy(closer))
            if progressed(cuda, out["tid"]):
                break
        out["tries"] = tries
        threads.append(out)
        threads.append(on_thread(cuda, "closes, another context", OTHER, lambda: close_busy(p)))
    finally:
        for agent in (a, p, *spares, b):
            agent.close()
    print(json.dumps({"ctx": CTX, "callers": threads, "threads": records(cuda)}))


def stuck(cuda: ctypes.CDLL) -> None:
    from rdma_kv.transport import pump

    pump.PUMP_STOP_S = 1.0
    errors: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    logging.getLogger("rdma_kv").addHandler(Keep())
    options = {"NET_DEVICES": "lo"}
    src = np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)
    dst = np.zeros(NBYTES, dtype=np.uint8)
    offsets = np.arange(0, NBYTES, 1 << 20)
    # b has no pump (nothing of it stalls): a thread drives it.
    b = Agent("b", AgentConfig(ucx_options=options, progress="poll", lanes=1))
    a = Agent("a", AgentConfig(ucx_options=options, lanes=2, lane_min_bytes=1 << 20))
    driving = threading.Event()

    def drive() -> None:
        while not driving.is_set():
            b.progress()
            time.sleep(0.0005)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    b.register(src)
    a.register(dst)
    a.add_peer(b.metadata())
    # One striped read: a's endpoints to b on its own worker and both lanes.
    a.read("b", DescList.from_regions(dst.ctypes.data, offsets, 1 << 20),
           DescList.from_regions(src.ctypes.data, offsets, 1 << 20), timeout_s=60.0).wait(60.0)
    assert np.array_equal(src, dst)
    workers = [a._core.worker] + [lane.worker for lane in a._core.lanes]
    cuda.stub_stall(1)
    end = time.monotonic() + 60.0
    while cuda.stub_stalled() < len(workers) and time.monotonic() < end:
        for worker in workers:  # wake each pump into its next progress call
            worker.signal()
        time.sleep(0.01)
    stalled = cuda.stub_stalled()
    start = time.monotonic()
    a.close()
    close_s = time.monotonic() - start
    touched = cuda.stub_touched()
    # Released, the stuck threads leave progress on workers that still exist,
    # see their stop flag and end; the process then exits as usual.
    cuda.stub_stall(0)
    end = time.monotonic() + 60.0
    while any(t.name.startswith("rdma-kv-pump-a") for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.01)
    left = [t.name for t in threading.enumerate() if t.name.startswith("rdma-kv-pump-a")]
    driving.set()
    driver.join(10.0)
    b.close()
    print(json.dumps({"pumps": len(workers), "stalled": stalled, "close_s": close_s, "touched": touched,
                      "left": left, "errors": errors}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["stuck"]:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        assert cuda.cuCtxSetCurrent(CTX) == 0
        stuck(cuda)
    elif sys.argv[1:] == ["callers"]:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        assert cuda.cuCtxSetCurrent(CTX) == 0
        callers(cuda)
    else:
        main()
