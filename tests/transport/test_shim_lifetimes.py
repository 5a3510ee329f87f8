"""What the shim may still reach after Python let go of it.

A close that gives up waiting for a caller blocked in the shim must not
free what that caller can still reach. A caller of ``wait()`` checks that
the agent is open, counts itself blocked, then enters ``rk_await``, where
it helps the pumps; descheduled in between (seconds, on a loaded host),
it outlived the close's wait for blocked callers, the close freed every
pump, and the caller then claimed a freed pump (found with an
instrumented shim that poisons freed pumps: a use after free, then a
segfault). Now such a close keeps the pumps and leaves the agent as a
wedged one, said in the log."""

from __future__ import annotations

import contextlib
import gc
import logging
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from rdma_kv.errors import TransferError
from rdma_kv.transport import Agent, AgentConfig, DescList
from rdma_kv.transport import agentcore
from rdma_kv.transport import progress
from transport_helpers import LOOPBACK, pumps_held, wait_until


class _Recording:
    """A pump's shim, recording each ``rk_pump_free`` and how many callers
    were blocked in the agent at that moment."""

    def __init__(self, lib, driver, frees):
        self._lib, self._driver, self._frees = lib, driver, frees

    def __getattr__(self, name):
        attr = getattr(self._lib, name)
        if name != "rk_pump_free":
            return attr

        def free(handle):
            self._frees.append(self._driver._blocked)
            return attr(handle)
        return free


def test_a_caller_descheduled_on_its_way_into_the_shim_keeps_the_pumps_alive(make_agent, monkeypatch, caplog):
    monkeypatch.setattr(progress, "CLOSE_BLOCKED_WAIT_S", 0.2)
    target = make_agent("target")
    # Not from make_agent, whose teardown finds a wedged agent's regions and peers left in place (as they must be).
    reader = Agent("reader", AgentConfig(ucx_options=dict(LOOPBACK), lanes=2))
    nbytes = 64 << 20
    theirs = np.ones(nbytes, dtype=np.uint8)
    mine = np.zeros(nbytes, dtype=np.uint8)
    target.register(theirs)
    reader.register(mine)
    peer = reader.add_peer(target.metadata())
    core = reader._core
    driver = core.driver
    frees: list[int] = []
    pumps = [driver.pump] + [lane.pump for lane in core.lanes._lanes]
    assert all(p is not None for p in pumps) and len(pumps) == 2
    for pump in pumps:
        pump._lib = _Recording(pump._lib, driver, frees)
    # The waiter is held between counting itself blocked and entering
    # rk_await (where it binds the CUDA context: nothing without CUDA).
    release = threading.Event()
    bound = driver.bound

    def slow_bound():
        if threading.current_thread().name == "waiter":
            release.wait(10.0)
        return bound() if threading.current_thread().name != "waiter" else contextlib.nullcontext()

    monkeypatch.setattr(driver, "bound", slow_bound)
    outcome: list[object] = []

    def wait(xfer):
        try:
            xfer.wait(timeout_s=20)
            outcome.append("done")
        except Exception as exc:  # noqa: BLE001 -- what the waiter saw is asserted below
            outcome.append(exc)

    with pumps_held(reader):  # the read cannot complete before the waiter blocks on it
        xfer = reader.read(peer, DescList([mine.ctypes.data], nbytes), DescList([theirs.ctypes.data], nbytes))
        waiter = threading.Thread(target=wait, args=(xfer,), name="waiter")
        waiter.start()
        deadline = time.monotonic() + 10
        while driver._blocked == 0 and waiter.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert driver._blocked == 1, "the waiter never blocked"
    with caplog.at_level(logging.ERROR, logger="rdma_kv"):
        reader.close()  # gives up on the waiter after 0.2 s
    release.set()  # the waiter goes on into rk_await, with the agent closed
    waiter.join(10.0)
    assert not waiter.is_alive()
    assert frees == [], f"pumps freed while a caller was still on its way into the shim (blocked: {frees})"
    assert core in agentcore.WEDGED and reader.wedged()  # (the worker refuses a sleep then)
    assert "1 blocked caller(s) and no service thread still in the shim after their bounds" in caplog.text
    assert "closed with 1 thread(s) still in the shim past the close's bounds" in caplog.text
    assert len(outcome) == 1  # it returned (done or closed): it did not hang or crash


def test_an_abandoned_transfer_keeps_its_peer_until_ucx_hands_the_slot_back(make_agent):
    """A transfer settled before UCX completed it (its deadline passed)
    leaves its batch record to UCX (a zombie slot); the completion that
    comes later reads the peer's endpoint state, to send the notification
    or to see that it must not. That state is the peer's: removed and
    collected meanwhile, the late completion read freed memory. The zombie
    now keeps the peer alive until the slot is handed back."""
    target, reader = make_agent("target"), make_agent("reader", lanes=2)
    nbytes = 4 << 20
    theirs, mine = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    target.register(theirs)
    reader.register(mine)
    name = reader.add_peer(target.metadata())
    core = reader._core
    with pumps_held(reader):  # nothing progresses the read: it stays with UCX
        xfer = reader.read(name, DescList([mine.ctypes.data], nbytes), DescList([theirs.ctypes.data], nbytes),
                           notify=b"late")
        peer = weakref.ref(core.peers.usable(name))
        with core.lock:
            core.inflight.abandon(xfer, TransferError("abandoned by the test"))  # as an expiry does
        del xfer
        reader.remove_peer(name)  # nothing in flight with it any more: closed and dropped now
        gc.collect()
        assert peer() is not None, "the peer was collected while UCX still held a transfer that reads its state"
    wait_until(lambda: not core.inflight.zombies, 10.0, "the zombie handed back")
    gc.collect()
    assert peer() is None  # and let go once UCX is done with the slot


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["thread", "poll"])
def test_peers_failed_again_and_again_with_flushes_in_flight(mode):
    """UCX 1.22 parks an endpoint flush that cannot start on every lane on
    the worker's progress queue, keyed by the request; a forced close
    neither completes it nor removes it, and frees the endpoint, so the
    next progress call read the freed endpoint (SIGSEGV in
    ucp_ep_flush_progress, from ucp_ep_flush_resume_slow_path_callback).
    A close now waits for the endpoint's flushes first. This stress crashed
    in 14 of 48 runs of 8 s before (seeds 1-12, both modes, a loaded
    host) and in none of 96 after; here two seeds of 4 s each mode."""
    child = Path(__file__).with_name("forced_close_child.py")
    for seed in (1, 4):
        proc = subprocess.run([sys.executable, str(child), str(seed), mode, "4"], capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])


def test_a_batch_has_room_for_a_flush_of_every_endpoint():
    """A transfer posts at most one flush per endpoint: two per worker (the
    express one too), on the agent's own worker and each lane's."""
    from rdma_kv.transport._lib import load
    from rdma_kv.transport.lanes import MAX_LANES

    ffi, _ = load()
    assert len(ffi.new("rk_batch_t *").flushes) >= 2 * (MAX_LANES + 1)
