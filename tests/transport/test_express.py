"""Express endpoints (``AgentConfig(express=True)``): a second endpoint to
every peer on every worker, for transfers too small to stripe. UCX serves
an endpoint's operations in order and a worker's endpoints in turn, so a
small request posted after a large one completes before it instead of
after every one of its operations. Both endpoints report to one endpoint
state: failing, replacing and closing a peer take both down.
"""

from __future__ import annotations

import numpy as np
import pytest

from rdma_kv.errors import PeerError
from rdma_kv.transport._lib import load
from transport_helpers import link, wait_until

pytestmark = [pytest.mark.ucx]

BIG_BLOCK = 512 << 10  # one CMA segment per operation
BIG_BLOCKS = 48  # 24 MiB, every other block: no two merge into one operation
SMALL = 512 << 10  # under 2 x lane_min_bytes: not striped, the express endpoint's
NBYTES = 2 * BIG_BLOCKS * BIG_BLOCK + SMALL
WAIT_S = 60.0


def big_and_small(pair):
    """(big, small) read descriptor pairs for ``pair.b`` reading ``pair.a``."""
    offsets = np.arange(BIG_BLOCKS) * 2 * BIG_BLOCK
    big = (pair.desc_b(offsets, BIG_BLOCK), pair.desc_a(offsets, BIG_BLOCK))
    at = np.array([NBYTES - SMALL])
    return big, (pair.desc_b(at, SMALL), pair.desc_a(at, SMALL))


def held_pumps(agent) -> list:
    """Every pump of ``agent`` (its own worker's, its lanes'), to hold off its worker."""
    core = agent._core
    pumps = [core.driver.pump] if core.driver.pump is not None else []
    pumps += [lane.pump for lane in core.lanes if lane.pump is not None]
    return [p.handle for p in pumps]


def completion_order(pair, *, notify: bool = False) -> list[str]:
    """Post the big read, then the small one, right behind it; return the
    order in which they completed. The reader's pumps are held off their
    workers until both are posted, so that a poster preempted between the
    two posts on a loaded host cannot let the big one run to its end first."""
    (bl, br), (sl, sr) = big_and_small(pair)
    lib = load()[1]
    pumps = held_pumps(pair.b)
    for pump in pumps:
        lib.rk_pump_hold(pump, 1)
    try:
        big = pair.b.read("a", bl, br, timeout_s=WAIT_S)
        small = pair.b.read("a", sl, sr, timeout_s=WAIT_S, notify=b"small" if notify else None)
    finally:
        for pump in pumps:
            lib.rk_pump_hold(pump, -1)
    small.wait(WAIT_S)
    big.wait(WAIT_S)
    assert copied(pair)
    # The order of the shim's completion stamps (``finished``: when a pump,
    # or a caller, published the batch complete), not of completion
    # callbacks: in thread mode the service thread and the waiting caller
    # may each settle one and run its callback, in either order, and wait()
    # returns before the settling thread ran the callbacks.
    assert big.finished != small.finished
    return [name for _, name in sorted([(big.finished, "big"), (small.finished, "small")])]


def copied(pair) -> bool:
    """Every byte of both transfers is the same on both sides."""
    ranges = [(off, BIG_BLOCK) for off in np.arange(BIG_BLOCKS) * 2 * BIG_BLOCK] + [(NBYTES - SMALL, SMALL)]
    return all(np.array_equal(pair.buf_a[off:off + n], pair.buf_b[off:off + n]) for off, n in ranges)


