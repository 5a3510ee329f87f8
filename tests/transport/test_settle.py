"""Settling: one look (``rk_look``) says which of the agent's settling steps
have anything to do -- completions, notifications (and drops), endpoint
errors, deadlines -- so a settle after one completion runs only the steps
that have work; these tests hold that no step's work is missed.
"""

from __future__ import annotations

import logging
import time

import pytest

from rdma_kv.transport._lib import load
from transport_helpers import connect

pytestmark = pytest.mark.ucx

WAIT_S = 20.0


def _ctx(nslots: int = 4):
    """A bare C context of ``nslots`` slots, and what keeps its memory alive."""
    ffi, lib = load()
    ctx = ffi.new("rk_ctx_t *")
    keep = (ffi.new("rk_batch_t[]", nslots), ffi.new("uint32_t[]", nslots), ffi.new("uint32_t[]", nslots))
    lib.rk_ctx_init(ctx, keep[0], keep[1], nslots, keep[2], nslots)
    return ctx, keep


def test_the_look_names_each_step_with_work_and_none_without():
    _, lib = load()
    ctx, _keep = _ctx()
    done, notif, errors, due = lib.RK_LOOK_DONE, lib.RK_LOOK_NOTIF, lib.RK_LOOK_ERRORS, lib.RK_LOOK_DUE
    assert lib.rk_look(ctx, 0, 0) == 0

    ctx.done_head = 1  # a completion published, not drained
    assert lib.rk_look(ctx, 0, 0) == done
    ctx.done_tail = 1
    ctx.notif_head = 3  # notifications received, not drained
    assert lib.rk_look(ctx, 0, 0) == notif
    ctx.notif_tail = 3
    ctx.notif_dropped_rndv = 1  # a drop with the ring empty still needs its warning
    assert lib.rk_look(ctx, 0, 0) == notif
    assert lib.rk_look(ctx, 0, 1) == 0  # ... once
    ctx.notif_dropped_full = 2
    assert lib.rk_look(ctx, 0, 1) == notif
    ctx.ep_errors = 1
    assert lib.rk_look(ctx, 0, 3) == errors
    assert lib.rk_look(ctx, 1, 3) == 0

    now_ns = time.monotonic_ns()  # the shim's clock (CLOCK_MONOTONIC)
    ctx.live = 1
    ctx.next_deadline_ns = now_ns + 60 * 10**9
    assert lib.rk_look(ctx, 1, 3) == 0
    ctx.next_deadline_ns = now_ns
    assert lib.rk_look(ctx, 1, 3) == due
    ctx.live = 0  # nothing in flight: no deadline to look at
    assert lib.rk_look(ctx, 1, 3) == 0


def _drive(agent, until, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not until():
        assert time.monotonic() < end, f"{what} not seen within {WAIT_S} s"
        agent.progress()


def test_a_full_notification_ring_drops_and_says_so_once(make_agent, caplog):
    # a (polled) gets a ring of two slots; its worker is progressed without
    # settling (what a pump does between settles) until b's five reads and
    # their notifications are through, so three find the ring full.
    pair = connect(make_agent, progress="poll", notif_slots=2)
    a, b = pair.a, pair.b
    a_worker = a._core.worker
    xfers = [b.read("a", pair.desc_b([i * 64], 64), pair.desc_a([i * 64], 64), notify=f"n{i}".encode())
             for i in range(5)]
    sent = b.flush("a")  # completes once every notification sent before it reached a
    end = time.monotonic() + WAIT_S
    while not all(x.done() for x in xfers) or not sent.done():
        assert time.monotonic() < end, f"b's reads not complete within {WAIT_S} s"
        a_worker.progress()
    for _ in range(10):
        a_worker.progress()
    ctx = a._core.inflight.ctx
    assert ctx.notif_head - ctx.notif_tail == 2 and ctx.notif_dropped_full == 3
    got = []
    with caplog.at_level(logging.WARNING, logger="rdma_kv.transport.agent"):
        _drive(a, lambda: got.extend(a.get_notifications()) or len(got) == 2, "two notifications")
        for _ in range(10):
            a.progress()
    payloads = {n.payload for n in got}  # (in the order the reads completed)
    assert len(payloads) == 2 and payloads <= {f"n{i}".encode() for i in range(5)}
    drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert drops == ["agent a dropped 3 notifications (ring of 2 full or oversized); call get_notifications() "
                     "more often or raise notif_slots"]


def test_a_drop_with_the_ring_empty_is_still_reported(make_agent, caplog):
    a = make_agent("a", progress="poll")
    a.progress()
    # What the shim's handler does for a message that came by rendezvous
    # (senders always send eager): counts it, stores nothing.
    a._core.inflight.ctx.notif_dropped_rndv += 1
    with caplog.at_level(logging.WARNING, logger="rdma_kv.transport.agent"):
        a.progress()
        a.progress()
    drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert drops == ["agent a dropped 1 notifications (ring of 4096 full or oversized); call get_notifications() "
                     "more often or raise notif_slots"]
