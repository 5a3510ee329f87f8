"""A registration the decode aborted (or that expired) while its flush was
on the wire is not written when its prefill's lease is granted in that
window (found by a review of push mode, 2026-11-30).

The abort of a registration with layer-wise state posts a flush and answers
ABORTED once it completes; the grant arriving meanwhile used to take the
entry (WAITING) as any other, pin the lease and post every block with the
notification. The flush then answered ABORTED, the decode handed its
blocks back, and the whole write landed in them; the lease was released
under that write (``test_a_grant_during_an_aborts_flush_writes_nothing``).
A second window: the abort and the last layer batch resolving the entry
while the seal pinned the lease left the lease pinned for ever
(``test_an_abort_resolved_while_the_seal_pins_the_lease_leaves_it_unpinned``).
Both fail on the code before. An expired registration leaves the waiting
list at once, so a grant never takes it (a guard, passes before too).
"""

from __future__ import annotations


from leaseutil import ref
from test_push_layer_answers import landed, layer_setup, slow_flushes
from test_pusher import S

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.meta import LayerPushSpec, SendSpec


def complete(x):
    if not x.done():
        x._resolve(None)


def ended_in_flight(s, token, end):
    """The layer-wise state of a registration: layer l0 of its first step
    posted and complete, then ``end`` (the decode's abort, or its expiry)
    posts the flush; the prefill's lease is granted while that flush is on
    the wire. What lands in the decode's blocks after the final answer?"""
    flushes = slow_flushes(s)
    s.writer.begin_step([LayerPushSpec("t1", "r1", (10, 11), 0, 8)])
    s.writer.write_layer("l0")  # posted, complete at once
    end()
    assert len(flushes) == 1  # the flush that answers the abort/expiry
    assert not flushes[0].done()  # on the wire (slow_flushes), until complete() below
    s.writer.write_layer("l1")  # not posted: the entry ended
    s.writer.end_step()
    s.fabric.hold = True  # any write now takes its time on the wire
    s.leases.grant(ref(3), [30, 31], 10.0)  # the prefill finished: its lease, granted now
    s.writer.granted(SendSpec("r3", [30, 31], ref(3), 10.0, transfer_id="t1", num_tokens=8))
    for x in flushes:
        complete(x)
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token))
    assert reply.state not in (S.RUNNING, S.WAITING, S.DONE), reply
    for n in s.dst:  # the decode hands blocks 40, 41 back: another request's now
        s.dst[n][[40, 41]] = 0
    s.fabric.release_all()
    for x in flushes[1:]:
        complete(x)
    s.fabric.release_all()
    return reply


def test_a_grant_during_an_aborts_flush_writes_nothing():
    s, token = layer_setup()
    reply = ended_in_flight(
        s, token, lambda: s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token, abort=True)))
    assert reply.state is S.ABORTED
    assert not (landed(s, "l0") or landed(s, "l1")), "a write landed after the producer answered ABORTED"
    assert s.writer.running() == 0
    assert not s.leases._pins.pushing(3), "the lease stays pinned"


def test_a_grant_during_an_expirys_flush_writes_nothing():
    s, token = layer_setup()

    def expire():
        s.clock.t += 31
        s.writer.reap()

    reply = ended_in_flight(s, token, expire)
    assert reply.state is S.REFUSED
    assert not (landed(s, "l0") or landed(s, "l1")), "a write landed after the producer answered REFUSED"
    assert not s.leases._pins.pushing(3), "the lease stays pinned"


def test_an_abort_resolved_while_the_seal_pins_the_lease_leaves_it_unpinned():
    """The seal (the lease granted) takes the registration, and while it
    pins the lease the decode's abort arrives and the last layer batch
    completes: the flush answers ABORTED before the seal recorded the lease
    on the entry. The lease stayed pinned for ever (no expiry or release
    ends a pinned lease): the prefill's blocks never came back."""
    s, token = layer_setup()
    s.fabric.hold = True
    s.writer.begin_step([LayerPushSpec("t1", "r1", (10, 11), 0, 8)])
    s.writer.write_layer("l0")
    s.writer.write_layer("l1")
    s.writer.end_step()  # both layers on the wire
    real = s.leases.pin_for_push
    answers = []

    def racing(call):  # the side channel thread and the transport's progress thread run here
        answers.append(s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token, abort=True)))
        s.fabric.hold = False
        s.fabric.release_all()  # the layer batches complete: the flush, then ABORTED
        answers.append(s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token)))
        return real(call)

    s.leases.pin_for_push = racing
    s.writer.granted(SendSpec("r1", [10, 11], ref(1), 10.0, transfer_id="t1", num_tokens=8))
    assert answers[-1].state is S.ABORTED
    assert s.writer.running() == 0
    assert not s.leases._pins.pushing(1), "the lease stays pinned: its blocks never go back"
