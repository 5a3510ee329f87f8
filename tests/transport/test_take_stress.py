"""Stress of the take protocol (csrc/pump.c: ``rk_pump_take`` / ``give`` /
``nap``): callers blocked in ``wait()`` on one ``progress="thread"`` agent
take its own worker, several at once, while its pump naps.

What must hold however the threads interleave on a loaded 2-CPU host:
every transfer completes bit-exact, every completion callback runs exactly
once, every notification arrives exactly once, callback-only users are not
left behind by takers, transfers that fail (their deadline, the peer's
death, the close) while the worker is taken fail and release it, a close
from another thread returns within its bound while callers hold the
worker, the worker goes back to its pump (taken 0, hold 0) afterwards,
callers blocked on a read nobody answers leave the CPUs idle, and a pump
and another thread are never inside one worker's ucp_worker_progress at
once (a probe preloaded into a child). Bounds only, no timed assertion.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from rdma_kv.errors import ClosedError, TransferError
from rdma_kv.transport import DescList, XferState
from rdma_kv.transport._lib import load
from transport_child import Child
from transport_helpers import TCP, collect_notifications, link, pattern, prepare_slots, shared_library, wait_until

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(300)]

HERE = pathlib.Path(__file__).resolve().parent

WAIT_S = 60.0
BLOCK = 4096
THREADS = 4
ROUNDS = 20


def pump_state(pump) -> tuple[int, ...]:
    """(hold, busy, asleep, ran_ns, taken) of a pump."""
    ffi, lib = load()
    out = ffi.new("uint64_t[5]")
    lib.rk_pump_state(pump, out)
    return tuple(int(v) for v in out)


def given_back(agent) -> None:
    """Every pump of ``agent`` is neither taken nor held once its callers left."""
    for pump in agent._core.driver._pumps:
        wait_until(lambda p=pump: pump_state(p)[4] == 0 and pump_state(p)[0] == 0, WAIT_S,
                   "every worker given back to its pump")


def test_many_takers_with_callbacks_notifications_lanes_and_a_callback_only_user(make_agent):
    """THREADS callers wait() on reads and notified writes of one striping
    agent at once (taken up to THREADS), while a callback-only user posts
    and waits on its callbacks only, and the target collects the
    notifications: every byte, callback and notification exactly as posted."""
    pair = link(make_agent("a", ucx_options=TCP, lanes=1),
                make_agent("b", ucx_options=TCP, lanes=3, lane_min_bytes=2 * BLOCK, spin_s=0.002))
    local, remote = prepare_slots(pair, BLOCK)
    nslots = pair.buf_a.nbytes // BLOCK
    # a's slots [0, half) are read by b; b writes its slots [half, n) to a's.
    half = nslots // 2
    pair.buf_b[half * BLOCK:] = np.random.default_rng(7).integers(0, 256, (nslots - half) * BLOCK, dtype=np.uint8)
    per = half // (THREADS + 1)  # each user its own slots of both halves
    calls: dict[tuple[int, int], int] = {}
    calls_lock = threading.Lock()
    failures: list[BaseException] = []
    notes: list[bytes] = []
    written: set[int] = set()

    def counted(key: tuple[int, int]) -> None:
        with calls_lock:
            calls[key] = calls.get(key, 0) + 1

    def user(t: int, waits: bool) -> None:
        rng = np.random.default_rng(100 + t)
        mine = np.arange(t * per, (t + 1) * per)
        try:
            for r in range(ROUNDS):
                n = int(rng.integers(1, per + 1))
                dst = rng.permutation(mine)[:n]
                if rng.integers(0, 2):
                    src = rng.choice(half, n, replace=False)
                    xfer = pair.b.read_prepared(local, dst, remote, src, timeout_s=WAIT_S)
                    check = (dst, src, "read")
                else:
                    note = f"t{t}r{r}".encode()
                    with calls_lock:
                        notes.append(note)
                        written.update(int(i) for i in dst + half)
                    xfer = pair.b.write_prepared(local, dst + half, remote, dst + half, notify=note,
                                                 timeout_s=WAIT_S)
                    check = (dst + half, dst + half, "write")
                done = threading.Event()
                xfer.add_done_callback(lambda _, key=(t, r), done=done: (counted(key), done.set()))
                if waits:
                    xfer.wait(WAIT_S)
                assert done.wait(WAIT_S), f"user {t}: callback of round {r} never ran"
                assert xfer.state is XferState.DONE, xfer.error
                b_off, a_off, op = check
                for i, j in zip(b_off, a_off):
                    if op == "read":
                        assert np.array_equal(pair.buf_b[i * BLOCK:(i + 1) * BLOCK],
                                              pair.buf_a[j * BLOCK:(j + 1) * BLOCK]), f"user {t}: read bytes differ"
        except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=user, args=(t, t < THREADS), daemon=True) for t in range(THREADS + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert not any(thread.is_alive() for thread in threads), "a user hung"
    assert not failures, failures[0]
    assert len(calls) == (THREADS + 1) * ROUNDS and set(calls.values()) == {1}, "a callback ran twice or never"
    # Every notified write completed before its notification; a sentinel after all of them.
    done = pair.b.write_prepared(local, [0], remote, [0], notify=b"sentinel").wait(WAIT_S)
    assert done.state is XferState.DONE
    collect_notifications(pair.a, notes, b"sentinel", WAIT_S)
    assert written, "no write was posted"
    for i in written:
        assert np.array_equal(pair.buf_a[i * BLOCK:(i + 1) * BLOCK], pair.buf_b[i * BLOCK:(i + 1) * BLOCK]), \
            "written bytes differ"
    given_back(pair.b)


def waiting(xfers: list) -> tuple[list[threading.Thread], dict[int, BaseException | None]]:
    """A started thread per transfer, blocked in its ``wait()``, and what
    each wait raised (by index; None once it returned)."""
    raised: dict[int, BaseException | None] = {}

    def waiter(i: int) -> None:
        try:
            xfers[i].wait(WAIT_S)
            raised[i] = None
        except BaseException as exc:  # noqa: BLE001 -- looked at by the test
            raised[i] = exc

    threads = [threading.Thread(target=waiter, args=(i,), daemon=True) for i in range(len(xfers))]
    for thread in threads:
        thread.start()
    return threads, raised


def blocked_readers(make_agent, n: int, timeout_s: float = WAIT_S, **config):
    """``n`` threads of a pumped ``b`` (spin_s long: a caller keeps the
    worker while it waits) blocked on TCP reads from a polling ``a`` that
    nobody progresses, all of them holding b's worker taken. Returns the
    pair, the reads, the threads and what each wait raised (by index)."""
    pair = link(make_agent("a", progress="poll", ucx_options=TCP, lanes=1),
                make_agent("b", progress="thread", lanes=1, spin_s=WAIT_S, ucx_options=TCP, **config))
    local, remote = prepare_slots(pair, BLOCK)
    pump = pair.b._core.driver.pump.handle
    xfers = [pair.b.read_prepared(local, np.arange(i * 8, i * 8 + 8), remote, np.arange(8), timeout_s=timeout_s)
             for i in range(n)]
    threads, raised = waiting(xfers)
    if timeout_s == WAIT_S:  # (a short deadline may pass before every caller got a CPU)
        wait_until(lambda: pump_state(pump)[4] == n, WAIT_S, f"{n} blocked callers to take the own worker")
    return pair, xfers, threads, raised


def test_close_from_another_thread_while_callers_hold_the_worker(make_agent):
    """Three callers hold b's worker taken (its pump napping) when another
    thread closes b: the close returns, unwedged, every waiter leaves with
    its read failed, and the pump stopped from its nap."""
    pair, xfers, threads, raised = blocked_readers(make_agent, 3)
    closer = threading.Thread(target=pair.b.close, daemon=True)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close hung while callers held the worker"
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads), "a waiter hung past the close"
    assert not pair.b._core.wedged and pair.b._core.driver.stragglers == 0
    for i, xfer in enumerate(xfers):
        assert xfer.state is XferState.FAILED
        assert isinstance(raised[i], (TransferError, ClosedError)), raised[i]


def test_deadlines_pass_while_callers_hold_the_worker(make_agent):
    """Three callers hold b's worker taken, waiting on reads whose deadline
    passes (the target is not progressed): each wait fails, the worker goes
    back to its pump, and the next read (its target progressed now)
    completes through the pump."""
    pair, xfers, threads, raised = blocked_readers(make_agent, 3, timeout_s=2.0)
    for thread in threads:
        thread.join(WAIT_S * 1.5)
    assert not any(thread.is_alive() for thread in threads)
    for i, xfer in enumerate(xfers):
        assert xfer.state is XferState.FAILED and isinstance(raised[i], TransferError), raised[i]
    given_back(pair.b)


@pytest.mark.parametrize("n", [1, 3])
def test_waits_released_by_the_target_leave_the_worker_to_the_pump(make_agent, n):
    """Callers that took the worker leave one by one as the target answers;
    then nobody waits, and a read nobody waits for completes through the pump."""
    pair, xfers, threads, raised = blocked_readers(make_agent, n)
    wait_until(lambda: all(x.done() for x in xfers), WAIT_S, "the reads once their target is progressed",
               drive=[pair.a])
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert all(raised[i] is None for i in range(n)), raised
    given_back(pair.b)
    local, remote = prepare_slots(pair, BLOCK)
    alone = pair.b.read_prepared(local, [100], remote, [100], timeout_s=WAIT_S)
    wait_until(alone.done, WAIT_S, "a read nobody waits for", drive=[pair.a])
    assert alone.state is XferState.DONE, alone.error
    assert np.array_equal(pair.buf_b[100 * BLOCK:101 * BLOCK], pair.buf_a[100 * BLOCK:101 * BLOCK])


def test_a_completion_published_by_a_taker_reaches_its_callback_while_the_taker_waits(make_agent, monkeypatch):
    """A caller holds b's worker taken, waiting on a read nobody answers;
    meanwhile a callback-only read of b's from another peer completes,
    published by the taker's progress. The taker wakes the service thread,
    as the pump would have, so the callback runs while the taker still
    waits. Before, it ran at the end of the taker's wait (or of its slice,
    ``WAIT_SLICE_S``, 1 s) or at the service thread's next look
    (``HELP_STALE_NS``, 20 ms; ``SERVICE_SLEEP_S``): all three made 10
    minutes here, so that only a wake-up runs it before the taker's
    deadline (WAIT_S)."""
    from rdma_kv.transport import progress, transfer

    monkeypatch.setattr(progress, "HELP_STALE_NS", 600 * 10**9)
    monkeypatch.setattr(progress, "SERVICE_SLEEP_S", 600.0)
    monkeypatch.setattr(transfer, "WAIT_SLICE_S", 600.0)
    pair, xfers, threads, raised = blocked_readers(make_agent, 1)
    c = make_agent("c", ucx_options=TCP, lanes=1)
    buf_c = pattern(3, BLOCK)
    c.register(buf_c)
    assert pair.b.add_peer(c.metadata()) == "c" and c.add_peer(pair.b.metadata()) == "b"
    ran = threading.Event()
    for i in range(3):  # (a few: each must reach its callback with the taker still there)
        ran.clear()
        read = pair.b.read("c", pair.desc_b([BLOCK * (200 + i)], BLOCK), DescList([buf_c.ctypes.data], BLOCK),
                           timeout_s=WAIT_S)
        read.add_done_callback(lambda _: ran.set())
        assert ran.wait(WAIT_S / 4), "a completion published by the taker waited for the taker's own wait to end"
        assert read.state is XferState.DONE and not xfers[0].done()
        assert np.array_equal(pair.buf_b[BLOCK * (200 + i):BLOCK * (201 + i)], buf_c)
    assert pump_state(pair.b._core.driver.pump.handle)[4] == 1  # still taken: the taker did it
    wait_until(xfers[0].done, WAIT_S, "the blocked read once its target is progressed", drive=[pair.a])
    threads[0].join(WAIT_S)
    assert raised[0] is None, raised[0]


def test_the_close_hands_rk_pump_state_a_buffer_it_fits(make_agent):
    """``rk_pump_state`` writes five words (taken, since the take): the
    close's count of threads inside a help round handed it four, and it
    wrote past them (valgrind: 'Invalid write of size 8 ... 0 bytes after
    a block'). A guard word after every buffer the driver allocates shows
    the write."""
    agent = make_agent("b", lanes=2)
    driver = agent._core.driver
    real = driver._ffi
    guard = 0x5A5A5A5A5A5A5A5A
    guarded: list = []

    class Guarded:
        def new(self, ctype, *args):
            if (m := re.fullmatch(r"uint64_t\[(\d+)\]", ctype)) is None or args:
                return real.new(ctype, *args)
            n = int(m[1])
            buf = real.new("uint64_t[]", n + 2)
            buf[n] = buf[n + 1] = guard
            guarded.append((buf, n))
            return real.cast("uint64_t *", buf)

        def __getattr__(self, name):
            return getattr(real, name)

    driver._ffi = Guarded()
    try:
        assert driver._helpers_inside() == 0
    finally:
        driver._ffi = real
    assert guarded, "the count allocated no uint64_t buffer"
    for buf, n in guarded:
        assert buf[n] == guard and buf[n + 1] == guard, f"rk_pump_state wrote past a uint64_t[{n}]"


@pytest.mark.parametrize("spin_s", [0.0002, 5.0])
def test_close_at_random_while_callers_take_post_and_count_callbacks(make_agent, spin_s):
    """Callers wait() on striped and whole reads in a loop (taking the
    worker), some of them from a peer nobody progresses (their waits stay
    blocked), a callback-only user posts beside them, and another thread
    closes the agent at a random moment: the close returns unwedged, every
    thread leaves, every transfer ended (done, or failed by the close) and
    its callback ran exactly once."""
    seed = int(spin_s * 1e4)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    for _ in range(2):
        pair = link(make_agent("a", ucx_options=TCP, lanes=1),
                    make_agent("b", ucx_options=TCP, lanes=3, lane_min_bytes=2 * BLOCK, spin_s=spin_s,
                               close_drain_s=0.2))
        stuck = make_agent("c", progress="poll", ucx_options=TCP, lanes=1)  # never progressed
        buf_c = np.zeros(BLOCK * 8, dtype=np.uint8)
        stuck.register(buf_c)
        pair.b.add_peer(stuck.metadata())
        stuck.add_peer(pair.b.metadata())
        local, remote = prepare_slots(pair, BLOCK)
        remote_c = pair.b.prep_remote("c", DescList.from_regions(buf_c.ctypes.data, np.arange(8) * BLOCK, BLOCK))
        nslots = pair.buf_a.nbytes // BLOCK
        calls: dict[tuple[int, int], int] = {}
        posted: list = []
        lock = threading.Lock()
        failures: list[BaseException] = []

        def user(t: int, waits: bool) -> None:
            r = 0
            try:
                while True:
                    idx = np.arange(t * 16, t * 16 + 1 + r % 16) % nslots
                    try:
                        if (t, r) == (0, 1) or (t == 3 and r % 8 == 2):  # from the peer that never answers
                            xfer = pair.b.read_prepared(local, [t * 16], remote_c, [r % 8], timeout_s=WAIT_S)
                        else:
                            xfer = pair.b.read_prepared(local, idx, remote, idx, timeout_s=WAIT_S)
                    except ClosedError:
                        return
                    key = (t, r)

                    def count(_, key=key) -> None:
                        with lock:
                            calls[key] = calls.get(key, 0) + 1

                    xfer.add_done_callback(count)
                    with lock:
                        posted.append((key, xfer))
                    if waits:
                        try:
                            xfer.wait(WAIT_S)
                        except (TransferError, ClosedError):
                            return
                    r += 1
            except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
                failures.append(exc)

        threads = [threading.Thread(target=user, args=(t, t < 3), daemon=True) for t in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(posted) >= 8 + int(rng.integers(0, 40)), WAIT_S, "transfers under way")
        closer = threading.Thread(target=pair.b.close, daemon=True)
        closer.start()
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close hung"
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(thread.is_alive() for thread in threads), "a user hung past the close"
        assert not failures, failures[0]
        assert not pair.b._core.wedged and pair.b._core.driver.stragglers == 0
        for key, xfer in posted:
            assert xfer.state in (XferState.DONE, XferState.FAILED), (key, xfer.state)
        wait_until(lambda: len(calls) == len(posted), WAIT_S, "every callback")
        assert set(calls.values()) == {1}, "a callback ran twice"
        pair.a.close()
        stuck.close()


@pytest.mark.multiprocess
def test_a_peer_killed_while_callers_hold_the_worker(make_agent):
    """Three callers hold a reader's worker taken (spin_s long), waiting on
    reads from a peer process that is stopped, then killed: every wait
    fails (the endpoint's error, or the 3 s deadline), the worker goes back
    to its pump, and the reader still reads from a live peer."""
    nbytes, block = 1 << 20, 64 << 10
    child = Child("victim", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, [nbytes], 1000)
    try:
        reader = make_agent("reader", ucx_options=TCP, lanes=1, spin_s=WAIT_S, transfer_timeout_s=3.0)
        local = np.zeros(nbytes, dtype=np.uint8)
        reader.register(local)
        reader.add_peer(child.metadata)
        child.call("add_peer", reader.metadata())
        n = nbytes // block
        whole = (DescList.from_regions(local.ctypes.data, np.arange(n) * block, block),
                 DescList.from_regions(child.addrs[0], np.arange(n) * block, block))
        reader.read(child.name, *whole, timeout_s=WAIT_S).wait(WAIT_S)  # wired up (not under 3 s)
        assert np.array_equal(local, pattern(1000, nbytes))
        child.stop()
        xfers = [reader.read(child.name, *whole) for _ in range(3)]
        threads, raised = waiting(xfers)
        pump = reader._core.driver.pump.handle
        wait_until(lambda: pump_state(pump)[4] >= 1 or all(x.done() for x in xfers), WAIT_S,
                   "a blocked caller to take the reader's worker")
        child.kill()
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(thread.is_alive() for thread in threads), "a wait hung past the peer's death"
        for i, xfer in enumerate(xfers):
            assert xfer.state is XferState.FAILED and isinstance(raised[i], TransferError), raised[i]
        given_back(reader)
        other = make_agent("bystander", ucx_options=TCP, lanes=1)
        src = pattern(7, 1 << 16)
        other.register(src)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        reader.register(dst)
        reader.add_peer(other.metadata())
        reader.read("bystander", DescList([dst.ctypes.data], 1 << 16), DescList([src.ctypes.data], 1 << 16),
                    timeout_s=WAIT_S).wait(WAIT_S)
        assert np.array_equal(dst, src)
    finally:
        child.terminate()


@pytest.mark.parametrize("waiters", [1, 3])
def test_callers_blocked_on_an_unanswered_read_leave_the_cpus_idle(make_agent, waiters):
    """Callers blocked in wait() on reads nobody answers (default spin_s):
    each gives the worker back after spin_s and sleeps on its slot, and the
    pump sleeps on its fd instead of napping on a take -- a take never given
    back, or a pump spinning on a hold, would keep a core busy."""
    import time

    pair = link(make_agent("a", progress="poll", ucx_options=TCP, lanes=1),
                make_agent("b", progress="thread", lanes=1, ucx_options=TCP))
    local, remote = prepare_slots(pair, BLOCK)
    # Wired up first: until its peer has answered once, UCX's TCP endpoint keeps its socket's
    # EPOLLOUT ready and the worker's event fd readable, and the pump dozes (test_pump_doze.py)
    # instead of sleeping on the fd, as this test waits for it to.
    first = pair.b.read_prepared(local, [100], remote, [100], timeout_s=WAIT_S)
    wait_until(first.done, WAIT_S, "a first read", drive=[pair.a])
    xfers = [pair.b.read_prepared(local, [i], remote, [i], timeout_s=WAIT_S) for i in range(waiters)]
    threads = [threading.Thread(target=x.wait, args=(WAIT_S,), daemon=True) for x in xfers]
    for thread in threads:
        thread.start()
    ctx = pair.b._core.inflight.ctx
    wait_until(lambda: ctx.awaiting == waiters, WAIT_S, "the callers to block")
    pump = pair.b._core.driver.pump.handle
    wait_until(lambda: pump_state(pump)[4] == 0 and pump_state(pump)[2] == 1, WAIT_S,
               "the worker given back, its pump asleep on its fd")
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert cpu < 0.25 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s with {waiters} caller(s) blocked"
    wait_until(lambda: all(x.done() for x in xfers), WAIT_S, "the reads once answered", drive=[pair.a])
    for thread in threads:
        thread.join(WAIT_S)
    assert all(x.state is XferState.DONE for x in xfers)
    given_back(pair.b)


@pytest.fixture(scope="module")
def overlap_probe(tmp_path_factory) -> pathlib.Path:
    return shared_library(HERE / "csrc" / "progress_overlap.c",
                          tmp_path_factory.mktemp("overlap") / "progress_overlap.so", "-ldl")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_pump_and_a_taker_are_never_in_one_workers_progress_at_once(overlap_probe):
    """Its UCX worker is thread-safe (MULTI), so both inside at once would
    go unseen by the bytes: a probe preloaded into a child counts each entry
    of a pump into its worker's ucp_worker_progress while another thread is
    inside it for that worker, and the other way round (0), beside the
    calls of each (some: the callers did take the worker). With
    rk_pump_claim not looking at busy (a mutation), the probe counted
    thousands."""
    env = dict(os.environ, LD_PRELOAD=str(overlap_probe), PYTHONPATH=os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, str(HERE / "take_overlap_child.py")], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["hung"] and not report["failures"], report
    assert report["pump"] > 0 and report["other"] > 0, report
    assert report["overlaps"] == 0, report
