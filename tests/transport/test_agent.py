"""Two agents in one process: registration, bit-exact READ and WRITE, prepared
lists, flush, notifications, every error path, close and asyncio.

Both agents are progressed (threads, or the test drives poll-mode agents):
a poll-mode agent nobody progresses stalls its peer -- which the deadline
tests use on purpose.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from rdma_kv.errors import (
    ClosedError,
    ConfigError,
    DescriptorError,
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeoutError,
    UCXError,
)
from rdma_kv.transport import AgentConfig, DescList, MemoryKind, XferOp, XferState
from rdma_kv.transport._lib import load, status_name
from transport_helpers import (
    PAIR_NBYTES,
    TCP,
    Pair,
    apply_blocks,
    collect_notifications,
    connect,
    contiguous_runs,
    polled,
    pumps_held,
    random_blocks,
    wait_until,
)

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

WAIT_S = 10.0


# -- registration ------------------------------------------------------------------


def test_views_of_one_numpy_allocation_share_one_refcounted_region(make_agent):
    agent = make_agent("reg")
    arr = np.zeros(1 << 16, dtype=np.uint8)
    region = agent.register(arr)
    assert (region.base, region.nbytes, region.kind) == (arr.ctypes.data, arr.nbytes, MemoryKind.HOST)
    assert agent.register(arr[100:200]) is region
    assert agent.register(arr.reshape(256, 256)[:, 3]) is region
    assert agent.register((arr.ctypes.data + 10, 100)) is region
    assert region.refs == 4 and agent.regions == (region,)

    for refs in (3, 2, 1):
        agent.deregister(region)
        assert region.refs == refs and agent.regions == (region,)
    agent.deregister(region)
    assert agent.regions == ()
    with pytest.raises(RegistrationError, match="is not registered with agent 'reg'"):
        agent.deregister(region)


def test_torch_kv_layers_register_as_one_region(make_agent):
    agent = make_agent("kv")
    kv = torch.zeros(4, 8, 2, 16, 32)  # layers x blocks x ...: layers are views of one allocation
    regions = {id(agent.register(layer)) for layer in kv.unbind(0)}
    assert len(regions) == 1 and len(agent.regions) == 1
    (region,) = agent.regions
    assert (region.base, region.nbytes, region.refs) == (kv.data_ptr(), kv.nbytes, 4)
    from rdma_kv.transport import metadata as wire

    assert len(wire.decode(agent.metadata()).regions) == 1


def test_overlapping_registration_is_rejected(make_agent):
    agent = make_agent("ovl")
    backing = np.zeros(3 << 12, dtype=np.uint8)
    base = backing.ctypes.data
    region = agent.register((base + 4096, 4096))
    for span in [(base + 4096 + 2048, 4096), (base, 4096 + 1), (base, 3 << 12)]:
        with pytest.raises(RegistrationError, match="overlaps registered region .* register the enclosing"):
            agent.register(span)
    assert agent.regions == (region,) and region.refs == 1
    assert agent.register((base + 2 * 4096, 4096)) is not region  # adjacent is fine
    assert len(agent.regions) == 2


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_registered_memory_is_kept_alive_until_unmapped(pair: Pair, kind):
    # A temporary passed to register() must not be freed while peers can
    # still reach it (UCX segfaulted on exactly that before regions kept it).
    tmp = np.full(1 << 16, 9, dtype=np.uint8) if kind == "numpy" else torch.full((1 << 16,), 9, dtype=torch.uint8)
    alive = weakref.ref(tmp)
    region = pair.b.register(tmp[1024:])  # a view: the allocation behind it must live too
    del tmp
    gc.collect()
    assert alive() is not None
    pair.b.read("a", DescList([region.base], 4096), pair.desc_a([0], 4096)).wait(WAIT_S)
    got = np.asarray(alive())[:4096]
    np.testing.assert_array_equal(got, pair.buf_a[:4096])
    del got
    pair.b.deregister(region)
    del region
    gc.collect()
    assert alive() is None, "deregister() should release what it kept alive"


def test_unsupported_objects_are_rejected_before_touching_ucx(make_agent):
    agent = make_agent("bad")
    with pytest.raises(RegistrationError, match="cannot register list"):
        agent.register([1, 2, 3])
    assert agent.regions == ()


# -- READ / WRITE ------------------------------------------------------------------------


@pytest.mark.parametrize("op", [XferOp.READ, XferOp.WRITE])
def test_random_blocks_bit_exact(pair: Pair, rng, op):
    b = pair.b
    pair.buf_b[:] = rng.integers(0, 256, PAIR_NBYTES, dtype=np.uint8)
    for _ in range(25):
        block, local_off, remote_off = random_blocks(rng, PAIR_NBYTES, PAIR_NBYTES)
        local, remote = pair.desc_b(local_off, block), pair.desc_a(remote_off, block)
        if op is XferOp.READ:
            expect, dst = pair.buf_b.copy(), pair.buf_b
            apply_blocks(expect, pair.buf_a, local_off, remote_off, block)
            xfer = b.read("a", local, remote)
        else:
            expect, dst = pair.buf_a.copy(), pair.buf_a
            apply_blocks(expect, pair.buf_b, remote_off, local_off, block)
            xfer = b.write("a", local, remote)
        assert xfer.wait(WAIT_S) is xfer
        assert xfer.state is XferState.DONE and xfer.error is None and xfer.done()
        assert (xfer.num_descs, xfer.nbytes) == (len(local_off), len(local_off) * block)
        assert xfer.ops_posted == contiguous_runs(local_off, remote_off, block)
        np.testing.assert_array_equal(dst, expect)
    assert b.inflight == 0
    assert b.stats.transfers == 25 and b.stats.failed == 0


def test_contiguous_descriptors_coalesce_into_one_op_with_the_same_bytes(pair: Pair):
    n, block = 256, 1024
    offsets = np.arange(n) * block
    merged = pair.b.read("a", pair.desc_b(offsets, block), pair.desc_a(offsets, block)).wait(WAIT_S)
    assert (merged.num_descs, merged.ops_posted) == (n, 1)
    first = pair.buf_b[: n * block].copy()
    pair.buf_b[:] = 0
    order = np.random.default_rng(7).permutation(n)  # same blocks, never contiguous on both sides
    rev = pair.b.read("a", pair.desc_b(offsets[order][::-1], block), pair.desc_a(offsets[order][::-1], block))
    rev.wait(WAIT_S)
    assert rev.ops_posted == contiguous_runs(offsets[order][::-1], offsets[order][::-1], block) > 1
    np.testing.assert_array_equal(pair.buf_b[: n * block], first)
    np.testing.assert_array_equal(first, pair.buf_a[: n * block])


def test_prepared_lists_by_index(pair: Pair, rng):
    b = pair.b
    block, nslots = 4096, PAIR_NBYTES // 4096
    slots = np.arange(nslots) * block
    local = b.prep_local(pair.desc_b(slots, block))
    remote = b.prep_remote("a", pair.desc_a(slots, block))
    assert (len(local), len(remote)) == (nslots, nslots)

    lidx, ridx = rng.permutation(nslots)[:64], rng.permutation(nslots)[:64]
    xfer = b.read_prepared(local, lidx, remote, ridx).wait(WAIT_S)
    assert xfer.num_descs == 64
    for li, ri in zip(lidx, ridx):
        got, want = pair.buf_b[li * block:(li + 1) * block], pair.buf_a[ri * block:(ri + 1) * block]
        np.testing.assert_array_equal(got, want)

    pair.buf_b[:block] = 0xAB
    b.write_prepared(local, [0, 0], remote, [5, 9]).wait(WAIT_S)  # one local block to two remote slots
    assert (pair.buf_a[5 * block:6 * block] == 0xAB).all() and (pair.buf_a[9 * block:10 * block] == 0xAB).all()

    run = np.arange(10, 20)
    assert b.read_prepared(local, run, remote, run).wait(WAIT_S).ops_posted == 1

    with pytest.raises(DescriptorError, match="pass a list from prep_local"):
        b.read_prepared(remote, [0], local, [0])
    with pytest.raises(DescriptorError, match="1 local vs 2 remote"):
        b.read_prepared(local, [0], remote, [0, 1])
    with pytest.raises(DescriptorError, match=f"descriptor index {nslots} out of range .* remote \\(a\\)"):
        b.read_prepared(local, [0], remote, [nslots])
    assert b.inflight == 0


def test_prepared_index_checks_happen_before_anything_is_posted(pair: Pair):
    """Index pairs are checked in C (rk_check_indexed) before the first post:
    a bad pair anywhere in the list fails the whole transfer with the precise
    error, and the good pairs before it move nothing."""
    b, block = pair.b, 4096
    nslots = PAIR_NBYTES // block
    slots = np.arange(nslots) * block
    local, remote = b.prep_local(pair.desc_b(slots, block)), b.prep_remote("a", pair.desc_a(slots, block))
    posted = b.stats.ops_posted
    good = np.arange(8, dtype=np.int64)
    cases = [
        (np.append(good, nslots), np.append(good, 0), f"descriptor index {nslots} out of range .* local"),
        (np.append(good, 0), np.append(good, -1), "descriptor index -1 out of range .* remote"),
        (np.append(good, 0), np.append(good, 2**63).astype(np.uint64), f"index {2**63} out of range .* remote"),
        # int32 index arrays are read by C as they are: a negative one must not wrap into range.
        (np.append(good, -1).astype(np.int32), np.append(good, 0), "descriptor index -1 out of range .* local"),
        (np.append(good, 0).astype(np.int32), np.append(good, nslots).astype(np.int32),
         f"descriptor index {nslots} out of range .* remote"),
    ]
    for li, ri, message in cases:
        with pytest.raises(DescriptorError, match=message):
            b.read_prepared(local, li, remote, ri)
    assert b.stats.ops_posted == posted and b.inflight == 0
    assert not pair.buf_b.any(), "a rejected transfer moved bytes"
    # Lengths are compared per pair only when the lists are not uniform.
    mixed = b.prep_local(pair.desc_b([0, block], [block, 2 * block]))
    with pytest.raises(DescriptorError, match="lengths differ"):
        b.read_prepared(mixed, [1], remote, [0])
    assert b.stats.ops_posted == posted


@pytest.mark.parametrize("kind", ["list", "int32", "int32-both", "big-endian", "big-endian-int32", "strided",
                                  "uint64"])
def test_prepared_reads_accept_any_integer_index(pair: Pair, kind):
    b, block = pair.b, 4096
    slots = np.arange(PAIR_NBYTES // block) * block
    local, remote = b.prep_local(pair.desc_b(slots, block)), b.prep_remote("a", pair.desc_a(slots, block))
    base = np.array([9, 3, 3, 17, 40, 41, 42, 5, 6, 7])
    index = {"list": base.tolist(), "int32": base.astype(np.int32), "int32-both": base.astype(np.int32),
             "big-endian": base.astype(">i8"), "big-endian-int32": base.astype(">i4"),
             "strided": np.repeat(base, 2)[::2], "uint64": base.astype(np.uint64)}[kind]
    local_index = np.arange(len(base), dtype=np.int32 if kind == "int32-both" else np.int64)
    xfer = b.read_prepared(local, local_index, remote, index).wait(WAIT_S)
    assert (xfer.num_descs, xfer.nbytes) == (len(base), len(base) * block)
    for i, r in enumerate(base):
        np.testing.assert_array_equal(pair.buf_b[i * block:(i + 1) * block], pair.buf_a[r * block:(r + 1) * block])


def test_wait_after_completion_and_from_other_threads(pair: Pair):
    """The completion event is made on demand: a wait() that starts after
    the transfer resolved returns at once, and concurrent waiters all wake."""
    xfer = pair.b.read("a", pair.desc_b([0], 1 << 20), pair.desc_a([0], 1 << 20))
    woke: list = []
    waiters = [threading.Thread(target=lambda: woke.append(xfer.wait(WAIT_S))) for _ in range(4)]
    for t in waiters:
        t.start()
    for t in waiters:
        t.join(WAIT_S)
    assert woke == [xfer] * 4
    assert xfer.wait(0.001) is xfer  # already done: no blocking, no timeout


def test_flush_completes_after_writes(pair: Pair):
    pair.buf_b[:4096] = 7
    pair.b.write("a", pair.desc_b([0], 4096), pair.desc_a([0], 4096))
    flush = pair.b.flush("a")
    assert flush.op is XferOp.FLUSH and flush.wait(WAIT_S).state is XferState.DONE
    assert (flush.num_descs, flush.ops_posted, flush.nbytes) == (0, 0, 0)
    assert (pair.buf_a[:4096] == 7).all()


def test_done_callbacks_run_once(pair: Pair):
    calls: list = []
    event = threading.Event()
    xfer = pair.b.read("a", pair.desc_b([0], 65536), pair.desc_a([0], 65536))
    xfer.add_done_callback(lambda x: (calls.append(x), event.set()))
    assert event.wait(WAIT_S)
    xfer.add_done_callback(calls.append)  # already done: runs now
    assert calls == [xfer, xfer]


@pytest.mark.parametrize("progress", ["thread", "poll"])
def test_settle_settles_on_the_callers_thread_and_runs_each_callback_once(make_agent, progress):
    """``settle()`` settles what completed and runs its callbacks on the
    caller's thread (polling mode: nothing else does, so deterministically;
    thread mode: whichever of the caller and the service thread settles
    first, once). Closed: a no-op, not an error."""
    pair = connect(make_agent, progress=progress)
    calls: list = []
    xfer = pair.b.read("a", pair.desc_b([0], 65536), pair.desc_a([0], 65536))
    xfer.add_done_callback(lambda x: calls.append(threading.current_thread()))
    end = time.monotonic() + WAIT_S
    while not calls and time.monotonic() < end:
        if progress == "poll":
            pair.a.progress()
        pair.b.settle()
    assert len(calls) == 1 and xfer.state is XferState.DONE
    if progress == "poll":
        assert calls == [threading.current_thread()]
    pair.b.settle()  # nothing left: a look at the ring, no second callback
    assert len(calls) == 1
    with polled([pair.a]):  # a polling a's owner drives it (else b's close waits for a)
        pair.b.close()
    pair.b.settle()


def test_service_thread_leaves_completions_to_a_busy_caller(make_agent):
    """progress="thread": a caller busy in Python (an engine's step holds
    the interpreter lock, giving it up every switch interval) settles its
    transfers itself when it next looks (``settle()``), because the service
    thread leaves each completion to callers for ``settle_delay_s`` instead
    of taking the lock from it; nobody looking, the service thread settles
    it after that delay. (With no delay the service thread takes nearly
    every one within a switch interval. A periodic round of the service
    thread could take one in a window of microseconds a second, hence
    "most", not "all".)"""
    pair = connect(make_agent, progress="thread", settle_delay_s=0.5)
    caller = threading.current_thread()
    ran_on: list = []
    for i in range(20):
        xfer = pair.b.read("a", pair.desc_b([i * 4096], 4096), pair.desc_a([i * 4096], 4096))
        xfer.add_done_callback(lambda x: ran_on.append(threading.current_thread()))
        busy_until = time.monotonic() + 0.02
        while time.monotonic() < busy_until:  # holds the GIL but for the switch interval (5 ms)
            pass
        pair.b.settle()
        xfer.wait(WAIT_S)
    # A transfer the service thread settled runs its callback after wait() saw it settled.
    wait_until(lambda: len(ran_on) == 20, WAIT_S, "every completion callback")
    assert len(ran_on) == 20
    assert sum(t is caller for t in ran_on) >= 15, [t.name for t in ran_on]

    done = threading.Event()
    service: list = []
    xfer = pair.b.read("a", pair.desc_b([0], 65536), pair.desc_a([0], 65536))
    xfer.add_done_callback(lambda x: (service.append(threading.current_thread()), done.set()))
    assert done.wait(WAIT_S) and xfer.state is XferState.DONE
    assert service[0].name == "rdma-kv-progress-b"
    np.testing.assert_array_equal(pair.buf_b[:65536], pair.buf_a[:65536])


def test_finished_is_when_the_shim_completed_it_settled_when_the_agent_saw_it(make_agent):
    """``finished`` is read by the shim as the batch completes (on the pump
    that copied it), ``settled`` by the agent as it settles it: a completion
    nobody settles for 0.1 s (a caller busy in Python; the service thread
    leaving it to callers for ``settle_delay_s``) shows that wait between
    the two, and ``elapsed_s`` (the transfer's own time) leaves it out. A
    periodic round of the service thread may settle one early, hence "at
    least three of five"."""
    pair = connect(make_agent, progress="thread", settle_delay_s=1.0)
    waited = 0
    for i in range(5):
        xfer = pair.b.read("a", pair.desc_b([i * 4096], 4096), pair.desc_a([i * 4096], 4096))
        # No settle: an engine busy in its step, until the pump completed the
        # read (however long a loaded host takes: no bound on the pump's
        # time here) and 0.1 s more.
        slot = pair.b._core.inflight._slots[xfer._slot]
        end = time.monotonic() + WAIT_S
        while slot.done_ns == 0 and time.monotonic() < end:
            pass
        busy_until = time.perf_counter() + 0.1
        while time.perf_counter() < busy_until:
            pass
        pair.b.settle()
        xfer.wait(WAIT_S)
        assert xfer.finished is not None and xfer.settled is not None
        assert xfer.started <= xfer.finished <= xfer.settled
        assert xfer.elapsed_s == pytest.approx(xfer.finished - xfer.started)
        if xfer.settled - xfer.finished >= 0.05:
            waited += 1
            assert xfer.elapsed_s <= xfer.settled - xfer.started - 0.05  # the wait left out
    assert waited >= 3


# -- notifications -------------------------------------------------------------------------


def test_notifications_arrive_exactly_once_with_the_sender_name(pair: Pair):
    a, b = pair.a, pair.b
    payloads = [f"read-{i}".encode() for i in range(40)] + [f"write-{i}".encode() for i in range(40)] + [b""]
    xfers = []
    for i, payload in enumerate(payloads):
        post = b.write if payload.startswith(b"write") else b.read
        xfers.append(post("a", pair.desc_b([i * 64], 64), pair.desc_a([i * 64], 64), notify=payload))
    for x in xfers:
        x.wait(WAIT_S)
    b.read("a", pair.desc_b([0], 8), pair.desc_a([0], 8), notify=b"sentinel").wait(WAIT_S)
    got = collect_notifications(a, payloads, b"sentinel", WAIT_S)
    assert {n.peer for n in got} == {"b"}
    assert b.get_notifications() == [] and a.get_notifications() == []


def test_oversized_notification_is_rejected_and_nothing_posted(make_agent):
    pair = connect(make_agent, notif_max_bytes=16)
    with pytest.raises(ConfigError, match="notification of 17 bytes exceeds notif_max_bytes=16"):
        pair.b.read("a", pair.desc_b([0], 8), pair.desc_a([0], 8), notify=b"x" * 17)
    assert pair.b.inflight == 0 and pair.b.stats.transfers == 0


# -- error paths ------------------------------------------------------------------------------


def test_unknown_peer(pair: Pair):
    b = pair.b
    local, remote = pair.desc_b([0], 8), pair.desc_a([0], 8)
    calls = [
        lambda: b.read("nobody", local, remote),
        lambda: b.write("nobody", local, remote),
        lambda: b.flush("nobody"),
        lambda: b.prep_remote("nobody", remote),
        lambda: b.remove_peer("nobody"),
    ]
    for call in calls:
        with pytest.raises(PeerError, match=r"unknown peer 'nobody' \(known peers: a\); import its metadata"):
            call()
    assert isinstance(PeerError("x"), ConnectionError)
    b.remove_peer("a")
    with pytest.raises(PeerError, match=r"known peers: none"):
        b.read("a", local, remote)
    assert b.inflight == 0


@pytest.mark.parametrize(
    ("side", "offset", "length", "why"),
    [
        ("local", -64, 64, "not inside any registered region"),  # before the buffer
        ("local", PAIR_NBYTES - 32, 64, "not inside any registered region"),  # straddles the end
        ("local", PAIR_NBYTES, 64, "not inside any registered region"),  # just after
        ("remote", -1, 64, "not inside any registered region"),
        ("remote", PAIR_NBYTES - 63, 64, "not inside any registered region"),
        ("remote", 1 << 40, 64, "not inside any registered region"),
        ("local", 0, 0, "is empty"),
    ],
)
def test_out_of_bounds_descriptors_post_nothing(pair: Pair, side, offset, length, why):
    b = pair.b
    before = pair.buf_b.copy()
    lengths = np.array([64, 64, length], dtype=np.uint64)

    def descs(buf: np.ndarray, last: int) -> DescList:
        return DescList((np.array([0, 4096, last], dtype=np.int64) + buf.ctypes.data).astype(np.uint64), lengths)

    if side == "local":
        local, remote = descs(pair.buf_b, offset), descs(pair.buf_a, 0)
    else:
        local, remote = descs(pair.buf_b, 0), descs(pair.buf_a, offset)
    for post in (b.read, b.write):
        with pytest.raises(DescriptorError, match=f"{side} descriptors.*descriptor 2 .* {why}.*nothing was posted"):
            post("a", local, remote)
    with pytest.raises(DescriptorError, match=f"descriptor 2 .* {why}"):
        b.prep_local(local) if side == "local" else b.prep_remote("a", remote)
    assert b.inflight == 0 and b.stats.transfers == 0
    np.testing.assert_array_equal(pair.buf_b, before)


def test_local_and_remote_lists_must_pair_up(pair: Pair):
    with pytest.raises(DescriptorError, match="2 vs 1 descriptors"):
        pair.b.read("a", pair.desc_b([0, 64], 64), pair.desc_a([0], 64))
    with pytest.raises(DescriptorError, match="their lengths differ"):
        pair.b.read("a", pair.desc_b([0], 64), pair.desc_a([0], 32))
    assert pair.b.inflight == 0


def test_stale_prepared_lists_are_rejected(pair: Pair):
    a, b = pair.a, pair.b
    local = b.prep_local(pair.desc_b([0, 4096], 4096))
    remote = b.prep_remote("a", pair.desc_a([0, 4096], 4096))
    b.read_prepared(local, [0], remote, [1]).wait(WAIT_S)

    assert b.add_peer(a.metadata()) == "a"  # re-import: a new incarnation of "a"
    with pytest.raises(DescriptorError, match="remote prepared list .* earlier incarnation of 'a'; prepare it again"):
        b.read_prepared(local, [0], remote, [1])
    remote = b.prep_remote("a", pair.desc_a([0, 4096], 4096))
    b.read_prepared(local, [0], remote, [1]).wait(WAIT_S)

    extra = np.zeros(4096, dtype=np.uint8)
    b.deregister(b.register(extra))  # any deregister invalidates local lists
    with pytest.raises(DescriptorError, match="local prepared list .* prepare it again"):
        b.read_prepared(local, [0], remote, [1])
    assert b.inflight == 0


def test_prepared_lists_of_another_agent_are_rejected(make_agent):
    pair = connect(make_agent)
    c = make_agent("c")
    other = np.zeros(1 << 16, dtype=np.uint8)
    c.register(other)
    c.add_peer(pair.a.metadata())
    foreign_local = c.prep_local(DescList.from_regions(other.ctypes.data, [0], 4096))
    foreign_remote = c.prep_remote("a", pair.desc_a([0], 4096))
    local = pair.b.prep_local(pair.desc_b([0], 4096))
    remote = pair.b.prep_remote("a", pair.desc_a([0], 4096))
    with pytest.raises(DescriptorError, match="local prepared list"):
        pair.b.read_prepared(foreign_local, [0], remote, [0])
    with pytest.raises(DescriptorError, match="remote prepared list"):
        pair.b.read_prepared(local, [0], foreign_remote, [0])
    assert pair.b.inflight == 0 and not other.any()
    # Used by their own agent first (which caches a route on the remote list),
    # they are still foreign to b: the route is c's, not b's.
    c.read_prepared(foreign_local, [0], foreign_remote, [0]).wait(WAIT_S)
    assert other[:4096].any()
    with pytest.raises(DescriptorError, match="local prepared list"):
        pair.b.read_prepared(foreign_local, [0], foreign_remote, [0])
    assert pair.b.inflight == 0 and pair.b.stats.transfers == 0


def test_deadline_fails_a_stalled_transfer_and_re_import_recovers(make_agent):
    # Over TCP a get needs the target's worker to progress; a poll-mode target
    # nobody drives is an unresponsive peer.
    target = make_agent("target", progress="poll", ucx_options=TCP)
    reader = make_agent("reader", ucx_options=TCP, transfer_timeout_s=0.5)
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    target.register(src)
    reader.register(dst)
    reader.add_peer(target.metadata())
    target.add_peer(reader.metadata())
    local = DescList.from_regions(dst.ctypes.data, [0, 32768], 32768)
    remote = DescList.from_regions(src.ctypes.data, [0, 32768], 32768)

    stalled = reader.read("target", local, remote)
    later = reader.read("target", local, remote, timeout_s=60.0)
    with pytest.raises(TransferTimeoutError, match="did not complete within its deadline .* re-import") as exc:
        stalled.wait(WAIT_S)
    assert isinstance(exc.value, TimeoutError) and stalled.state is XferState.FAILED and stalled.error is exc.value
    assert exc.value.status == status_name(load()[1].UCS_ERR_TIMED_OUT)  # one convention for .status
    # The peer is considered dead: its other transfers fail too, and it refuses new ones.
    with pytest.raises(TransferError, match="peer 'target' did not complete transfer"):
        later.wait(WAIT_S)
    with pytest.raises(PeerError, match="peer 'target' failed"):
        reader.read("target", local, remote)
    assert reader.inflight == 0 and reader.stats.failed == 2

    reader.add_peer(target.metadata())  # "once it is back"
    # Its own deadline: the agent's 0.5 s must cover a new TCP wire-up to a target
    # progressed only by the loop below, which a loaded host may not give it.
    xfer = reader.read("target", local, remote, timeout_s=WAIT_S)
    wait_until(xfer.done, WAIT_S, "read after re-import", drive=[target])
    xfer.wait(0)
    np.testing.assert_array_equal(dst, src)


def stalled_link(make_agent, **reader_config):
    """A reader and a TCP target in poll mode that nobody drives: the
    reader's transfers stay in flight until the test drives the target."""
    target = make_agent("target", progress="poll", ucx_options=TCP)
    reader = make_agent("reader", ucx_options=TCP, **reader_config)
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    target.register(src)
    region = reader.register(dst)
    reader.add_peer(target.metadata())
    local = DescList.from_regions(dst.ctypes.data, [0], 4096)
    remote = DescList.from_regions(src.ctypes.data, [0], 4096)
    return target, reader, region, local, remote


def test_max_inflight_bounds_outstanding_transfers(make_agent):
    target, reader, _, local, remote = stalled_link(make_agent, max_inflight=4)
    xfers = [reader.read("target", local, remote) for _ in range(4)]
    with pytest.raises(TransferError, match="4 transfers already in flight"):
        reader.read("target", local, remote)
    assert reader.inflight == 4
    wait_until(lambda: all(x.done() for x in xfers), WAIT_S, "reads", drive=[target])
    reader.read("target", local, remote)  # room again
    wait_until(lambda: reader.inflight == 0, WAIT_S, "last read", drive=[target])


def test_deregister_refuses_while_transfers_are_in_flight(make_agent):
    target, reader, region, local, remote = stalled_link(make_agent)
    xfer = reader.read("target", local, remote)
    with pytest.raises(RegistrationError, match="1 transfers in flight; wait for them first"):
        reader.deregister(region)
    wait_until(xfer.done, WAIT_S, "read", drive=[target])
    reader.deregister(region)
    assert reader.regions == ()


def test_remove_peer_fails_its_transfers_in_flight(make_agent):
    _, reader, _, local, remote = stalled_link(make_agent)
    xfer = reader.read("target", local, remote)
    reader.remove_peer("target")
    with pytest.raises(TransferError, match="removed by remove_peer"):
        xfer.wait(WAIT_S)
    assert reader.peers == () and reader.inflight == 0


def test_wait_timeout_leaves_the_transfer_running(make_agent):
    target = make_agent("target", progress="poll", ucx_options=TCP)
    reader = make_agent("reader", ucx_options=TCP)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    target.register(src)
    reader.register(dst)
    reader.add_peer(target.metadata())
    xfer = reader.read("target", DescList([dst.ctypes.data], 4096), DescList([src.ctypes.data], 4096))
    with pytest.raises(TransferTimeoutError, match="not complete after waiting 0.05 s"):
        xfer.wait(0.05)
    assert xfer.state is XferState.IN_PROGRESS
    wait_until(xfer.done, WAIT_S, "read", drive=[target])
    np.testing.assert_array_equal(dst, src)


# -- poll mode and asyncio --------------------------------------------------------------------


def test_poll_mode_agents_driven_by_the_caller(make_agent):
    pair = connect(make_agent, progress="poll")
    a, b = pair.a, pair.b
    pair.buf_b[:8192] = 3
    xfer = b.write("a", pair.desc_b([0], 8192), pair.desc_a([8192], 8192), notify=b"w")
    wait_until(xfer.done, WAIT_S, "write with notification", drive=[a, b])
    xfer.wait(0)
    assert (pair.buf_a[8192:16384] == 3).all()
    notes: list = []
    wait_until(lambda: bool(notes.extend(a.get_notifications()) or notes), WAIT_S, "notification", drive=[b])
    assert [(n.peer, n.payload) for n in notes] == [("b", b"w")]


@pytest.mark.parametrize("progress", ["thread", "poll"])
def test_transfers_are_awaitable(make_agent, progress):
    pair = connect(make_agent, progress=progress)

    async def main():  # in poll mode b's awaits drive b; a task drives the target a
        stop = asyncio.Event()

        async def drive_a():
            while not stop.is_set():
                if progress == "poll":
                    pair.a.progress()
                await asyncio.sleep(0)

        driver = asyncio.create_task(drive_a())
        xfers = [pair.b.read("a", pair.desc_b([i * 4096], 4096), pair.desc_a([i * 4096], 4096)) for i in range(16)]
        done = await asyncio.wait_for(asyncio.gather(*xfers), WAIT_S)
        stop.set()
        await driver
        return done

    done = asyncio.run(main())
    assert all(x.state is XferState.DONE for x in done)
    np.testing.assert_array_equal(pair.buf_b[: 16 * 4096], pair.buf_a[: 16 * 4096])


def test_awaiting_a_failed_transfer_raises(make_agent):
    target = make_agent("target", progress="poll", ucx_options=TCP)
    reader = make_agent("reader", ucx_options=TCP)
    src = np.zeros(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    target.register(src)
    reader.register(dst)
    reader.add_peer(target.metadata())

    async def main():
        xfer = reader.read("target", DescList([dst.ctypes.data], 4096), DescList([src.ctypes.data], 4096),
                           timeout_s=0.2)
        await asyncio.wait_for(xfer, WAIT_S)

    with pytest.raises(TransferTimeoutError):
        asyncio.run(main())


# -- close -----------------------------------------------------------------------------------------


def test_every_public_method_raises_closed_error_after_close(make_agent):
    pair = connect(make_agent)
    a, b = pair.a, pair.b
    region = b.regions[0]
    local = b.prep_local(pair.desc_b([0], 64))
    remote = b.prep_remote("a", pair.desc_a([0], 64))
    done = b.read("a", pair.desc_b([0], 64), pair.desc_a([0], 64)).wait(WAIT_S)
    a_md = a.metadata()
    b.close()
    b.close()  # idempotent
    calls = {
        "register": lambda: b.register(np.zeros(16, dtype=np.uint8)),
        "deregister": lambda: b.deregister(region),
        "metadata": b.metadata,
        "add_peer": lambda: b.add_peer(a_md),
        "remove_peer": lambda: b.remove_peer("a"),
        "prep_local": lambda: b.prep_local(pair.desc_b([0], 64)),
        "prep_remote": lambda: b.prep_remote("a", pair.desc_a([0], 64)),
        "read": lambda: b.read("a", pair.desc_b([0], 64), pair.desc_a([0], 64)),
        "write": lambda: b.write("a", pair.desc_b([0], 64), pair.desc_a([0], 64)),
        "read_prepared": lambda: b.read_prepared(local, [0], remote, [0]),
        "write_prepared": lambda: b.write_prepared(local, [0], remote, [0]),
        "flush": lambda: b.flush("a"),
        "get_notifications": b.get_notifications,
        "progress": b.progress,
    }
    silent = []
    for name, call in calls.items():
        try:
            call()
        except ClosedError as exc:
            assert "agent 'b' is closed" in str(exc), name
        else:
            silent.append(name)
    assert not silent, f"no ClosedError after close() from: {silent}"
    assert done.state is XferState.DONE  # completed handles stay completed
    assert (b.peers, b.regions, b.inflight) == ((), (), 0)


def test_close_fails_transfers_in_flight(make_agent):
    target = make_agent("target", progress="poll", ucx_options=TCP)  # never driven: the read stalls
    reader = make_agent("reader", ucx_options=TCP)
    src = np.zeros(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    target.register(src)
    reader.register(dst)
    reader.add_peer(target.metadata())
    xfer = reader.read("target", DescList([dst.ctypes.data], 4096), DescList([src.ctypes.data], 4096))
    failed = threading.Event()
    xfer.add_done_callback(lambda x: failed.set())
    reader.close()
    assert failed.is_set() and xfer.state is XferState.FAILED
    with pytest.raises(TransferError, match="aborted: agent 'reader' was closed"):
        xfer.wait(0)


def test_context_manager_closes():
    from rdma_kv.transport import Agent, AgentConfig

    with Agent("cm", AgentConfig(ucx_options={"NET_DEVICES": "lo"})) as agent:
        agent.register(np.zeros(4096, dtype=np.uint8))
    with pytest.raises(ClosedError):
        agent.metadata()


def test_closing_the_target_does_not_hang_the_reader(make_agent):
    pair = connect(make_agent)
    pair.a.close()
    # The reader may or may not notice at once; either way it fails or completes, bounded.
    try:
        pair.b.read("a", pair.desc_b([0], 4096), pair.desc_a([0], 4096), timeout_s=2.0).wait(WAIT_S)
    except (TransferError, PeerError):
        pass
    pair.b.close()


def test_invalid_ucx_option_is_a_config_error(make_agent):
    with pytest.raises(ConfigError, match="UCX option NO_SUCH_OPTION='1' rejected"):
        make_agent("opt", ucx_options={"NO_SUCH_OPTION": "1"})


def test_defaults_this_ucx_does_not_know_are_skipped_not_fatal(monkeypatch):
    """NIXL's defaults include an option of UCX's IB module; a UCX without
    verbs (the libucx wheel) does not know it, and the context still starts
    with the others. The same option passed explicitly is an error there."""
    from rdma_kv.transport import ucx

    for key in ucx.DEFAULT_OPTIONS:
        monkeypatch.delenv(f"UCX_{key}", raising=False)
    monkeypatch.setitem(ucx.DEFAULT_OPTIONS, "NO_SUCH_DEFAULT", "1")
    context = ucx.Context({"NET_DEVICES": "lo"})
    try:
        assert "NO_SUCH_DEFAULT" in context.skipped_defaults
        assert not {"RNDV_THRESH", "MAX_RMA_RAILS", "MAX_HCA_PER_GPU"} & set(context.skipped_defaults)
    finally:
        context.close()
    with pytest.raises(ConfigError, match="NO_SUCH_DEFAULT='1' rejected"):
        ucx.Context({"NET_DEVICES": "lo", "NO_SUCH_DEFAULT": "1"})


def test_engine_threads_post_and_wait_concurrently(pair: Pair, rng):
    """Several threads share one agent (as an engine's threads do): each reads
    random 4 KiB blocks of a's buffer into its own slice of b's, 40 times."""
    threads_n, block, rounds = 4, 4096, 40
    slice_nbytes = PAIR_NBYTES // threads_n
    seeds = rng.integers(0, 2**32, threads_n)
    errors: list[BaseException] = []
    start = threading.Barrier(threads_n)

    def worker(t: int) -> None:
        trng = np.random.default_rng(seeds[t])
        base = t * slice_nbytes
        try:
            start.wait(WAIT_S)
            for _ in range(rounds):
                n = int(trng.integers(1, slice_nbytes // block))
                local_off = base + trng.permutation(slice_nbytes // block)[:n].astype(np.uint64) * block
                remote_off = trng.permutation(PAIR_NBYTES // block)[:n].astype(np.uint64) * block
                pair.b.read("a", pair.desc_b(local_off, block), pair.desc_a(remote_off, block)).wait(WAIT_S)
                for lo, ro in zip(local_off.tolist(), remote_off.tolist()):
                    if not np.array_equal(pair.buf_b[lo:lo + block], pair.buf_a[ro:ro + block]):
                        raise AssertionError(f"thread {t}: block at {lo} does not hold remote {ro}")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,), name=f"engine-{t}") for t in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers), "a posting thread hung"
    assert not errors, errors[0]
    assert pair.b.inflight == 0
    assert pair.b.stats.transfers == threads_n * rounds and pair.b.stats.failed == 0


def test_prepared_reads_merge_runs_but_never_across_adjacent_regions(make_agent):
    """The C gather-merge-post loop: contiguous slots become one op, but two
    regions that happen to be adjacent in memory are never merged into one."""
    a, b = make_agent("a"), make_agent("b")
    half, block = 64 * 1024, 4096
    src = np.random.default_rng(7).integers(0, 256, 2 * half, dtype=np.uint8)
    dst = np.zeros(2 * half, dtype=np.uint8)
    a.register(src)
    b.register((dst.ctypes.data, half))          # two regions, adjacent in memory
    b.register((dst.ctypes.data + half, half))
    b.add_peer(a.metadata())
    a.add_peer(b.metadata())
    slots = np.arange(2 * half // block, dtype=np.uint64) * block
    local = b.prep_local(DescList(dst.ctypes.data + slots, block))
    remote = b.prep_remote("a", DescList(src.ctypes.data + slots, block))
    assert not local.single_region
    every = np.arange(len(slots))
    xfer = b.read_prepared(local, every, remote, every).wait(WAIT_S)
    assert xfer.ops_posted == 2 and xfer.num_descs == len(slots)  # one run per local region
    np.testing.assert_array_equal(dst, src)
    dst[:] = 0
    gaps = np.array([0, 1, 3, 4, 5], dtype=np.int32)              # runs {0,1} and {3,4,5}
    xfer = b.read_prepared(local, gaps, remote, gaps).wait(WAIT_S)
    assert xfer.ops_posted == 2 and xfer.nbytes == 5 * block
    for s in gaps.tolist():
        np.testing.assert_array_equal(dst[s * block:(s + 1) * block], src[s * block:(s + 1) * block])
    assert not dst[2 * block:3 * block].any()


def test_a_prepared_list_inside_one_region_other_than_the_first_keeps_its_region(make_agent):
    """The C loop reads a missing region table as region 0 for every slot; a
    list wholly inside region 1 must still hand it region 1 (its memory
    handle and remote key: on verbs the wrong one is a protection error)."""
    a, b = make_agent("a"), make_agent("b")
    first, second = np.zeros(1 << 16, dtype=np.uint8), np.random.default_rng(5).integers(0, 256, 1 << 16, np.uint8)
    a.register(first)
    a.register(second)  # a's region 1
    b.register(np.zeros(1 << 12, dtype=np.uint8))  # b's region 0 (the registration keeps it alive)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    b.register(dst)  # b's region 1
    b.add_peer(a.metadata())
    slots = np.arange(16, dtype=np.uint64) * 4096
    local = b.prep_local(DescList(dst.ctypes.data + slots, 4096))
    remote = b.prep_remote("a", DescList(second.ctypes.data + slots, 4096))
    for prepared in (local, remote):
        assert prepared.single_region and prepared.c_tables[2] != load()[0].NULL
        assert prepared.c_tables[2][0] == 1
    every = np.arange(16)
    b.read_prepared(local, every, remote, every).wait(WAIT_S)
    np.testing.assert_array_equal(dst, second)


def test_thread_mode_is_pumped_in_c_and_burns_no_core_while_idle(make_agent):
    """progress="thread": a C pump progresses the worker and the Python
    thread sleeps on an eventfd; after the work is done neither spins."""
    pair = connect(make_agent, progress="thread")
    assert pair.b._core.driver.pump is not None and pair.b._core.wake.fd >= 0 and not pair.b.manual_progress
    xfer = pair.b.read("a", pair.desc_b([0], 4096), pair.desc_a([0], 4096)).wait(WAIT_S)
    assert xfer.state is XferState.DONE
    time.sleep(0.05)  # past the pumps' spin window
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    # Two agents, each a pump and a service thread: a spinning one alone would use ~100% of a core.
    assert cpu < 0.25 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s idle"
    np.testing.assert_array_equal(pair.buf_b[:4096], pair.buf_a[:4096])


@pytest.mark.parametrize("field,value,message", [
    ("progress", "busy", "progress='busy' is not valid; valid values: thread, poll"),
    ("spin_s", -0.001, "spin_s must be >= 0 seconds"),
    ("spin_s", float("nan"), "spin_s must be >= 0 seconds, got nan"),
    ("close_drain_s", -1, "close_drain_s must be >= 0"),
    ("settle_delay_s", -0.001, "settle_delay_s must be between 0 and 1 second, got -0.001"),
    ("settle_delay_s", float("nan"), "settle_delay_s must be between 0 and 1 second, got nan"),
    ("settle_delay_s", 1.5, "settle_delay_s must be between 0 and 1 second, got 1.5"),
    ("transfer_timeout_s", 0, "transfer_timeout_s must be > 0"),
    ("max_inflight", 0, "max_inflight must be >= 1"),
    ("notif_slots", 0, "notif_slots must be >= 1"),
])
def test_agent_settings_are_checked(field, value, message):
    with pytest.raises(ConfigError, match=message):
        AgentConfig(**{field: value})


def test_cuda_ipc_get_zero_copy_is_asked_for_and_skipped_where_ucx_has_no_cuda_module(monkeypatch):
    """Pull is made of gets: rdma-kv asks UCX for cuda_ipc's get zero-copy
    (off by default without NVLink: GPU -> GPU then ran over TCP emulation
    at 0.31 GB/s on an H200, deploy.md section 5). Where UCX loaded no
    CUDA module (this host: no driver) the default is skipped, not fatal;
    the operator's environment wins over it."""
    from rdma_kv.transport import ucx
    from rdma_kv.selftest.run import gpu_driver

    assert ucx.DEFAULT_OPTIONS["CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    assert ucx.effective_options({})["CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    context = ucx.Context({})
    try:
        skipped = "CUDA_IPC_ENABLE_GET_ZCOPY" in context.skipped_defaults
        assert skipped == (gpu_driver() is None), context.skipped_defaults
    finally:
        context.close()
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    assert "CUDA_IPC_ENABLE_GET_ZCOPY" not in ucx.effective_options({})


def test_the_setting_a_context_takes_is_named_in_one_place(monkeypatch):
    """``ucx_setting``: what the diagnostics (info, the selftest, a
    memory-type mismatch) name as the context's value of a UCX setting,
    in the order the context applies them: its options, rdma-kv's default
    unless the environment sets it, the environment, else UCX's default."""
    from rdma_kv.transport.ucx import ucx_setting

    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_RNDV_THRESH", raising=False)
    assert ucx_setting({}, "TLS") is None and ucx_setting(None, "TLS") is None
    monkeypatch.setenv("UCX_TLS", "")
    assert ucx_setting({}, "TLS") == ""  # set, if empty: not UCX's default
    monkeypatch.setenv("UCX_TLS", "rc,sm,self")
    assert ucx_setting({}, "TLS") == "rc,sm,self"
    assert ucx_setting({"TLS": "tcp"}, "TLS") == "tcp"
    assert ucx_setting({}, "RNDV_THRESH") == "inf"  # rdma-kv's default
    monkeypatch.setenv("UCX_RNDV_THRESH", "8k")
    assert ucx_setting({}, "RNDV_THRESH") == "8k"
    assert ucx_setting({"RNDV_THRESH": "16k"}, "RNDV_THRESH") == "16k"


def test_read_and_write_say_what_they_take(pair):
    """Lists of (address, length) are not descriptors: a TypeError naming
    DescList, not an AttributeError from inside the post."""
    with pytest.raises(TypeError, match=r"take DescList local and remote descriptors, got list: make one with"):
        pair.b.read("a", [(pair.buf_b.ctypes.data, 64)], pair.desc_a([0], 64))
    with pytest.raises(TypeError, match="got tuple"):
        pair.b.write("a", pair.desc_b([0], 64), ((pair.buf_a.ctypes.data, 64),))


def test_a_timeout_past_the_clocks_range_means_no_deadline(pair):
    """A timeout_s just under 2**64 ns (585 years) fits the call, but added to
    the clock it wrapped past 2**64: the transfer was already late when
    posted, expired at once, and its peer was failed. The deadline now
    saturates."""
    assert time.monotonic_ns() > 2**40  # the clock's reading is what wraps it
    with pumps_held(pair.b):  # the read stays in flight until its deadline is looked at
        xfer = pair.b.read("a", pair.desc_b([0], 4096), pair.desc_a([0], 4096), timeout_s=(2**64 - 2**40) / 1e9)
        assert pair.b._core.inflight.next_deadline() > time.monotonic() + 1e9  # (it was 18 minutes in the past)
    xfer.wait(timeout_s=10)
    np.testing.assert_array_equal(pair.buf_b[:4096], pair.buf_a[:4096])
    pair.b.read("a", pair.desc_b([4096], 4096), pair.desc_a([4096], 4096)).wait(timeout_s=10)  # the peer is fine


class VanishingDevice:
    """``Worker`` for the agent's own worker, failing the first ``fails``
    times as UCX does when a network interface it listed at ``ucp_init`` was
    deleted before the worker opened it."""

    def __init__(self, fails: int, status_name_: str = "UCS_ERR_NO_DEVICE"):
        from rdma_kv.transport.ucx import Worker

        self.real, self.fails, self.calls = Worker, fails, 0
        self.status = getattr(load()[1], status_name_)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.fails:
            raise UCXError(f"ucp_worker_create failed: {status_name(self.status)}", self.status,
                           status_name(self.status))
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("fails, status, made", [
    (2, "UCS_ERR_NO_DEVICE", True),  # made again, with a fresh context, until the device list holds
    (3, "UCS_ERR_NO_DEVICE", False),  # a device that stays missing still fails, after 3 attempts
    (1, "UCS_ERR_INVALID_PARAM", False),  # any other failure is not retried
])
def test_an_agent_is_made_again_when_a_device_vanished_while_ucx_opened_it(make_agent, monkeypatch, caplog,
                                                                            fails, status, made):
    import rdma_kv.transport.agentcore as agentcore

    worker = VanishingDevice(fails, status)
    monkeypatch.setattr(agentcore, "Worker", worker)
    if made:
        a, b = make_agent("a"), make_agent("b")
        src, buf = np.full(4096, 7, np.uint8), np.zeros(4096, np.uint8)
        a.register(src)
        b.register(buf)
        b.add_peer(a.metadata())
        b.read("a", DescList([buf.ctypes.data], 4096), DescList([src.ctypes.data], 4096)).wait(WAIT_S)
        assert (buf == 7).all()
        assert worker.calls == fails + 2  # a's three attempts, then b's one
        assert "making the agent again (attempt 3 of 3)" in caplog.text.lower()
    else:
        with pytest.raises(UCXError, match=status_name(worker.status)):
            make_agent("a")
        assert worker.calls == (3 if status == "UCS_ERR_NO_DEVICE" else 1)
