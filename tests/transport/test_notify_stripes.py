"""Notified transfers striped over lanes, or spread whole over them: the
notification goes out once every part on every worker has completed (for a
WRITE, once each endpoint that carried a part was flushed), on the agent's
own endpoint, and never arrives before the data it announces is visible --
also when a lane carried the whole transfer (its endpoint is another than
the notification's).

- WRITE: the target, on seeing the notification, finds every written byte
  already equal to the pattern.
- READ: "visible" is the other way round: the notification tells the
  producer that the consumer finished reading, so the producer reuses its
  blocks at once (overwrites them); the consumer must still hold only the
  bytes from before the overwrite.

The receiver is a polling agent driven by the test thread, which checks (or
overwrites) right after the progress call that delivered the notification.
Over TCP the target's own progress applies incoming puts and answers gets,
and a lane's data travels on another connection than the notification, so
a notification sent too early (before a lane's part, or without a lane's
flush) is seen before the data. Random sizes, places and patterns; the seed
is printed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from rdma_kv.transport import DescList, XferState
from transport_helpers import LOOPBACK, TCP, post_burst, settle_until_one_failed

# Over TCP with UCX's own put disabled (rdma-kv's default), puts are
# emulated with active messages (software RMA): a put completes locally
# once sent, and only an endpoint flush waits for the target to have
# applied it -- so a missing flush shows. ("tcp" asks for UCX's tcp put,
# which waits for the target's ack; nothing here fails a peer, the case
# that put crashes in: docs/reliability.md.)
TCP_SW_RMA = {**TCP, "TCP_PUT_ENABLE": "n"}
TCP_NATIVE_PUT = {**TCP, "TCP_PUT_ENABLE": "y"}

pytestmark = [pytest.mark.ucx]

NBYTES = 8 << 20
BLOCK = 4096
SLOTS = NBYTES // BLOCK
LANE_MIN = 256 << 10
TRIALS = 16
# The bounds only keep a broken run from hanging; what is tested is order, not
# speed. 30 s was too short on a host at load 40-60 (the suite beside vLLM
# servers): a striped TCP read of 8 MiB, its target stepped one progress call at
# a time, was still running at 30 s (2026-11-27).
WAIT_S = 120.0


def _agents(make_agent, transport, progress, lanes, **config):
    options = {"tcp": TCP_NATIVE_PUT, "tcp-sw-rma": TCP_SW_RMA, "shm": LOOPBACK}[transport]
    a = make_agent("a", ucx_options=options, progress="poll", lanes=1)  # the receiver, driven here
    config.setdefault("transfer_timeout_s", WAIT_S)
    b = make_agent("b", ucx_options=options, progress=progress, lanes=lanes, lane_min_bytes=LANE_MIN, **config)
    buf_a = np.zeros(NBYTES, dtype=np.uint8)
    buf_b = np.zeros(NBYTES, dtype=np.uint8)
    a.register(buf_a)
    b.register(buf_b)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    return a, b, buf_a, buf_b


def _reaction(op, view_a, view_b, li, ri):
    """What the receiver does the moment it is notified; returns bytes wrong."""
    if op == "write":
        # The target checks at once: every announced byte must be there.
        return lambda: int(np.count_nonzero(view_a[ri] != view_b[li]))

    def reuse() -> int:
        # The producer reuses its blocks at once; the consumer must not see it
        # (checked once the read completed).
        view_a[ri] = ~view_a[ri]
        return 0

    return reuse


def _until_notified(a, b, xfer, tag: bytes, at_once) -> int:
    """Drive both agents until ``a`` receives ``tag``, calling ``at_once()``
    right after the UCX progress call that delivered it; returns its result. ``a`` is stepped
    one ``ucp_worker_progress`` at a time and its notification ring watched
    directly: ``Agent.progress()`` runs until idle, which would apply the
    rest of the data before the test could look."""
    ring = a._core.inflight.ctx
    end = time.monotonic() + WAIT_S
    while ring.notif_head == ring.notif_tail:
        if b.manual_progress:
            b.progress()
        with a._core.lock:
            a._core.worker.progress(1)
        assert time.monotonic() < end, f"notification {tag!r} not seen after {WAIT_S} s ({xfer!r})"
    wrong = at_once()
    got = a.get_notifications()
    assert [(n.peer, n.payload) for n in got] == [("b", tag)], got
    return wrong


def _finish(a, b, xfer) -> None:
    end = time.monotonic() + WAIT_S
    while not xfer.done():  # a polling b is driven by done(); a must answer TCP gets
        a.progress()
        assert time.monotonic() < end, f"{xfer!r} not done after {WAIT_S} s"
    xfer.wait(0)
    assert xfer.state is XferState.DONE


def _trial(rng, lanes, shape):
    """Random slots on both sides (disjoint within a side): enough for a part
    on every worker (striped), or too few for two parts (spread: whole)."""
    lo, hi = (lanes * LANE_MIN // BLOCK, SLOTS) if shape == "striped" else (1, 2 * LANE_MIN // BLOCK)
    n = int(rng.integers(lo, hi))
    li = rng.permutation(SLOTS)[:n]
    ri = np.sort(rng.choice(SLOTS, n, replace=False)) if rng.integers(2) else rng.permutation(SLOTS)[:n]
    return li, ri


def _post(b, op, li, ri, buf_a_addr, buf_b_addr, tag, prepared):
    if prepared is not None:
        local, remote = prepared
        fn = b.write_prepared if op == "write" else b.read_prepared
        return fn(local, li, remote, ri, notify=tag)
    local = DescList(buf_b_addr + li.astype(np.uint64) * BLOCK, BLOCK)
    remote = DescList(buf_a_addr + ri.astype(np.uint64) * BLOCK, BLOCK)
    fn = b.write if op == "write" else b.read
    return fn("a", local, remote, notify=tag)


@pytest.mark.parametrize("transport", ["tcp", "tcp-sw-rma", "shm"])
@pytest.mark.parametrize("progress", ["poll", "thread"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("shape", ["striped", "spread"])
def test_a_notification_never_precedes_its_data(make_agent, transport, progress, op, shape):
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    lanes = 2 if transport == "shm" else 3
    # The trials post one transfer at a time: spread_alone sends even a lone
    # whole transfer to the next worker in turn, so that every worker's
    # notification path is tried (by default a lone one stays on the own worker).
    a, b, buf_a, buf_b = _agents(make_agent, transport, progress, lanes, spread_alone=shape == "spread")
    slots = np.arange(SLOTS, dtype=np.uint64) * BLOCK
    prepared = (b.prep_local(DescList(buf_b.ctypes.data + slots, BLOCK)),
                b.prep_remote("a", DescList(buf_a.ctypes.data + slots, BLOCK)))
    view_a, view_b = buf_a.reshape(SLOTS, BLOCK), buf_b.reshape(SLOTS, BLOCK)
    early, workers = [], set()
    for trial in range(TRIALS):
        li, ri = _trial(rng, lanes, shape)
        # A fresh pattern each trial, never equal to what the other side holds.
        old = rng.integers(0, 256, NBYTES, dtype=np.uint8)
        if op == "write":
            buf_b[:] = old
            buf_a[:] = ~old
        else:
            buf_a[:] = old
            buf_b[:] = ~old
        tag = f"t{trial}".encode()
        xfer = _post(b, op, li, ri, buf_a.ctypes.data, buf_b.ctypes.data, tag,
                     prepared if trial % 4 else None)  # every fourth: explicit lists
        wrong = _until_notified(a, b, xfer, tag, _reaction(op, view_a, view_b, li, ri))
        if wrong:
            early.append((trial, len(li), wrong))
        _finish(a, b, xfer)
        if shape == "striped":
            assert xfer.worker_ops is not None and len(xfer.worker_ops) == lanes, xfer.worker_ops
        else:
            assert xfer.worker_ops is None and xfer.worker is not None
            workers.add(xfer.worker)
        if op == "read":
            bad = np.count_nonzero(view_b[li] != old.reshape(SLOTS, BLOCK)[ri])
            if bad:
                early.append((trial, len(li), bad))
        assert not a.get_notifications(), "a notification arrived twice"
    assert not early, f"seed={seed}: notified before the data was visible (trial, slots, bytes wrong): {early}"
    assert shape == "striped" or workers == set(range(lanes)), f"whole transfers went to workers {workers} only"
    assert b.stats.failed == 0


def _small_reads(b, buf_a, buf_b):
    """Post the i-th 16 KiB read (far below two LANE_MIN parts)."""
    buf_a[:] = np.arange(NBYTES, dtype=np.uint64).astype(np.uint8)
    slots = np.arange(SLOTS, dtype=np.uint64) * BLOCK
    local = b.prep_local(DescList(buf_b.ctypes.data + slots, BLOCK))
    remote = b.prep_remote("a", DescList(buf_a.ctypes.data + slots, BLOCK))
    one = np.arange(4, dtype=np.int64)
    return lambda i: b.read_prepared(local, one + 4 * i, remote, one + 4 * i)


def test_a_polling_agent_sends_a_whole_transfer_to_the_worker_with_the_fewest_bytes_queued(make_agent):
    """Polling: a transfer too small to stripe goes whole to the worker with
    the fewest bytes posted and not yet complete (``rk_ctx_t.queued``; the
    backlogs are set here, as a caller posting while nobody drives its own
    worker leaves one there), the own worker on a tie (a lone transfer wakes
    no pump). Its bytes leave the count once it completed: the backlogs are
    the same again afterwards."""
    a, b, buf_a, buf_b = _agents(make_agent, "shm", "poll", 3)
    ctx = b._core.inflight.ctx
    post = _small_reads(b, buf_a, buf_b)
    posted = []

    def worker_for(backlog: list[int]) -> int:
        for w, queued in enumerate(backlog):
            ctx.queued[w] = queued
        xfer = post(len(posted))
        posted.append(xfer)
        xfer.wait(WAIT_S)
        assert [ctx.queued[w] for w in range(3)] == backlog, "a transfer's bytes stayed queued"
        return xfer.worker

    mib = 1 << 20
    assert [worker_for([0, 0, 0]) for _ in range(3)] == [0, 0, 0]  # alone: the own worker
    assert worker_for([5 * mib, mib, 3 * mib]) == 1
    assert worker_for([mib, mib, 0]) == 2
    assert worker_for([0, mib, 2 * mib]) == 0
    assert worker_for([mib, 2 * mib, mib]) == 0  # a tie with the own worker: the own
    n = 4 * len(posted)
    assert (buf_b[:n * BLOCK] == buf_a[:n * BLOCK]).all()


@pytest.mark.parametrize("spread_alone", [False, True])
def test_a_pumped_agent_spreads_whole_transfers_in_turn(make_agent, spread_alone):
    """progress="thread": a transfer too small to stripe, posted while
    nothing else is in flight, goes to the own worker (a lane's pump would
    have to wake up); posted beside others, the next ones go to the lanes in
    turn (every worker has a pump: they drain alike). With ``spread_alone``
    every one goes in turn.

    Over TCP with software RMA a read completes only once the target (a
    polling agent, driven here) answers it, so "beside others" is certain:
    over shared memory a lane's pump could finish the first reads before
    the next is posted, and a post that finds the table empty is alone
    again."""
    a, b, buf_a, buf_b = _agents(make_agent, "tcp-sw-rma", "thread", 3, spread_alone=spread_alone)
    post = _small_reads(b, buf_a, buf_b)

    def drive(xfers):
        end = time.monotonic() + WAIT_S
        while not all(x.done() for x in xfers):
            assert time.monotonic() < end, "the reads did not complete"
            a.progress()
        for x in xfers:
            x.wait(WAIT_S)

    alone = []
    for i in range(3):  # each finished (drained) before the next is posted
        xfer = post(i)
        drive([xfer])
        alone.append(xfer.worker)
    with b._core.lock:  # posted back to back, and nobody drains (settles) meanwhile
        together = [post(3 + i) for i in range(4)]
        assert b._core.inflight.live == 4     # none could complete: the target was not driven
    drive(together)
    assert (buf_b[:7 * 4 * BLOCK] == buf_a[:7 * 4 * BLOCK]).all()
    if spread_alone:
        assert alone == [0, 1, 2], alone
    else:
        assert alone == [0, 0, 0], alone
        assert [x.worker for x in together] == [0, 1, 2, 0], [x.worker for x in together]


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_no_bytes_stay_queued_once_every_transfer_settled(make_agent, rng, progress):
    """The queue counts drift back to zero whatever the transfers did:
    striped and whole, reads and notified writes, posted back to back, and
    some abandoned on a deadline that passed before they completed (their
    bytes leave the count when UCX hands them back, not when the agent
    gives up on them). A drift would steer every later request off a
    worker for good. (Every endpoint is used once first: a peer failed
    while its endpoints still wire up meets a UCX crash, docs/reliability.md.)"""
    a, b, buf_a, buf_b = _agents(make_agent, "tcp-sw-rma", progress, 3)
    ctx, inflight = b._core.inflight.ctx, b._core.inflight
    slots = np.arange(SLOTS, dtype=np.uint64) * BLOCK
    local = b.prep_local(DescList(buf_b.ctypes.data + slots, BLOCK))
    remote = b.prep_remote("a", DescList(buf_a.ctypes.data + slots, BLOCK))
    every = np.arange(SLOTS)
    for warm in (b.write_prepared(local, every, remote, every, notify=b"warm"),
                 b.read_prepared(local, every, remote, every)):
        assert warm.worker_ops is not None and len(warm.worker_ops) == 3  # striped: every worker's endpoint
        _finish(a, b, warm)
    xfers = post_burst(b, local, remote, rng, SLOTS, 2 * LANE_MIN // BLOCK)
    settle_until_one_failed(b, xfers, WAIT_S)  # before a answers: a loaded machine could finish them all first
    end = time.monotonic() + WAIT_S
    while not all(x.done() for x in xfers) or ctx.nfree != ctx.nslots:
        a.progress()  # a answers TCP gets and applies puts
        b.progress()
        assert time.monotonic() < end, f"{ctx.nslots - ctx.nfree} slots never came back"
    failed = [x for x in xfers if x.state is not XferState.DONE]
    assert failed, "no transfer was abandoned: the deadlines did not pass first"
    assert inflight.live == 0
    assert [ctx.queued[w] for w in range(3)] == [0, 0, 0]


def test_no_notification_goes_out_on_an_endpoint_being_closed(make_agent):
    """A notified transfer whose last part completes after its peer's
    endpoint was quiesced for a close (a lane's pump can complete its part
    after the agent force-closed the endpoint on a deadline) sends nothing
    on it: the transfer fails (cancelled) and the peer gets no
    notification. It used to be sent on the closed endpoint, a use after
    free that crashed a push producer under load (docs/reliability.md)."""
    from rdma_kv.transport._lib import load

    a, b, buf_a, buf_b = _agents(make_agent, "tcp", "poll", 1)  # both driven here
    slots = np.arange(SLOTS) * BLOCK
    lp = b.prep_local(DescList.from_regions(buf_b.ctypes.data, slots, BLOCK))
    rp = b.prep_remote("a", DescList.from_regions(buf_a.ctypes.data, slots, BLOCK))
    idx = np.arange(SLOTS)

    def drive(xfer, notified: bool = True, rounds_after: int = 0) -> list:
        """Progress both until ``xfer`` is done (and, if ``notified``, a
        notification came; bounded by WAIT_S), then ``rounds_after`` rounds
        more; the notifications ``a`` got."""
        got: list = []
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end and not (xfer.done() and (got or not notified)):
            b.progress()
            a.progress()
            got += a.get_notifications()
        for _ in range(rounds_after):
            b.progress()
            a.progress()
            got += a.get_notifications()
        return got

    first = b.write_prepared(lp, idx, rp, idx, notify=b"first")
    assert [(n.peer, n.payload) for n in drive(first)] == [("b", b"first")] and first.state is XferState.DONE

    second = b.write_prepared(lp, idx, rp, idx[::-1], notify=b"second")
    assert second.state is XferState.IN_PROGRESS  # nothing progressed b since the post
    load()[1].rk_ep_quiesce(b._core.peers["a"].ep_state)
    # Driven until it is done (bounded by WAIT_S, not by a wall time a loaded
    # host may spend before the cancel is seen), then 500 rounds more for a
    # notification that would come after.
    assert drive(second, notified=False, rounds_after=500) == [], "a notification went out on an endpoint being closed"
    assert second.state is XferState.FAILED and "canceled" in str(second.error), second.error
