"""Rate-limited load-failure warnings and the idle side-channel client pool."""

from __future__ import annotations

import logging

import pytest

from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.lograte import RateLimitedWarnings


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_flood_from_one_producer_is_cut_to_a_burst_and_a_count(caplog, clock):
    log = logging.getLogger("test.lograte")
    limited = RateLimitedWarnings(log, "KV load failures", burst=3, window_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.lograte"):
        for i in range(100):
            limited.warn("P1", "request %r: failed", f"r{i}")
            clock.t += 0.01
        limited.warn("P2", "request %r: failed", "other")  # another producer has its own budget
        assert warnings_of(caplog) == ["request 'r0': failed", "request 'r1': failed", "request 'r2': failed",
                                       "request 'other': failed"]
        limited.flush()  # the window has not ended: nothing yet
        assert len(warnings_of(caplog)) == 4
        clock.t += 10.0
        limited.flush()
        assert warnings_of(caplog)[4:] == [
            "P1: 97 more KV load failures in the last 10 s not logged (at most 3 per 10 s)"]
        limited.flush()  # reported once
        limited.warn("P1", "request %r: failed", "late")  # a new window: logged again
        assert warnings_of(caplog)[-1] == "request 'late': failed" and len(warnings_of(caplog)) == 6


def test_a_window_without_suppressed_lines_ends_silently(caplog, clock):
    log = logging.getLogger("test.lograte2")
    limited = RateLimitedWarnings(log, "x", burst=2, window_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.lograte2"):
        limited.warn("P", "one")
        clock.t += 5
        limited.flush()
    assert warnings_of(caplog) == ["one"]


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="burst must be >= 1"):
        RateLimitedWarnings(logging.getLogger("x"), "x", burst=0)


class FakeClient:
    def __init__(self, host, port):
        self.address, self.closed = (host, port), False

    def close(self):
        self.closed = True


def test_clients_are_reused_and_closed_only_when_idle_and_unreferenced(clock):
    made = []
    pool = ClientPool(lambda h, p: made.append(FakeClient(h, p)) or made[-1], idle_s=120.0, clock=clock)
    a = pool.get("10.0.0.1", 5000)
    assert pool.get("10.0.0.1", 5000) is a and len(made) == 1
    b = pool.get("10.0.0.2", 5000)
    clock.t += 60
    pool.get("10.0.0.2", 5000)  # used again: its idle time restarts
    asked = []
    assert pool.prune(lambda: asked.append(1) or set()) == 0 and not asked  # nothing idle: nobody asked
    clock.t += 61  # a: idle 121 s, b: idle 61 s
    assert pool.prune(lambda: {("10.0.0.1", 5000)}) == 0  # a is idle but a peer still refers to it
    assert not a.closed
    assert pool.prune(lambda: set()) == 1
    assert a.closed and not b.closed and len(pool) == 1
    assert pool.get("10.0.0.1", 5000) is not a  # redialled with a fresh client
    pool.close()
    assert b.closed and len(pool) == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.get("10.0.0.3", 1)


def test_a_job_that_raises_on_an_rpc_thread_is_logged(caplog):
    """A job's exception would stay in a future nobody reads: its loads would
    wait for their deadline with nothing said. The pool logs it, and the
    thread goes on to the next job."""
    pool = ClientPool(lambda host, port: None)  # type: ignore[arg-type,return-value]
    ran = []

    def confirm_batch() -> None:
        raise KeyError("lost track of a load")

    try:
        with caplog.at_level(logging.ERROR, logger="rdma_kv.connector.rdma.consumer.clients"):
            assert pool.submit(confirm_batch)
            assert pool.submit(ran.append, "next")
            pool._calls.executor.shutdown(wait=True)
    finally:
        pool.close()
    assert ran == ["next"]
    [record] = [r for r in caplog.records if "RPC thread" in r.getMessage()]
    assert "confirm_batch" in record.getMessage() and record.exc_info[1].args == ("lost track of a load",)
