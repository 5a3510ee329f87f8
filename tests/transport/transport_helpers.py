"""Helpers shared by the transport tests, their fixtures and their child
processes: transport settings, seeded patterns, bounded waits, notification
collection, random block plans with their byte model, agent teardown checks
a connected pair of agents, and a TCP target with an answer queued.

Imports only numpy, the stdlib and rdma_kv, so a spawned child starts fast.
Every wait here is bounded; polling loops are waits with a deadline, never
a sleep that hopes the other side is ready.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest

from rdma_kv.errors import PeerError, TransferError
from rdma_kv.transport import DescList, XferState

LOOPBACK = {"NET_DEVICES": "lo"}  # UCX would otherwise also use eth0's address for TCP
TCP = {"TLS": "tcp", "NET_DEVICES": "lo"}
PROGRESS_THREAD_PREFIX = "rdma-kv-progress-"


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The seeded bytes a buffer is filled with (both processes agree)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str,
               drive: Iterable[object] = ()) -> None:
    """Poll ``pred`` until true; drive the poll-mode agents in ``drive``."""
    agents = list(drive)
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not done after {timeout_s} s")
        for agent in agents:
            agent.progress()
        if not agents:
            time.sleep(0.0005)  # progress threads do the work; do not spin a shared core


def collect_notifications(agent, expected: Iterable[bytes], sentinel: bytes, timeout_s: float,
                          drive: Iterable[object] = ()) -> list:
    """Gather ``agent``'s notifications until ``sentinel`` arrives, which the
    sender posts after every expected one completed. Returns them all
    (sentinel excluded); raises if any payload is missing or repeated."""
    got: list = []

    def seen_sentinel() -> bool:
        got.extend(agent.get_notifications())
        return any(n.payload == sentinel for n in got)

    wait_until(seen_sentinel, timeout_s, f"notifications on {agent.name!r}", drive)
    got.extend(agent.get_notifications())
    rest = [n for n in got if n.payload != sentinel]
    counts = Counter(n.payload for n in rest)
    want = Counter(expected)
    assert counts == want, (
        f"notifications differ: missing {sorted((want - counts).elements())[:5]}, "
        f"unexpected or repeated {sorted((counts - want).elements())[:5]}"
    )
    assert sum(n.payload == sentinel for n in got) == 1, "sentinel notification delivered more than once"
    return rest


def random_blocks(rng: np.random.Generator, local_nbytes: int, remote_nbytes: int,
                  max_blocks: int = 512) -> tuple[int, np.ndarray, np.ndarray]:
    """A random block size, and local / remote byte offsets of ``n`` blocks:
    a permutation of distinct slots at random (unaligned) base offsets, made
    of shuffled runs so that some descriptors coalesce."""
    block = int(rng.choice([int(rng.integers(1, 64)), int(rng.integers(64, 8192)),
                            int(rng.integers(8192, 65536))]))
    slots = min(local_nbytes, remote_nbytes) // block
    n = int(rng.integers(1, min(slots, max_blocks) + 1))

    def side(nbytes: int) -> np.ndarray:
        nslots = nbytes // block
        span = int(rng.integers(n, nslots + 1))  # slots drawn from a window of span
        start = int(rng.integers(0, nbytes - span * block + 1))
        chosen = np.sort(rng.choice(span, n, replace=False))
        cuts = np.flatnonzero(rng.random(n - 1) < 0.3) + 1
        runs = np.split(chosen, cuts)
        order = rng.permutation(len(runs))
        return start + np.concatenate([runs[i] for i in order]).astype(np.int64) * block

    return block, side(local_nbytes), side(remote_nbytes)


def post_burst(b, local, remote, rng: np.random.Generator, nslots: int, small: int,
               notify: bool = True, count: int = 24) -> list:
    """Post ``count`` transfers back to back from agent ``b`` between the
    prepared lists ``local`` and ``remote`` (``nslots`` slots each): every
    third spans up to all slots (striped), the rest fewer than ``small``
    (whole); reads and writes in turn (writes notified if ``notify``); every
    fifth with a deadline that passes before it can complete, so the first
    expiry fails the peer with the others in flight. An agent whose own
    threads settle may fail the peer before the burst is posted: the posts
    stop there (the agent refuses a failed peer) and the list is shorter."""
    xfers = []
    for i in range(count):
        n = int(rng.integers(1, nslots)) if i % 3 == 0 else int(rng.integers(1, small))
        li, ri = rng.permutation(nslots)[:n], rng.permutation(nslots)[:n]
        timeout = 1e-6 if i % 5 == 4 else None
        try:
            if i % 2:
                tag = f"w{i}".encode() if notify else None
                xfers.append(b.write_prepared(local, li, remote, ri, notify=tag, timeout_s=timeout))
            else:
                xfers.append(b.read_prepared(local, li, remote, ri, timeout_s=timeout))
        except PeerError:
            assert i > 4, f"the peer failed before any deadline could pass (transfer {i} of the burst)"
            break
    return xfers


def settle_until_one_failed(b, xfers: list, timeout_s: float) -> None:
    """Settle ``b`` until one of ``xfers`` failed (the burst's first expiry),
    without progressing its peer: until the peer answers, no read completes,
    so however slow the machine, a deadline passes first."""
    end = time.monotonic() + timeout_s
    while not any(x.done() and x.state is not XferState.DONE for x in xfers):
        assert time.monotonic() < end, f"no transfer failed on its deadline within {timeout_s} s"
        b.settle()
        time.sleep(0.0001)


def apply_blocks(dst: np.ndarray, src: np.ndarray, dst_off: np.ndarray, src_off: np.ndarray, block: int) -> None:
    """The model: what moving ``block`` bytes from each src offset to each dst
    offset does to ``dst``."""
    for d, s in zip(dst_off.tolist(), src_off.tolist()):
        dst[d:d + block] = src[s:s + block]


def contiguous_runs(local_off: np.ndarray, remote_off: np.ndarray, block: int) -> int:
    """Operations expected after coalescing (one region per side)."""
    if len(local_off) == 0:
        return 0
    joined = (np.diff(local_off) == block) & (np.diff(remote_off) == block)
    return int(len(local_off) - joined.sum())


# -- agents ------------------------------------------------------------------------------


@contextmanager
def pumps_held(agent) -> Iterator[list]:
    """Every pump of ``agent`` (its own and each lane's) kept off its worker
    meanwhile (``rk_pump_hold``): what is posted stays in flight until a
    caller progresses it. Yields the pumps."""
    core = agent._core
    pumps = [p for p in (core.driver.pump, *(lane.pump for lane in core.lanes._lanes)) if p is not None]
    for pump in pumps:
        pump._lib.rk_pump_hold(pump.handle, 1)
    try:
        yield pumps
    finally:
        for pump in pumps:
            pump._lib.rk_pump_hold(pump.handle, -1)


def progress_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(PROGRESS_THREAD_PREFIX)}


@contextmanager
def polled(agents: list) -> Iterator[None]:
    """The polling agents of ``agents`` (``progress="poll"``, still open)
    progressed by a thread of their own meanwhile, as their owner would;
    the others have threads of their own."""
    agents = [a for a in agents if a.config.progress == "poll" and not a.closed]
    if not agents:
        yield
        return
    stop = threading.Event()

    def drive() -> None:
        while not stop.is_set():
            for agent in agents:
                agent.progress()
            time.sleep(0.0002)

    thread = threading.Thread(target=drive, name="poller", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10.0)


def teardown_problems(agents: list) -> list[str]:
    """Close ``agents`` one by one and say what each left behind, if anything.

    The polling agents still open are progressed while another closes (as
    their owner would be): closing an endpoint waits, at most
    ``peer.CLOSE_WAIT_S`` per endpoint, for its peer to progress, and a
    polling peer left undriven made each such close wait it out, 4-8 s per
    test (about 2 minutes of the transport tests)."""
    problems = []
    for i, agent in enumerate(agents):
        try:
            with polled(agents[i + 1:]):
                agent.close()
        except Exception as exc:  # noqa: BLE001 -- reported, not swallowed
            problems.append(f"{agent.name}: close() raised {exc!r}")
            continue
        if agent.inflight or agent.regions or agent.peers:
            problems.append(f"{agent.name}: after close() {agent!r}")
        thread = f"{PROGRESS_THREAD_PREFIX}{agent.name}"
        if any(t.name == thread and t.is_alive() for t in progress_threads()):
            problems.append(f"{agent.name}: progress thread still running after close()")
    return problems


@dataclass
class Pair:
    """Two connected agents in one process, each with one registered buffer."""

    a: object
    b: object
    buf_a: np.ndarray
    buf_b: np.ndarray

    def desc_a(self, offsets, nbytes):
        from rdma_kv.transport import DescList

        return DescList.from_regions(self.buf_a.ctypes.data, offsets, nbytes)

    def desc_b(self, offsets, nbytes):
        from rdma_kv.transport import DescList

        return DescList.from_regions(self.buf_b.ctypes.data, offsets, nbytes)


PAIR_NBYTES = 1 << 20


def connect(make_agent: Callable[..., object], **config) -> Pair:
    """Agents "a" and "b" from ``make_agent(name, **config)``, linked."""
    return link(make_agent("a", **config), make_agent("b", **config))


def link(a, b, nbytes: int = PAIR_NBYTES) -> Pair:
    """Make agents ``a`` and ``b`` peers of each other, each with one
    registered buffer of ``nbytes``: a's holds seeded random bytes, b's
    zeros."""
    buf_a = np.random.default_rng(0xA).integers(0, 256, nbytes, dtype=np.uint8)
    buf_b = np.zeros(nbytes, dtype=np.uint8)
    a.register(buf_a)
    b.register(buf_b)
    assert a.add_peer(b.metadata()) == b.name
    assert b.add_peer(a.metadata()) == a.name
    return Pair(a, b, buf_a, buf_b)


def prepare_slots(pair: Pair, block: int = 4096):
    """b reads a: prepared lists of every ``block``-byte slot of the pair's
    buffers, on both sides (local, remote)."""
    slots = np.arange(pair.buf_a.nbytes // block) * block
    return pair.b.prep_local(pair.desc_b(slots, block)), pair.b.prep_remote(pair.a.name, pair.desc_a(slots, block))


def shared_library(source: pathlib.Path, out: pathlib.Path, *flags: str) -> pathlib.Path:
    """Build the C file ``source`` into the shared library ``out`` (link
    ``flags`` after it) with the repository's one compiler lookup
    (``bench/wake_latency.compiler``); the test is skipped without a
    compiler."""
    bench = str(pathlib.Path(__file__).resolve().parents[2] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from wake_latency import compiler

    cc = compiler()
    if not cc:
        pytest.skip("no C compiler (set CC or install gcc)")
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", str(source), "-o",
                           str(out), *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{source.name} did not build:\n{proc.stderr}"
    return out


def answer_queued(a, b, nbytes: int):
    """Polling agents ``a`` (the target) and ``b`` (the reader), over TCP,
    made peers (:func:`link`, ``nbytes`` each) and their endpoints wired up
    by a first 4 KiB read; then b's read of all of a, which a answers (TCP
    has no native get: the bytes go back as messages) until its socket is
    full, so the rest of its answer waits in its endpoint's queue. Returns
    ``read(n)``, posting b's read of a's first ``n`` bytes, and that big
    read's transfer."""
    pair = link(a, b, nbytes)
    whole = np.array([0])

    def read(n: int):
        return b.read("a", pair.desc_b(whole, n), pair.desc_a(whole, n), timeout_s=300.0)

    first = read(4096)
    wait_until(first.done, 120.0, "the warm-up read", drive=[a])
    assert first.state is XferState.DONE, first.state
    big = read(nbytes)
    for _ in range(100):  # its request goes out
        b.progress()
    answered = time.monotonic() + 0.5
    while time.monotonic() < answered:  # a answers until its socket is full
        a.progress()
    return read, big


HUNG_NBYTES = 1 << 16
HUNG_WAIT_S = 30.0


def hung_peer(make_agent):
    """A reader (``transfer_timeout_s`` 1 s) whose TCP peer stopped
    progressing (it polls, and the test stops calling it) while a read and
    a flush were in flight: both passed their deadline, the peer was failed
    and its endpoint left open. Returns the target, the reader, the
    reader's region the read was for, and the two failed transfers."""
    target = make_agent("target", progress="poll", ucx_options=TCP, lanes=1)
    reader = make_agent("reader", ucx_options=TCP, lanes=1, transfer_timeout_s=1.0)
    theirs, mine = np.full(HUNG_NBYTES, 0xAB, dtype=np.uint8), np.zeros(HUNG_NBYTES, dtype=np.uint8)
    target.register(theirs)
    region = reader.register(mine)
    reader.add_peer(target.metadata())
    target.add_peer(reader.metadata())
    loc, rem = DescList([mine.ctypes.data], HUNG_NBYTES), DescList([theirs.ctypes.data], HUNG_NBYTES)
    # The warm-up read has a deadline of its own: under the reader's 1 s, a
    # loaded host could fail the peer before the test begins.
    first = reader.read("target", loc, rem, timeout_s=HUNG_WAIT_S)
    wait_until(first.done, HUNG_WAIT_S, "a first read", drive=[target])
    stuck = [reader.read("target", loc, rem), reader.flush("target")]
    for xfer in stuck:
        with pytest.raises(TransferError):
            xfer.wait(HUNG_WAIT_S)
    return target, reader, region, stuck