@pytest.mark.parametrize("progress", ["poll", "thread"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_small_read_posted_behind_a_large_one_completes_first_on_its_express_endpoint(make_agent, progress,
                                                                                       lanes):
    pair = link(make_agent("a", lanes=1), make_agent("b", progress=progress, lanes=lanes, express=True),
                NBYTES)
    assert pair.b._core.peers.get("a").express
    # Ordered by UCX's service of the two endpoints, not by the clock: one
    # segment of the large read, then the small one's, ..., whatever the load
    # (both are posted before any pump may progress them).
    for _ in range(3):
        pair.buf_b[:] = 0
        assert completion_order(pair) == ["small", "big"]


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_without_express_the_small_read_waits_for_the_large_one(make_agent, progress):
    """The premise: one endpoint serves its operations in order (one worker,
    so both reads share it)."""
    pair = link(make_agent("a", lanes=1), make_agent("b", progress=progress, lanes=1), NBYTES)
    assert not pair.b._core.peers.get("a").express
    pair.buf_b[:] = 0
    assert completion_order(pair) == ["big", "small"]


def test_a_notified_small_write_on_the_express_endpoint_lands_before_its_notification(make_agent):
    pair = link(make_agent("a", lanes=1), make_agent("b", lanes=2, express=True), NBYTES)
    (bl, br), (sl, sr) = big_and_small(pair)
    pair.buf_b[:] = np.random.default_rng(5).integers(0, 256, NBYTES, dtype=np.uint8)
    big = pair.b.write("a", bl, br, timeout_s=WAIT_S)
    small = pair.b.write("a", sl, sr, timeout_s=WAIT_S, notify=b"small-written")
    got: list = []

    def arrived() -> bool:
        got.extend(pair.a.get_notifications())
        return bool(got)

    wait_until(arrived, WAIT_S, "the small write's notification")
    # The notification left after the small write's flush on its endpoint:
    # its bytes are in place, whatever the large write has done so far.
    assert [n.payload for n in got] == [b"small-written"]
    assert np.array_equal(pair.buf_a[NBYTES - SMALL:], pair.buf_b[NBYTES - SMALL:])
    small.wait(WAIT_S)
    big.wait(WAIT_S)
    assert copied(pair)


def test_a_flush_covers_both_endpoints_of_every_worker(make_agent):
    pair = link(make_agent("a", lanes=1), make_agent("b", lanes=2, express=True), NBYTES)
    (bl, br), (sl, sr) = big_and_small(pair)
    pair.buf_b[:] = 7
    pair.b.write("a", bl, br, timeout_s=WAIT_S)
    pair.b.write("a", sl, sr, timeout_s=WAIT_S)
    pair.b.flush("a", timeout_s=WAIT_S).wait(WAIT_S)
    # A flush on both endpoints of every worker (the shim posts one per
    # endpoint): once it is done, every byte of both writes is at the
    # target. (On CMA a put is at the target when it completes, so this
    # checks what a flush must give, not that it was needed.)
    assert np.all(pair.buf_a[NBYTES - SMALL:] == 7)
    assert np.all(pair.buf_a[: BIG_BLOCK] == 7) and np.all(pair.buf_a[(BIG_BLOCKS - 1) * 2 * BIG_BLOCK:][:BIG_BLOCK] == 7)


def test_failing_replacing_and_closing_a_peer_take_its_express_endpoints_down_too(make_agent):
    pair = link(make_agent("a", lanes=1), make_agent("b", lanes=2, express=True), NBYTES)
    b = pair.b
    peers = [b._core.peers.get("a")] + [lane.peers["a"] for lane in b._core.lanes]
    assert all(len(p._eps) == 2 for p in peers)
    (_, _), (sl, sr) = big_and_small(pair)
    b.read("a", sl, sr, timeout_s=WAIT_S).wait(WAIT_S)
    b._core.lanes[0].fail("a", "injected by the test")
    with pytest.raises(PeerError, match="injected by the test"):
        b.read("a", sl, sr)
    assert all(not p._eps for p in peers[1:])  # the lane's endpoint and its twin, closed
    # Re-importing the peer makes both endpoints again on every worker.
    b.add_peer(pair.a.metadata())
    fresh = [b._core.peers.get("a")] + [lane.peers["a"] for lane in b._core.lanes]
    assert all(len(p._eps) == 2 for p in fresh) and not any(p._eps for p in peers)
    pair.buf_b[:] = 0
    b.read("a", sl, sr, timeout_s=WAIT_S).wait(WAIT_S)
    assert np.array_equal(pair.buf_a[NBYTES - SMALL:], pair.buf_b[NBYTES - SMALL:])
    b.remove_peer("a")
    assert not any(p._eps for p in fresh)
