"""Every C pump makes the creator's CUDA context current before it
progresses its worker. No GPU: a stub libcuda (csrc/stub_libcuda.c, built
here) is preloaded into a child process; it keeps a context per thread and
interposes ucp_worker_progress to record whether one was current."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from transport_helpers import shared_library

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(180)]

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def stub_libcuda(tmp_path_factory) -> pathlib.Path:
    return shared_library(HERE / "csrc" / "stub_libcuda.c", tmp_path_factory.mktemp("stub-cuda") / "libcuda.so.1",
                          "-pthread", "-Wl,-soname,libcuda.so.1", "-ldl")


def run_child(stub: pathlib.Path, *args: str, **env_extra: str) -> dict:
    env = dict(os.environ, LD_PRELOAD=str(stub),
               UCX_MODULES="^cu*", **env_extra)  # UCX's own CUDA modules must not bind to the stub
    proc = subprocess.run([sys.executable, str(HERE / "cuda_context_child.py"), *args], capture_output=True,
                          text=True, timeout=150, env=env)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_progress_thread_makes_the_creators_context_current_before_it_progresses(stub_libcuda):
    report = run_child(stub_libcuda)
    threads = report["threads"]
    pumps = [t for t in threads if t["name"] == "rdma-kv-pump"]
    progressed = [t for t in threads if t["progress"]]
    # Four pumps (a's own worker, its two lanes, b's own worker), each of
    # which progressed and set the main thread's context exactly once.
    assert len(pumps) == report["pumps"] == 4, threads
    for t in pumps:
        assert t["progress"] > 0 and t["sets"] == 1 and t["ctx_set"] == report["ctx"], t
    # The service thread too, which progressed a's workers while every pump was held.
    service = [t for t in progressed if t["name"] != "rdma-kv-pump" and t["tid"] != report["main"]]
    assert service and all(t["sets"] == 1 and t["ctx_set"] == report["ctx"] for t in service), threads
    bare = [t for t in progressed if t["progress_bare"]]
    assert not bare, f"threads progressed a worker with no current CUDA context: {bare}"


def test_a_callers_thread_progresses_with_the_creators_context_and_gets_its_own_back(stub_libcuda):
    report = run_child(stub_libcuda, "callers")
    for caller in report["callers"]:
        mine = [t for t in report["threads"] if t["tid"] == caller["tid"]]
        # It progressed a worker (helped a held pump, drove its polling
        # agent, closed endpoints), each time with the creator's context
        # pushed over its own, and its own is current again after.
        assert mine and mine[0]["progress"] > 0 and mine[0]["pushes"] > 0, (caller, mine)
        assert caller["after"] == caller["before"], caller
    for t in report["threads"]:
        assert t["progress_bare"] == 0 and t["progress_other"] == 0, \
            f"a thread progressed a worker without the creator's CUDA context current: {t}"


def test_a_pump_that_cannot_set_the_context_fails_the_agent_with_the_curesult(stub_libcuda):
    report = run_child(stub_libcuda, "fail", STUB_CU_SET_FAIL="1")
    assert "cannot make the creator's CUDA context 0x5eed0000 current" in report["error"]
    assert "CUresult 201" in report["error"]
    pump = [t for t in report["threads"] if t["name"] == "rdma-kv-pump"]
    assert pump and all(t["progress"] == 0 for t in pump), pump  # it never progressed


def test_a_pump_stuck_in_progress_is_reported_and_the_close_goes_on(stub_libcuda):
    report = run_child(stub_libcuda, "stuck")
    assert report["stalled"] == report["pumps"] == 2, report
    # Each pump's join gave up after its bound (1 s here) with an error naming
    # it; before, the close joined the stuck threads for ever.
    assert report["close_s"] < 30.0, report
    stuck = [e for e in report["errors"] if "did not stop within 1 s" in e]
    assert len(stuck) == 2 and any("'a.lane1'" in e for e in stuck), report["errors"]
    assert any("closed with 2 progress thread(s) stuck" in e for e in report["errors"]), report["errors"]
    # Nothing the stuck threads were inside was progressed (with UCX: waits
    # for the lock they hold), destroyed or cleaned up under them, so once
    # released they return and end, and the process exits as usual.
    assert report["touched"] == 0, report
    assert report["left"] == [], report
