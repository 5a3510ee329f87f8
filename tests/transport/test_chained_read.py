"""Chained reads (``read_prepared(..., then=ChainedRead(...))``): a second
read of the same peer that the shim posts once every operation of the
first completed, on whichever thread completed the last one, and that the
transfer includes. What the held words rest on: the words are read after
the data landed, never before.
"""

from __future__ import annotations

import numpy as np
import pytest

from rdma_kv.errors import DescriptorError, TransferError
from rdma_kv.transport import ChainedRead, DescList
from transport_helpers import PAIR_NBYTES, TCP, link, pumps_held, wait_until

pytestmark = [pytest.mark.ucx]

BLOCK = 4096
WORD = 16
NWORDS = 256
WAIT_S = 20.0


class Chain:
    """Agents a and b (b reads a): the pair's buffers as 4 KiB slots, and
    a's words (16 bytes each, seeded) with b's scratch for them."""

    def __init__(self, make_agent, **config) -> None:
        a, b = make_agent("a", **config), make_agent("b", **config)
        self.words_a = np.random.default_rng(0xC).integers(0, 256, NWORDS * WORD, dtype=np.uint8)
        self.scratch_b = np.zeros(NWORDS * WORD, dtype=np.uint8)
        a.register(self.words_a)
        b.register(self.scratch_b)
        self.pair = pair = link(a, b)
        self.a, self.b = a, b
        slots = np.arange(PAIR_NBYTES // BLOCK) * BLOCK
        self.local = b.prep_local(pair.desc_b(slots, BLOCK))
        self.remote = b.prep_remote(a.name, pair.desc_a(slots, BLOCK))
        w = np.arange(NWORDS, dtype=np.uint64) * WORD
        self.wlocal = b.prep_local(DescList(self.scratch_b.ctypes.data + w, np.full(NWORDS, WORD, np.uint64)))
        self.wremote = b.prep_remote(a.name, DescList(self.words_a.ctypes.data + w, np.full(NWORDS, WORD, np.uint64)))

    def read(self, li, ri, wl, wr, **kw):
        return self.b.read_prepared(self.local, li, self.remote, ri,
                                    then=ChainedRead(self.wlocal, wl, self.wremote, wr), **kw)

    def check(self, li, ri, wl, wr) -> None:
        """b's slots and scratch hold what the read and its chained read moved."""
        buf_a, buf_b = self.pair.buf_a, self.pair.buf_b
        for lo, ro in zip(li, ri):
            assert np.array_equal(buf_b[lo * BLOCK:(lo + 1) * BLOCK], buf_a[ro * BLOCK:(ro + 1) * BLOCK])
        for lo, ro in zip(wl, wr):
            assert np.array_equal(self.scratch_b[lo * WORD:(lo + 1) * WORD], self.words_a[ro * WORD:(ro + 1) * WORD])


@pytest.mark.parametrize("progress", ["thread", "poll"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_chained_read_lands_with_its_read_and_completes_it(make_agent, rng, lanes, progress):
    """Striped (its last part completes on a lane's thread) or whole, pumped
    or polled: both reads land bit-exact, the transfer completes once the
    chained one did, and says it was posted; its own byte and descriptor
    counts are the first read's."""
    c = Chain(make_agent, lanes=lanes, lane_min_bytes=4 * BLOCK, progress=progress)
    nslots = PAIR_NBYTES // BLOCK
    for n in (1, 3, 40, nslots):
        li, ri = rng.permutation(nslots)[:n], rng.permutation(nslots)[:n]
        wl, wr = rng.permutation(NWORDS)[:5], rng.permutation(NWORDS)[:5]
        c.scratch_b[:] = 0
        xfer = c.read(li, ri, wl, wr).wait(WAIT_S)
        assert xfer.chained is True
        assert (xfer.nbytes, xfer.num_descs) == (n * BLOCK, n)
        c.check(li, ri, wl, wr)
    assert c.b.stats.failed == 0


def test_many_chained_reads_in_flight_each_land(make_agent, rng):
    """Dozens in flight at once over two workers: a completion that posts
    a chained read while others complete and their slots are reused never
    mixes up two transfers."""
    c = Chain(make_agent, lanes=2, lane_min_bytes=8 * BLOCK)
    nslots = PAIR_NBYTES // BLOCK
    posted = []
    share = nslots // 64  # each transfer its own local slots
    lperm = rng.permutation(nslots)
    for i in range(64):
        n = int(rng.integers(1, share + 1))
        li, ri = lperm[i * share:i * share + n], rng.permutation(nslots)[:n]
        # each transfer its own scratch words, so that every one can be checked
        wl, wr = np.array([i * 4, i * 4 + 1, i * 4 + 2]), rng.permutation(NWORDS)[:3]
        posted.append((c.read(li, ri, wl, wr), li, ri, wl, wr))
    for xfer, *_ in posted:
        xfer.wait(WAIT_S)
    for xfer, li, ri, wl, wr in posted:
        assert xfer.chained is True
        c.check(li, ri, wl, wr)


def test_the_chained_read_reads_what_the_words_hold_once_the_read_landed(make_agent):
    """Over TCP a read completes only as its target answers, and a polled
    target answers only in its progress calls, so the test decides what
    each answer sees: the data is answered with the words as they were,
    then the words change, then the chained read is answered. Had the
    chained read gone out with the read (or before it landed), its answer
    would hold the words as they were."""
    c = Chain(make_agent, ucx_options=TCP, progress="poll")
    li = ri = np.arange(64)
    wl, wr = np.array([0, 1]), np.array([7, 9])
    xfer = c.read(li, ri, wl, wr)
    slot = c.b._core.inflight.ctx.slots[xfer._slot]
    for _ in range(200_000):  # until the read landed and the chained read went out
        c.a.progress()
        c.b.progress()
        if slot.then_sent or xfer.done():
            break
    assert slot.then_sent and not xfer.done(), "the read should land, its chained read wait for a's answer"
    assert not c.scratch_b.any(), "the chained read went out before its read landed"
    before = c.words_a.copy()
    c.words_a[7 * WORD:8 * WORD] = 0xAB
    wait_until(xfer.done, WAIT_S, "the chained read", drive=[c.a, c.b])
    xfer.wait(0)
    assert xfer.chained is True
    assert (c.scratch_b[:WORD] == 0xAB).all()
    assert np.array_equal(c.scratch_b[WORD:2 * WORD], before[9 * WORD:10 * WORD])
    c.check(li, ri, [], [])


def test_a_read_that_fails_posts_no_chained_read(make_agent):
    """A read that misses its deadline fails the peer: the transfer fails,
    says its chained read was not posted, and nothing lands in the scratch
    later (the late completion of an abandoned read posts nothing)."""
    c = Chain(make_agent, ucx_options=TCP, progress="poll")
    wait_until(c.read(np.arange(2), np.arange(2), [0], [0]).done, WAIT_S, "wire-up", drive=[c.a, c.b])
    c.scratch_b[:] = 0
    xfer = c.read(np.arange(64), np.arange(64), [0, 1], [0, 1], timeout_s=0.05)
    with pytest.raises(TransferError):  # a never answers: the deadline passes
        xfer.wait(WAIT_S)
    assert xfer.chained is False
    for _ in range(50):
        c.a.progress()
        c.b.progress()
    assert not c.scratch_b.any()


def test_a_chained_read_that_fails_fails_its_transfer_after_the_read(make_agent):
    """The read lands, then the chained read's peer is failed under it: the
    transfer fails and says the chained read was posted (the read itself
    landed), which is what tells a caller the data is there but unvouched."""
    c = Chain(make_agent, ucx_options=TCP, progress="poll")
    wait_until(c.read(np.arange(2), np.arange(2), [0], [0]).done, WAIT_S, "wire-up", drive=[c.a, c.b])
    xfer = c.read(np.arange(8), np.arange(8), [0, 1], [0, 1])
    slot = c.b._core.inflight.ctx.slots[xfer._slot]
    for _ in range(200_000):
        c.a.progress()
        c.b.progress()
        if slot.then_sent or xfer.done():
            break
    assert slot.then_sent and not xfer.done()
    c.b.remove_peer(c.a.name)  # the endpoint closes: UCX cancels the chained read
    with pytest.raises(TransferError):
        wait_until(xfer.done, WAIT_S, "the cancelled chained read", drive=[c.b])
        xfer.wait(0)
    assert xfer.chained is True
    assert xfer.abandoned is False  # cancelled by UCX as the endpoint closed: nothing of it lands later
    c.check(np.arange(8), np.arange(8), [], [])


def test_chained_reads_are_checked_before_anything_is_posted(make_agent):
    """Every refusal is an error that names the chained read, and posts
    nothing: an index out of range, unpaired lists, lists of another peer
    or the wrong side, and a chained read behind a write."""
    c = Chain(make_agent)
    idx = np.arange(4)
    posted = c.b.stats.transfers
    with pytest.raises(DescriptorError, match="out of range"):
        c.read(idx, idx, [0], [NWORDS])
    with pytest.raises(DescriptorError, match="pair up"):
        c.read(idx, idx, [0, 1], [0])
    with pytest.raises(DescriptorError, match="same peer"):
        c.b.read_prepared(c.local, idx, c.remote, idx, then=ChainedRead(c.wremote, [0], c.wremote, [0]))
    with pytest.raises(DescriptorError, match="same peer"):
        c.b.read_prepared(c.local, idx, c.remote, idx, then=ChainedRead(c.wlocal, [0], c.wlocal, [0]))
    with pytest.raises(TypeError, match="ChainedRead"):
        c.b.read_prepared(c.local, idx, c.remote, idx, then=(c.wlocal, [0], c.wremote, [0]))
    with pytest.raises(DescriptorError, match="follows a read only"):
        c.b._core.prepared.transfer(*_write(c, idx))
    assert c.b.stats.transfers == posted
    c.read(idx, idx, [0], [0]).wait(WAIT_S)  # and the lists still work
    c.check(idx, idx, [0], [0])


def _write(c: Chain, idx):
    from rdma_kv.transport.inflight import OP_PUT
    from rdma_kv.transport.transfer import XferOp
    return (XferOp.WRITE, OP_PUT, c.local, idx, c.remote, idx, None, None,
            ChainedRead(c.wlocal, [0], c.wremote, [0]))


def test_a_held_lane_holds_back_the_chained_read(make_agent):
    """Striped over the own worker and a lane whose pump is held (and no
    caller helps it): the chained read is not posted while the lane's part
    is in flight, and is once the pump lets go."""
    c = Chain(make_agent, lanes=2, lane_min_bytes=4 * BLOCK, progress="poll", ucx_options=TCP)
    wait_until(c.read(np.arange(16), np.arange(16), [0], [0]).done, WAIT_S, "wire-up", drive=[c.a, c.b])
    driver = c.b._core.driver
    helpers, driver.helpers = driver.helpers, []
    try:
        with pumps_held(c.b):
            xfer = c.read(np.arange(64), np.arange(64), [3], [3])
            slot = c.b._core.inflight.ctx.slots[xfer._slot]
            for _ in range(100):
                c.a.progress()
                c.b.progress()
            parts_done = slot.pending
            assert not xfer.done() and not slot.then_sent, (parts_done, xfer)
    finally:
        driver.helpers = helpers
    wait_until(xfer.done, WAIT_S, "the read and its chained read", drive=[c.a, c.b])
    assert xfer.chained is True
    c.check(np.arange(64), np.arange(64), [3], [3])
