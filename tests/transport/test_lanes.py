"""Lanes (``AgentConfig(lanes=N)``): one prepared transfer striped over
several UCX workers of one context by one C call. Bit-exact wherever the
byte stream is cut (descriptors are cut too); still one batch that resolves
once every operation on every worker has; a failed lane endpoint fails the
peer for the whole agent; lanes are pumped by C threads; close() drains,
then takes the lanes down; small transfers stay on one worker, notifying
ones stripe too.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from rdma_kv.errors import ConfigError, DescriptorError, PeerError, TransferError, TransferTimeoutError
from rdma_kv.transport import AgentConfig, DescList, XferState, stall
from rdma_kv.transport._lib import load
from transport_child import Child
from transport_helpers import (LOOPBACK, PAIR_NBYTES, TCP, collect_notifications, connect, link, pattern, polled,
                               prepare_slots, progress_threads, wait_until)

pytestmark = [pytest.mark.ucx]

BLOCK = 4096
SLOTS = PAIR_NBYTES // BLOCK
WAIT_S = 20.0


def prepared(pair):
    return prepare_slots(pair, BLOCK)


def runs(li: np.ndarray, ri: np.ndarray) -> int:
    return 1 + int(np.count_nonzero((np.diff(li) != 1) | (np.diff(ri) != 1)))


@pytest.mark.parametrize("progress", ["poll", "thread"])
@pytest.mark.parametrize("lanes", [2, 3])
def test_striped_reads_are_bit_exact_and_use_every_worker(make_agent, rng, progress, lanes):
    pair = connect(make_agent, lanes=lanes, lane_min_bytes=16 * BLOCK, progress=progress)
    local, remote = prepared(pair)
    for trial in range(20):
        n = int(rng.integers(lanes * 16, SLOTS))
        li = rng.permutation(SLOTS)[:n]
        ri = np.sort(rng.choice(SLOTS, n, replace=False)) if trial % 2 else rng.permutation(SLOTS)[:n]
        pair.buf_b[:] = 0
        # int32 block tables are read as they are, on either side.
        li_arg = li.astype(np.int32) if trial % 3 == 1 else li
        ri_arg = ri.astype(np.int32) if trial % 3 == 2 else ri
        xfer = pair.b.read_prepared(local, li_arg, remote, ri_arg).wait(WAIT_S)
        assert xfer.state is XferState.DONE and xfer.nbytes == n * BLOCK and xfer.num_descs == n
        assert len(xfer.worker_ops) == lanes and min(xfer.worker_ops) > 0
        assert sum(xfer.worker_ops) == xfer.ops_posted
        # Cuts fall on 4 KiB (= block) boundaries: a run cut by one is posted once per part it touches.
        assert runs(li, ri) <= xfer.ops_posted <= runs(li, ri) + lanes - 1
        got = pair.buf_b.reshape(SLOTS, BLOCK)
        np.testing.assert_array_equal(got[li], pair.buf_a.reshape(SLOTS, BLOCK)[ri])
        untouched = np.setdiff1d(np.arange(SLOTS), li)
        assert not got[untouched].any()
    assert pair.b.stats.transfers == 20 and pair.b.stats.failed == 0
    assert pair.b.inflight == 0


def test_one_large_descriptor_is_cut_across_the_workers(make_agent):
    """One 1 MiB descriptor: the byte stream is cut at 4 KiB boundaries,
    one operation per worker."""
    pair = connect(make_agent, lanes=3, lane_min_bytes=BLOCK)
    xfer = pair.b.read_prepared(pair.b.prep_local(pair.desc_b([0], PAIR_NBYTES)), [0],
                                pair.b.prep_remote("a", pair.desc_a([0], PAIR_NBYTES)), [0]).wait(WAIT_S)
    assert xfer.worker_ops == (1, 1, 1) and xfer.ops_posted == 3
    np.testing.assert_array_equal(pair.buf_b, pair.buf_a)


@pytest.mark.parametrize("lanes", [2, 3])
def test_any_descriptor_mix_is_bit_exact_wherever_it_is_cut(make_agent, rng, lanes):
    """Random lengths (not multiples of 4 KiB), random places on both sides,
    random order: every destination byte comes from its source byte, bytes
    outside the descriptors stay untouched, however the stream is cut."""
    pair = connect(make_agent, lanes=lanes, lane_min_bytes=1)
    for _ in range(40):
        n = int(rng.integers(1, 12))
        lengths = rng.integers(1, 40_000, n)
        # Disjoint destination spans in a random order, sources anywhere (they may overlap).
        order = rng.permutation(n)
        gaps = rng.integers(0, 5000, n)
        starts = np.empty(n, dtype=np.int64)
        pos = 0
        for k in order:
            pos += int(gaps[k])
            starts[k] = pos
            pos += int(lengths[k])
        assert pos <= PAIR_NBYTES
        sources = np.array([int(rng.integers(0, PAIR_NBYTES - ln + 1)) for ln in lengths])
        local = pair.b.prep_local(DescList(pair.buf_b.ctypes.data + starts, lengths))
        remote = pair.b.prep_remote("a", DescList(pair.buf_a.ctypes.data + sources, lengths))
        idx = rng.permutation(n)
        pair.buf_b[:] = 0
        xfer = pair.b.read_prepared(local, idx, remote, idx).wait(WAIT_S)
        assert xfer.nbytes == int(lengths.sum()) and sum(xfer.worker_ops) == xfer.ops_posted
        assert xfer.ops_posted <= n + lanes - 1  # a cut adds at most one operation
        want = np.zeros(PAIR_NBYTES, dtype=np.uint8)
        for k in range(n):
            want[starts[k]:starts[k] + lengths[k]] = pair.buf_a[sources[k]:sources[k] + lengths[k]]
        np.testing.assert_array_equal(pair.buf_b, want)


def test_small_transfers_stay_on_one_worker_and_notifying_ones_stripe(make_agent):
    pair = connect(make_agent, lanes=2, lane_min_bytes=64 * BLOCK)
    local, remote = prepared(pair)
    small = np.arange(100)  # 400 KiB < 2 x 256 KiB
    assert pair.b.read_prepared(local, small, remote, small).wait(WAIT_S).worker_ops is None
    assert pair.b.read_prepared(local, small, remote, small, notify=b"small").wait(WAIT_S).worker_ops is None
    big = np.arange(200)
    assert len(pair.b.read_prepared(local, big, remote, big).wait(WAIT_S).worker_ops) == 2
    # The notification follows every part (test_notify_stripes checks it never precedes the data).
    xfer = pair.b.read_prepared(local, big, remote, big, notify=b"done").wait(WAIT_S)
    assert len(xfer.worker_ops) == 2
    collect_notifications(pair.a, [b"small"], b"done", WAIT_S)


def test_a_failed_lane_endpoint_fails_the_peer_for_the_whole_agent(make_agent):
    pair = connect(make_agent, lanes=3, lane_min_bytes=BLOCK)
    local, remote = prepared(pair)
    idx = np.arange(64)
    pair.b.read_prepared(local, idx, remote, idx).wait(WAIT_S)
    pair.b._core.lanes[1].fail("a", "injected by the test")
    with pytest.raises(PeerError, match=r"peer 'a' failed \(lane 2's endpoint failed \(injected by the test\)\)"):
        pair.b.read_prepared(local, idx, remote, idx)
    with pytest.raises(PeerError, match="lane 2"):  # the agent's own endpoint is failed too
        pair.b.read_prepared(local, idx, remote, idx)
    assert all(not ln.peers["a"].healthy for ln in pair.b._core.lanes)
    # Re-importing the peer installs fresh endpoints on every lane.
    pair.b.add_peer(pair.a.metadata())
    local, remote = prepared(pair)
    pair.buf_b[:] = 0
    xfer = pair.b.read_prepared(local, idx, remote, idx).wait(WAIT_S)
    assert len(xfer.worker_ops) == 3
    np.testing.assert_array_equal(pair.buf_b[: 64 * BLOCK], pair.buf_a[: 64 * BLOCK])


def test_remove_and_replace_peer_reach_every_lane(make_agent):
    pair = connect(make_agent, lanes=2)
    lane = pair.b._core.lanes[0]
    first = lane.peers["a"]
    pair.b.add_peer(pair.a.metadata())
    # The lane's old endpoint is closed (UCX may hand its address to the new one).
    assert lane.peers["a"] is not first and first.ep is None and lane.peers["a"].healthy
    assert lane.peers["a"].generation == pair.b._core.peers["a"].generation
    pair.b.remove_peer("a")
    assert "a" not in lane.peers and pair.b.peers == () and first.ep is None


def pump_tids() -> set[int]:
    """OS threads of this process named by the shim's pump (C threads:
    invisible to ``threading``)."""
    tids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == "rdma-kv-pump":
                    tids.add(int(task))
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return tids


def pump_threads() -> int:
    return len(pump_tids())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_lanes_pump_is_kept_off_the_posters_cpu(make_agent):
    """The scheduler may wake a lane's pump on the poster's CPU and let it
    preempt the poster, which serialises the copy: before it is signalled,
    a lane's pump is bound to the agent's CPUs minus the poster's."""
    allowed = os.sched_getaffinity(0)
    pair = connect(make_agent, lanes=2, lane_min_bytes=BLOCK, progress="poll")
    (lane,) = pair.b._core.lanes
    lane_pump = lane.pump.tid  # the thread itself, whatever else runs
    assert lane_pump in pump_tids()
    local, remote = prepared(pair)
    idx = np.arange(64)
    try:
        for cpu in sorted(allowed)[:2] * 2:
            os.sched_setaffinity(0, {cpu})  # the calling thread only
            xfer = pair.b.read_prepared(local, idx, remote, idx).wait(WAIT_S)
            assert min(xfer.worker_ops) > 0  # striped: the lane was signalled
            assert os.sched_getaffinity(lane_pump) == allowed - {cpu}
    finally:
        os.sched_setaffinity(0, allowed)
    np.testing.assert_array_equal(pair.buf_b[: 64 * BLOCK], pair.buf_a[: 64 * BLOCK])


