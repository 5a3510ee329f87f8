"""A caller blocked in ``wait()`` (``progress="thread"``) takes the agent's
own worker and does its work for the whole wait, while the own pump naps
instead of spinning on its hold (``rk_await``'s ``take_first``, csrc/pump.c).

On a host with few CPUs the pump's spin took a CPU from the caller doing
the work, or from a lane copying its part: one notified 2 MiB block as
shipped, other jobs running, spent up to ~360 us of the own pump's CPU per
read (docs/benchmarks.md, "The shipped blocking path").

The reads here cannot complete until the test lets them: their target
polls and is progressed only by the test (over TCP a get needs the
target's worker), so the waiter stays blocked for as long as the test
looks at it.
"""

from __future__ import annotations

import threading

import numpy as np

from rdma_kv.transport import XferState, stall
from rdma_kv.transport._lib import load
from transport_helpers import TCP, link, prepare_slots, wait_until

BLOCK = 4096
WAIT_S = 20.0


def pump_state(pump) -> tuple[int, int, int, int, int]:
    """(hold, busy, asleep, ran_ns, taken) of a pump."""
    ffi, lib = load()
    out = ffi.new("uint64_t[5]")
    lib.rk_pump_state(pump, out)
    return tuple(int(v) for v in out)  # type: ignore[return-value]


def blocked_read(make_agent, spin_s: float):
    """A TCP read by a pumped ``b`` (one worker) from a polling ``a`` that
    nobody progresses, and a thread blocked in its ``wait()``. Returns the
    pair, b's own pump, the read, the waiter and a function that posts the
    same read again."""
    pair = link(make_agent("a", progress="poll", ucx_options=TCP),
                make_agent("b", progress="thread", lanes=1, spin_s=spin_s, ucx_options=TCP))
    local, remote = prepare_slots(pair, BLOCK)
    idx = np.arange(8)

    def post():
        return pair.b.read_prepared(local, idx, remote, idx, timeout_s=WAIT_S)

    xfer = post()
    waiter = threading.Thread(target=xfer.wait, args=(WAIT_S,), daemon=True)
    waiter.start()
    return pair, pair.b._core.driver.pump.handle, xfer, waiter, post


def test_a_blocked_caller_takes_the_own_worker_and_the_pump_naps(make_agent):
    """``spin_s`` long: the caller keeps the worker while nothing comes (it
    would give it back after ``spin_s``: the next test), so the test sees
    it taken however late it gets a CPU; it spins only until the test lets
    the read complete."""
    pair, pump, xfer, waiter, again = blocked_read(make_agent, spin_s=WAIT_S)
    wait_until(lambda: pump_state(pump)[4] == 1, WAIT_S, "the blocked caller to take the own worker")
    hold, _, asleep, _, _ = pump_state(pump)
    assert hold >= 1 and not asleep, "a taken worker's pump is held and naps (not asleep on its fd)"
    ffi, _ = load()
    line = stall.describe(ffi.new("rk_batch_t *", {"pending": 2, "posted": 1, "top": 0, "nparts": 1})[0],
                          ffi.new("rk_pump_t *[]", [pump]), 0)
    assert "pump napping, its worker taken by 1 blocked caller(s)" in line, line

    wait_until(xfer.done, WAIT_S, "the read once its target is progressed", drive=[pair.a])
    waiter.join(WAIT_S)
    assert not waiter.is_alive() and xfer.state is XferState.DONE, xfer.error
    wait_until(lambda: pump_state(pump)[4] == 0 and pump_state(pump)[0] == 0, WAIT_S,
               "the worker given back to its pump")
    # The pump runs the own worker again: a read nobody waits for completes
    # through it (and the service thread), not through a caller.
    again = again()
    wait_until(again.done, WAIT_S, "a read nobody waits for", drive=[pair.a])
    assert again.state is XferState.DONE, again.error


def test_a_wait_left_with_nothing_to_do_gives_the_worker_back(make_agent):
    """A taken worker with nothing to progress for ``spin_s`` goes back to
    its pump, awake, before the caller sleeps on the slot: the pump then
    sleeps on the worker's event fd and answers what comes over the wire,
    where a caller asleep on the slot would not. (The target never
    progressed, so over TCP the fd keeps waking the pump for nothing and
    it soon dozes instead, asleep 2: it answers within a doze. Waiting for
    asleep 1 alone failed every run here once the pump dozed.)"""
    pair, pump, xfer, waiter, _ = blocked_read(make_agent, spin_s=0.001)
    wait_until(lambda: pair.b._core.inflight.ctx.awaiting == 1, WAIT_S, "the caller to block")
    # The target unanswered: the caller finds nothing to do and gives the worker back.
    wait_until(lambda: pump_state(pump)[4] == 0 and pump_state(pump)[2] in (1, 2), WAIT_S,
               "the pump asleep on its worker's fd (or dozing), the worker given back")
    assert waiter.is_alive() and not xfer.done()
    wait_until(xfer.done, WAIT_S, "the read once its target is progressed", drive=[pair.a])
    waiter.join(WAIT_S)
    assert xfer.state is XferState.DONE, xfer.error
