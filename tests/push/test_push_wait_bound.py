"""A registration's writes are all posted within the bound its WAITING
answer gave the decode (found by a review of push mode, 2026-11-30).

The producer answers a waiting registration ``writes_end_within_s`` =
(its ``wait_until`` - now) + the write timeout, and a decode that can no
longer reach the producer's side channel hands its blocks back one second
after that bound (``consumer/pushes``: the partition case; RDMA may still
run where the side channel's network does not). Only ``reap`` expired a
registration past ``wait_until``, and it runs when a PUSH_REG or PUSH_QUERY
arrives or at the end of a step's metadata, after that step's grants: a
grant arriving first, or a layer stored in a long step, posted writes past
the bound, which could land in blocks the decode had handed back.
"""

from __future__ import annotations

from leaseutil import ref
from test_push_layer_answers import landed, layer_setup
from test_pusher import S

from rdma_kv.connector.rdma.meta import LayerPushSpec, SendSpec

WAIT_S, WRITE_S = 30.0, 5.0  # layer_setup's writer


def bound(s, token):
    """The decode's bound from the WAITING answer (pushes._after): no write of it lands after this."""
    reply = s.writer.known(token)
    assert reply is not None and reply.state is S.WAITING
    assert reply.writes_end_within_s == WAIT_S + WRITE_S
    return s.clock.t + reply.writes_end_within_s + 1.0


def test_a_grant_after_the_wait_posts_nothing():
    s, token = layer_setup()
    deadline = bound(s, token)
    s.clock.t = deadline + 4 - WRITE_S  # no PUSH_QUERY gets through; the prefill finishes late
    s.leases.grant(ref(3), [30, 31], 10.0)
    s.writer.granted(SendSpec("r3", [30, 31], ref(3), 10.0, transfer_id="t1", num_tokens=8))
    # a write posted now could land until clock + WRITE_S, past the decode's deadline
    assert s.fabric.writes == 0, "a write was posted past the bound the decode was given"
    assert not (landed(s, "l0") or landed(s, "l1"))
    s.writer.reap()
    assert s.writer.known(token).state is S.REFUSED
    assert not s.leases._pins.pushing(3)


def test_a_layer_stored_after_the_wait_is_not_posted():
    s, token = layer_setup()
    deadline = bound(s, token)
    s.writer.begin_step([LayerPushSpec("t1", "r1", (10, 11), 0, 8)])
    s.writer.write_layer("l0")  # within the bound
    writes = s.fabric.writes
    s.clock.t = deadline + 4 - WRITE_S  # a long step; no PUSH_QUERY gets through
    s.writer.write_layer("l1")
    s.writer.end_step()
    assert s.fabric.writes == writes, "a layer was posted past the bound the decode was given"
    s.writer.reap()  # expired: its layer-wise writes flushed, then REFUSED
    assert s.writer.known(token).state is S.REFUSED
