"""Four defects of the transport's Python layer, found by an adversarial
review; each test fails on the code before its fix.

- ``deregister()`` counted live transfers only: a transfer the agent failed
  while UCX still held it (its peer stopped answering, the endpoint left
  open because a flush of it was outstanding) could still write into the
  region after it was unmapped and freed.
- A post settled whatever the pumps had published and ran those callbacks
  under the agent's lock: a callback that closed the agent stalled 5 s,
  then left it wedged.
- One exception in the service thread's settling round ended the thread
  for good while the agent stayed open: nothing settled a pumped agent's
  completions any more.
- A driver whose service thread failed to start left its pump progressing
  the worker the agent then destroyed (a segfault)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from rdma_kv.errors import RegistrationError, TransferError
from rdma_kv.transport import agentcore
from transport_helpers import HUNG_WAIT_S, hung_peer, link, wait_until

NBYTES = 1 << 16

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]


def pair(make_agent, **b_config):
    """``link``'s pair ("a", "b": one lane each, b with ``b_config``) and the
    descriptors of b reading a's whole buffer into its own."""
    p = link(make_agent("a", lanes=1), make_agent("b", lanes=1, **b_config), NBYTES)
    whole = np.zeros(1, dtype=np.uint64)
    return p.a, p.b, p.buf_a, p.buf_b, p.desc_b(whole, NBYTES), p.desc_a(whole, NBYTES)


def test_deregister_is_refused_while_a_failed_read_may_still_land(make_agent):
    # The target stops progressing (a peer that hangs): a read and a flush pass their deadline.
    target, reader, region, stuck = hung_peer(make_agent)
    assert reader.inflight == 0 and reader._core.inflight.zombies > 0
    assert all(x.abandoned for x in stuck), "failed while UCX holds them: they say they may still land"
    with pytest.raises(RegistrationError, match="may still write into local memory"):
        reader.deregister(region)
    end = time.monotonic() + 2
    while time.monotonic() < end:  # the target answers late: the read lands in a region still registered
        target.progress()
        time.sleep(0.001)
    assert region in reader.regions


def test_a_callback_run_after_a_post_may_close_the_agent(make_agent):
    a, b, src, dst, loc, rem = pair(make_agent, settle_delay_s=1.0)
    first = b.read("a", loc, rem)
    first.add_done_callback(lambda t: b.close())
    # The pumps complete it; no one settles it for settle_delay_s. Waited for
    # (the shim's done stamp), not slept: a loaded host's pumps may take more
    # than any fixed sleep, and then the next read had nothing to settle.
    inflight = b._core.inflight  # (holds the slots' memory while looked at)
    slot = inflight._slots[first._slot]
    wait_until(lambda: b.closed or slot.done_ns != 0, HUNG_WAIT_S, "the first read's completion")
    t0 = time.monotonic()
    try:
        b.read("a", loc, rem)  # settles the first on its way: its callback closes the agent
    except Exception:
        pass
    took = time.monotonic() - t0
    assert b.closed and b._core not in agentcore.WEDGED, f"closed from a callback in {took:.1f} s, wedged"
    assert took < 4.0  # not the 5 s close bound it waited out under the lock


def test_the_service_thread_keeps_settling_after_a_failed_round(make_agent, caplog):
    a, b, src, dst, loc, rem = pair(make_agent)
    core = b._core
    real = core.driver._service
    failed = []

    def once():
        core.driver._service = real
        failed.append(1)
        raise RuntimeError("injected: one failure of the settling round")

    core.driver._service = once
    end = time.monotonic() + 30
    # The failure is appended before it is raised and logged on the service thread:
    # wait for the log line itself (waiting on ``failed`` raced the log on a loaded host).
    while "settling failed" not in caplog.text and time.monotonic() < end:
        time.sleep(0.01)
    assert failed and "settling failed" in caplog.text
    b.add_peer(a.metadata())  # whatever the round failed, the agent is open and usable

    async def load() -> None:
        await asyncio.wait_for(b.read("a", loc, rem), 10)  # resolved by the service thread's settle

    asyncio.run(load())
    assert (dst == src).all()


def test_a_service_thread_that_cannot_start_leaves_no_pump_on_the_destroyed_worker():
    script = textwrap.dedent("""
        import threading, time
        from rdma_kv.transport import Agent, AgentConfig

        real_start = threading.Thread.start

        def failing_start(self):
            if self.name.startswith("rdma-kv-progress-"):
                raise RuntimeError("can't start new thread")
            return real_start(self)

        threading.Thread.start = failing_start
        try:
            Agent("x", AgentConfig(progress="thread", lanes=1, ucx_options={"NET_DEVICES": "lo"}))
        except RuntimeError as exc:
            print("raised:", exc)
        threading.Thread.start = real_start
        time.sleep(0.5)
        print("pumps alive:", [t.name for t in threading.enumerate() if t.name.startswith("rdma-kv-pump")])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])  # -11 before
    assert "raised: can't start new thread" in proc.stdout and "pumps alive: []" in proc.stdout


def test_a_settle_that_fails_mid_drain_leaves_every_transfer_settled_and_the_counts_right(make_agent):
    """The service thread's settling raises while three completions are
    drained together (found by a review of the fix above): ``rk_drain`` had
    freed their slots in C, the one being settled was lost (in flight for
    ever) and the rest, still in the table, were abandoned a second time:
    the counters wrapped to 2**64 - 2 and deregister was refused for good."""
    a, b, src, dst, loc, rem = pair(make_agent)
    region = b.regions[0]
    inflight = b._core.inflight
    real, hits = inflight._settle, []

    def settle_once(xfer, error, now, finished=None):
        hits.append(1)
        if len(hits) == 1:
            raise RuntimeError("injected: a bug while settling one completion")
        return real(xfer, error, now, finished)

    inflight._settle = settle_once
    xs = [b.read("a", loc, rem) for _ in range(3)]
    for xfer in xs:
        try:
            xfer.wait(10)
        except TransferError:
            pass
    assert [x.state.name for x in xs].count("IN_PROGRESS") == 0
    assert sum(x.error is not None for x in xs) == 1  # the one whose settle raised: failed, saying why
    assert inflight.live == 0 and inflight.zombies == 0 and b.inflight == 0
    inflight._settle = real
    b.deregister(region)