def test_kicked_and_held_pumps_go_back_to_sleep(make_agent, rng):
    """A striped transfer kicks its lanes' pumps awake early (rk_pump_kick)
    and holds each off its worker while its part is posted: every hold is
    released and every kick only buys ``spin_s``, so once the transfers are
    done no pump spins -- a leaked hold would keep one at 100% of a core."""
    pair = connect(make_agent, lanes=3, lane_min_bytes=BLOCK, progress="poll")
    local, remote = prepared(pair)
    for _ in range(30):
        idx = rng.permutation(SLOTS)[: int(rng.integers(8, SLOTS))]
        xfer = pair.b.read_prepared(local, idx, remote, idx).wait(WAIT_S)
        assert len(xfer.worker_ops) == 3 and min(xfer.worker_ops) > 0
    # Kicked, then rejected by the index check: nothing posted, nothing held.
    with pytest.raises(DescriptorError, match=f"index {SLOTS} out of range"):
        pair.b.read_prepared(local, np.arange(SLOTS), remote, np.append(np.arange(SLOTS - 1), SLOTS))
    time.sleep(0.05)  # past the spin window
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert cpu < 0.25 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s idle after striped transfers"


def test_steering_keeps_to_the_cpus_the_agent_was_made_with(make_agent):
    """An agent made by a thread bound to one CPU keeps its lanes there
    (an operator's binding wins; steering never widens it), and the
    transfer still completes."""
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    before = pump_tids()
    os.sched_setaffinity(0, {cpu})
    try:
        pair = connect(make_agent, lanes=2, lane_min_bytes=BLOCK, progress="poll")
        pumps = pump_tids() - before
        local, remote = prepared(pair)
        idx = np.arange(64)
        xfer = pair.b.read_prepared(local, idx, remote, idx).wait(WAIT_S)
        assert min(xfer.worker_ops) > 0
        assert all(os.sched_getaffinity(t) == {cpu} for t in pumps)
    finally:
        os.sched_setaffinity(0, allowed)
    np.testing.assert_array_equal(pair.buf_b[: 64 * BLOCK], pair.buf_a[: 64 * BLOCK])


def test_lanes_are_pumped_by_c_threads_not_python_threads(make_agent):
    """A lane's worker is progressed by a C thread that never takes the
    interpreter lock; the agent alone settles the lanes' completions."""
    before, python_before = pump_threads(), {t.name for t in progress_threads()}
    pair = connect(make_agent, lanes=3, progress="poll")  # a and b: two lanes each
    assert pump_threads() == before + 4
    assert {t.name for t in progress_threads()} == python_before  # polling agents, pumped lanes: none new
    assert all(ln.pump is not None for ln in pair.b._core.lanes)
    with polled([pair.a]):  # its owner drives it (else b's close waits for a, ~2 s per endpoint)
        pair.b.close()
    assert pump_threads() == before + 2
    assert all(ln.pump is None for ln in pair.b._core.lanes)


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_split_reads_posted_from_several_threads_at_once(make_agent, progress):
    """Parts complete on the pumps while other threads post on the same
    lanes: the shared counts (batch pending, completion ring) must neither
    lose nor double a completion."""
    pair = connect(make_agent, lanes=3, lane_min_bytes=4 * BLOCK, progress=progress)
    local, remote = prepared(pair)
    posters, rounds, batch = 4, 10, 4  # each poster keeps `batch` transfers in flight
    share = SLOTS // posters // batch
    errors: list[BaseException] = []
    done = []

    def poster(k: int) -> None:
        pick = np.random.default_rng(k)
        try:
            mine = np.arange(k * share * batch, (k + 1) * share * batch).reshape(batch, share)
            for _ in range(rounds):
                # Random remote slots: one operation per descriptor, many per part.
                srcs = [pick.permutation(SLOTS)[:share] for _ in mine]
                xfers = [pair.b.read_prepared(local, m, remote, src) for m, src in zip(mine, srcs)]
                for m, src, xfer in zip(mine, srcs, xfers):
                    xfer.wait(WAIT_S)
                    got = pair.buf_b.reshape(SLOTS, BLOCK)[m]
                    np.testing.assert_array_equal(got, pair.buf_a.reshape(SLOTS, BLOCK)[src])
                    done.append(len(xfer.worker_ops))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=poster, args=(k,)) for k in range(posters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert done == [3] * (posters * rounds * batch)
    assert pair.b.inflight == 0 and pair.b.stats.transfers == posters * rounds * batch
    # Every transfer was published exactly once, on the agent's ring (a lane has none).
    ctx = pair.b._core.inflight.ctx
    assert ctx.done_head == ctx.done_tail == ctx.done_claim == pair.b.stats.transfers


def test_close_takes_the_lanes_and_their_threads_down(make_agent):
    before = pump_threads()
    pair = connect(make_agent, lanes=3, lane_min_bytes=BLOCK)
    local, remote = prepared(pair)
    idx = np.arange(SLOTS)
    xfers = [pair.b.read_prepared(local, idx, remote, idx) for _ in range(8)]
    lanes = list(pair.b._core.lanes)
    pair.b.close()
    assert all(x.state is not XferState.IN_PROGRESS for x in xfers)
    for x in xfers:  # each one either landed or failed with the close as its reason
        assert x.error is None or "closed" in str(x.error)
    assert all(ln.worker.handle is None and ln.pump is None and not ln.peers for ln in lanes)
    assert pump_threads() == before + 3  # a's: its own worker's (progress="thread") and two lanes'


def test_lane_settings_are_checked():
    with pytest.raises(ConfigError, match="lanes must be 1..16, got 0"):
        AgentConfig(lanes=0)
    with pytest.raises(ConfigError, match="lanes must be 1..16, got 17"):
        AgentConfig(lanes=17)
    with pytest.raises(ConfigError, match="lane_min_bytes must be >= 1"):
        AgentConfig(lane_min_bytes=0)


# -- two processes --------------------------------------------------------------------------

TRANSPORTS = {
    "default": (LOOPBACK, {"UCX_NET_DEVICES": "lo"}),
    "tcp": (TCP, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),
}
REMOTE_NBYTES = 8 << 20
CHILD_SEED = 77


def start_pair(make_agent, transport: str, timeout_s: float = 30.0):
    options, env = TRANSPORTS[transport]
    child = Child(f"lanes-{transport}", env, [REMOTE_NBYTES], CHILD_SEED)
    reader = make_agent("reader", ucx_options=options, lanes=2, lane_min_bytes=256 << 10,
                        transfer_timeout_s=timeout_s)
    local = np.zeros(REMOTE_NBYTES, dtype=np.uint8)
    reader.register(local)
    reader.add_peer(child.metadata)
    child.call("add_peer", reader.metadata())
    block = 64 << 10
    slots = np.arange(REMOTE_NBYTES // block) * block
    lp = reader.prep_local(DescList.from_regions(local.ctypes.data, slots, block))
    rp = reader.prep_remote(child.name, DescList.from_regions(child.addrs[0], slots, block))
    return child, reader, local, lp, rp, block


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_split_reads_between_processes_are_bit_exact(make_agent, rng, transport):
    child, reader, local, lp, rp, block = start_pair(make_agent, transport)
    try:
        n = REMOTE_NBYTES // block
        remote = pattern(CHILD_SEED, REMOTE_NBYTES).reshape(n, block)
        for _ in range(5):
            li, ri = rng.permutation(n), rng.permutation(n)
            local[:] = 0
            xfer = reader.read_prepared(lp, li, rp, ri).wait(WAIT_S)
            assert len(xfer.worker_ops) == 2
            np.testing.assert_array_equal(local.reshape(n, block)[li], remote[ri])
    finally:
        child.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_striped_transfer_to_a_stopped_peer_fails_on_every_worker(make_agent):
    """Over TCP a SIGSTOPped peer serves no get: each transfer fails at its
    deadline. Failing the peer force-closes its endpoints on every lane too,
    so UCX hands back the lanes' operations as well as the agent's own: the
    batch records the agent keeps for them (zombies: UCX may still write
    them) are all released, and the peer is refused everywhere after."""
    child, reader, local, lp, rp, block = start_pair(make_agent, "tcp", timeout_s=1.5)
    try:
        n = REMOTE_NBYTES // block
        idx = np.arange(n)
        reader.read_prepared(lp, idx, rp, idx, timeout_s=WAIT_S).wait(WAIT_S)  # wired up (not under 1.5 s)
        child.stop()
        resolved: list[int] = []
        xfers = [reader.read_prepared(lp, idx, rp, idx[::-1]) for _ in range(3)]
        for x in xfers:
            assert len(x.worker_ops) == 2 and min(x.worker_ops) > 0
            x.add_done_callback(lambda x: resolved.append(x.id))
        for x in xfers:
            with pytest.raises(TransferError) as err:
                x.wait(WAIT_S)
            assert isinstance(err.value, TransferTimeoutError) or "lanes-tcp" in str(err.value)
        # wait() returns once a transfer is settled; the service thread, which
        # expired them, runs their callbacks after that.
        wait_until(lambda: len(resolved) == len(xfers), WAIT_S, "every completion callback")
        assert sorted(resolved) == sorted(x.id for x in xfers)
        assert reader.inflight == 0 and reader.stats.failed == 3
        # Without the lanes' endpoints closed, their gets would stay queued and these never clear.
        wait_until(lambda: not reader._core.inflight.zombies, WAIT_S, "every cancelled operation handed back")
        assert all(not lane.peers[child.name].healthy for lane in reader._core.lanes)
        with pytest.raises(PeerError):
            reader.read_prepared(lp, idx, rp, idx)
    finally:
        child.terminate()



@pytest.mark.parametrize("op", ["read", "write"])
def test_explicit_transfers_are_striped_too(make_agent, rng, op):
    """read()/write() with explicit descriptors: large ones are striped like
    prepared ones (the merged runs as tables), bit-exact wherever the stream
    is cut, with a notification too."""
    pair = connect(make_agent, lanes=3, lane_min_bytes=16 * BLOCK)
    src, dst = (pair.a, pair.b) if op == "read" else (pair.b, pair.a)
    src_buf, dst_buf = (pair.buf_a, pair.buf_b) if op == "read" else (pair.buf_b, pair.buf_a)
    src_buf[:] = np.random.default_rng(5).integers(0, 256, PAIR_NBYTES, dtype=np.uint8)
    for trial in range(10):
        n = int(rng.integers(48, SLOTS))
        dst_slots, src_slots = rng.permutation(SLOTS)[:n], rng.permutation(SLOTS)[:n]
        dst_buf[:] = 0
        local_slots, remote_slots = (dst_slots, src_slots) if op == "read" else (src_slots, dst_slots)
        call = pair.b.read if op == "read" else pair.b.write
        xfer = call("a", pair.desc_b(local_slots * BLOCK, BLOCK), pair.desc_a(remote_slots * BLOCK, BLOCK)).wait(WAIT_S)
        assert len(xfer.worker_ops) == 3 and min(xfer.worker_ops) > 0 and sum(xfer.worker_ops) == xfer.ops_posted
        got = dst_buf.reshape(SLOTS, BLOCK)
        np.testing.assert_array_equal(got[dst_slots], src_buf.reshape(SLOTS, BLOCK)[src_slots])
        assert not got[np.setdiff1d(np.arange(SLOTS), dst_slots)].any()
    # One descriptor of the whole buffer: cut into one operation per worker.
    xfer = pair.b.read("a", pair.desc_b([0], PAIR_NBYTES), pair.desc_a([0], PAIR_NBYTES)).wait(WAIT_S)
    assert xfer.worker_ops == (1, 1, 1)
    np.testing.assert_array_equal(pair.buf_b, pair.buf_a)
    notified = pair.b.read("a", pair.desc_b([0], PAIR_NBYTES), pair.desc_a([0], PAIR_NBYTES), notify=b"n")
    assert notified.wait(WAIT_S).worker_ops == (1, 1, 1) and notified.ops_posted == 3
    collect_notifications(pair.a, [], b"n", WAIT_S)
    assert src.stats.failed == dst.stats.failed == 0


def test_a_polling_caller_moves_the_part_of_a_lane_whose_pump_does_not_run(make_agent, rng):
    """A poller whose own worker is idle progresses a lane's worker itself
    (rk_pump_help) while that lane's pump is not progressing it. The pumps
    are held off their workers for the whole test, standing for pumps
    asleep or never scheduled on a loaded host: the striped transfers still
    complete, bit-exact, with every worker carrying a part."""
    pair = connect(make_agent, lanes=3, lane_min_bytes=BLOCK, progress="poll")
    local, remote = prepared(pair)
    lib = load()[1]
    pumps = [lane.pump.handle for lane in pair.b._core.lanes]
    for pump in pumps:
        lib.rk_pump_hold(pump, 1)
    try:
        for k in range(5):
            idx = rng.permutation(SLOTS)[: int(rng.integers(SLOTS // 2, SLOTS))]
            pair.buf_b[:] = 0
            xfer = pair.b.read_prepared(local, idx, remote, idx, notify=b"r%d" % k)
            # done() progresses b (and helps its lanes); a, polling too, must
            # progress for the notification's send to complete.
            wait_until(xfer.done, WAIT_S, f"striped read {k} with every pump held", drive=[pair.a])
            xfer.wait(0)
            assert len(xfer.worker_ops) == 3 and min(xfer.worker_ops) > 0
            got = pair.buf_b.reshape(SLOTS, BLOCK)
            np.testing.assert_array_equal(got[idx], pair.buf_a.reshape(SLOTS, BLOCK)[idx])
    finally:
        for pump in pumps:
            lib.rk_pump_hold(pump, -1)
    collect_notifications(pair.a, [b"r%d" % k for k in range(4)], b"r4", WAIT_S)


def test_the_shim_counts_queued_bytes_for_every_worker_a_config_allows():
    """``rk_ctx_t.queued`` holds one count per worker (own + lanes): a
    config allowing more lanes than it holds would write past it."""
    from rdma_kv.transport._lib import load
    from rdma_kv.transport.lanes import MAX_LANES

    ffi, _ = load()
    queued = dict(ffi.typeof("rk_ctx_t").fields)["queued"]
    assert queued.type.length == MAX_LANES + 1


@pytest.mark.parametrize("held", ["lane", "own"])
def test_the_service_thread_moves_the_work_of_a_pump_that_does_not_run(make_agent, rng, held):
    """progress="thread" with nobody blocked in wait() (the connector waits
    through completion callbacks): a worker whose pump is not given a CPU --
    held off its worker for the whole test, standing for one that is
    runnable but never scheduled, or bound to a CPU the scheduler keeps busy
    (seen under load: a push's writes held 60 s) -- is progressed by the
    service thread once the pump has not run for ``HELP_STALE_NS``: lane 1's
    (striped reads), or the own worker's (no lanes). Without that, the reads
    here pass their deadline."""
    lanes = 2 if held == "lane" else 1
    pair = connect(make_agent, lanes=lanes, lane_min_bytes=BLOCK, progress="thread")
    local, remote = prepared(pair)
    lib = load()[1]
    pump = (pair.b._core.lanes._lanes[0].pump if held == "lane" else pair.b._core.driver.pump).handle
    lib.rk_pump_hold(pump, 1)
    try:
        for k in range(3):
            idx = rng.permutation(SLOTS)[: SLOTS // 2]
            pair.buf_b[:] = 0
            done = threading.Event()
            xfer = pair.b.read_prepared(local, idx, remote, idx, timeout_s=WAIT_S)
            xfer.add_done_callback(lambda x: done.set())
            assert done.wait(WAIT_S), f"read {k} with the {held} pump held never completed"
            assert xfer.state is XferState.DONE, xfer.error
            assert held == "own" or (len(xfer.worker_ops) == 2 and min(xfer.worker_ops) > 0)
            got = pair.buf_b.reshape(SLOTS, BLOCK)
            np.testing.assert_array_equal(got[idx], pair.buf_a.reshape(SLOTS, BLOCK)[idx])
    finally:
        lib.rk_pump_hold(pump, -1)


def test_the_service_thread_answers_peers_for_a_target_whose_pump_does_not_run(make_agent, rng):
    """A target with nothing of its own in flight (a push's decode, a pull's
    producer) whose own pump is not given a CPU: over TCP its worker must
    answer the peer's reads (UCX's TCP get is carried out by the target; a
    peer's endpoints, its lanes' too, all reach the target's own worker),
    and the service thread does so, looking every ``HELP_IDLE_NS`` at
    workers with events waiting, once the pump has not run for
    ``HELP_STALE_NS``. Without that, these reads pass their deadline."""
    pair = link(make_agent("a", progress="thread", ucx_options=TCP),
                make_agent("b", progress="poll", lanes=2, lane_min_bytes=BLOCK, ucx_options=TCP))
    a, b, buf_a, buf_b = pair.a, pair.b, pair.buf_a, pair.buf_b
    local, remote = prepared(pair)
    lib = load()[1]
    pump = a._core.driver.pump.handle
    lib.rk_pump_hold(pump, 1)
    try:
        for k in range(3):
            idx = rng.permutation(SLOTS)[: SLOTS // 2]
            buf_b[:] = 0
            xfer = b.read_prepared(local, idx, remote, idx, timeout_s=WAIT_S)
            wait_until(xfer.done, 2 * WAIT_S, f"read {k}", drive=[b])
            assert xfer.state is XferState.DONE, f"read {k} with the target's pump held: {xfer.error}"
            assert len(xfer.worker_ops) == 2 and min(xfer.worker_ops) > 0  # striped over b's lanes
            np.testing.assert_array_equal(buf_b.reshape(SLOTS, BLOCK)[idx], buf_a.reshape(SLOTS, BLOCK)[idx])
        assert a._core.inflight.live == 0  # the target had nothing of its own in flight
    finally:
        lib.rk_pump_hold(pump, -1)


def test_no_help_round_starts_once_the_agent_is_closing(make_agent):
    """A close stops the pumps and destroys the workers once no thread is
    inside a help round (``rk_pump_help``, which holds the pump); once
    closing is set none starts one. Here the target's pump is held with a
    peer's TCP read waiting on its worker: after what ``close()`` does first
    (``rk_wake_waiters``), helping progresses nothing and the read stays
    unanswered until the pump itself runs."""
    pair = link(make_agent("a", progress="thread", ucx_options=TCP), make_agent("b", progress="poll", ucx_options=TCP))
    local, remote = prepared(pair)
    ffi, lib = load()
    pump, ctx = pair.a._core.driver.pump.handle, pair.a._core.inflight.ctx
    idx = np.arange(SLOTS)
    lib.rk_pump_hold(pump, 1)
    try:
        xfer = pair.b.read_prepared(local, idx, remote, idx, timeout_s=WAIT_S)
        lib.rk_wake_waiters(ctx)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            assert lib.rk_pump_help(pump, 64) == 0
            pair.b.progress()
        assert not xfer.done(), "a help round progressed the worker of an agent that is closing"
        state = ffi.new("uint64_t[5]")
        lib.rk_pump_state(pump, state)
        assert state[0] == 1  # the test's own hold: no help round left one behind
    finally:
        lib.rk_pump_hold(pump, -1)
    wait_until(xfer.done, WAIT_S, "the read, once the target's pump runs", drive=[pair.b])
    assert xfer.state is XferState.DONE, xfer.error


def test_a_transfer_past_its_deadline_logs_what_it_was_waiting_for(make_agent, caplog):
    """The line an operator gets when a transfer expires names the workers
    its parts are on and what each pump was doing. Here the peer never
    answers: ``a`` polls and is never progressed, so the striped TCP read's
    operations cannot complete (UCX's TCP get needs the target's worker)."""
    a = make_agent("a", progress="poll", ucx_options=TCP)
    b = make_agent("b", progress="thread", lanes=2, lane_min_bytes=BLOCK, ucx_options=TCP)
    buf_a, buf_b = np.ones(PAIR_NBYTES, np.uint8), np.zeros(PAIR_NBYTES, np.uint8)
    a.register(buf_a)
    b.register(buf_b)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    with caplog.at_level("WARNING", logger="rdma_kv.transport.agent"):
        xfer = b.read("a", DescList(np.array([buf_b.ctypes.data], np.uint64), PAIR_NBYTES),
                      DescList(np.array([buf_a.ctypes.data], np.uint64), PAIR_NBYTES), timeout_s=0.3)
        wait_until(xfer.done, WAIT_S, "the unanswered read to expire")
    assert xfer.state is XferState.FAILED and isinstance(xfer.error, TransferTimeoutError)
    lines = [r.getMessage() for r in caplog.records if "passed its deadline" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert f"read transfer {xfer.id} with peer 'a' passed its deadline" in line
    outstanding = int(line.split(" of ")[0].rsplit(": ", 1)[1])
    assert 1 <= outstanding <= xfer.ops_posted, line
    tids = [lane.pump.tid for lane in b._core.lanes._lanes] + [b._core.driver.pump.tid]
    for who, tid in zip(("lane 1", "own worker"), tids):
        assert f"{who}: pump " in line and f"thread {tid} state " in line, line
    assert " on CPUs " in line and "waited " in line, line


def test_a_stall_line_says_a_held_pump_is_held(make_agent):
    """``stall.describe`` on a part whose pump a poster holds."""
    b = make_agent("b", progress="thread", lanes=2)
    ffi, lib = load()
    batch = ffi.new("rk_batch_t *", {"pending": 2, "posted": 1, "top": 1, "nparts": 2})
    pumps = ffi.new("rk_pump_t *[]", [b._core.driver.pump.handle, b._core.lanes._lanes[0].pump.handle])
    lib.rk_pump_hold(pumps[1], 1)
    try:
        line = stall.describe(batch[0], pumps, time.monotonic_ns())
    finally:
        lib.rk_pump_hold(pumps[1], -1)
    assert line.startswith("2 of 1 operations outstanding; lane 1: pump held by 1 poster(s)"), line
    assert "; own worker: pump " in line and "held" not in line.split("own worker")[1], line


class SlowToLoop:
    """The shim's library, except that a pump's thread takes a while to
    enter its loop (a thread that waits for a CPU on a loaded host)."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def rk_pump_run(self, handle):
        time.sleep(0.2)
        self._lib.rk_pump_run(handle)


def test_a_pump_is_running_when_its_agent_has_it(make_agent, monkeypatch):
    """A new pump returns once its thread is in the shim's loop: steering
    and the stall reports have its thread id from the first post on (a
    report once read 'thread 0 not readable' for a pump just made)."""
    import rdma_kv.transport.pump as pump_module
    ffi, lib = load()
    monkeypatch.setattr(pump_module, "load", lambda: (ffi, SlowToLoop(lib)))
    b = make_agent("b", progress="thread", lanes=2)
    pumps = [b._core.driver.pump] + [lane.pump for lane in b._core.lanes]
    assert [lib.rk_pump_tid(p.handle) for p in pumps] == [p.tid for p in pumps]
    assert all(p.tid > 0 for p in pumps)
    assert "not yet in its loop" in stall.thread(0)


def test_an_agent_reports_what_its_progress_threads_do(make_agent):
    """``Agent.progress_report``: one entry per worker, naming its pump's
    thread; a polling agent's own worker has none."""
    b = make_agent("b", progress="thread", lanes=3)
    report = b.progress_report()
    parts = report.split("; ")
    assert [p.split(":")[0] for p in parts] == ["own worker", "lane 1", "lane 2"], report
    tids = [b._core.driver.pump.tid] + [lane.pump.tid for lane in b._core.lanes]
    assert all(f"thread {tid} state " in part for tid, part in zip(tids, parts)), report
    polled = make_agent("p", progress="poll", lanes=1)
    assert polled.progress_report() == "own worker: no pump (progressed by its caller)"
