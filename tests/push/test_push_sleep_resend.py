"""72dc8bd: while the producer goes to sleep its pusher "answers its pushes
(PUSH_QUERY) ... refusing only new ones". But ``_to_pusher`` refuses every
PUSH / PUSH_REG by message type, not by whether the push is new: a PUSH the
decode *resends under the same token* (it does so after a query answered
UNKNOWN because the producer had not yet taken its first attempt --
pushes.py, "the token makes a second arrival of the first one harmless")
is answered REFUSED "nothing is written" although the first attempt was
taken and its writes are in flight. The decode, not yet answered, resolves
the handle as failed on REFUSED and hands its blocks back under those
writes: the very failure the commit fixes for PUSH_QUERY. Awake, the same
resend is answered with the push's state (``PushWriter._introduced``).
Found by a review of that commit; a known token is now answered its state
while suspending too (``PushWriter.known``), and only new pushes are
refused.
"""
from __future__ import annotations

import threading

from test_push_pin_count import INC, S, push, setup

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.pushes import PushHandle, Pushes
from rdma_kv.connector.rdma.producer import ProducerHandler
from rdma_kv.connector.rdma.stats import PushCounters, Tally


def test_a_resent_push_of_a_running_token_is_answered_its_state_while_suspending():
    fabric, src, dsts, clock, leases, writer = setup()
    fabric.hold = True
    handler = ProducerHandler("P", wire.RankInfo(0, 1, 2), 30.0, leases, None, lambda: b"md",
                              writer._geometry)
    handler.pusher = writer
    first = handler.on_push(push(0))
    assert first.state is S.RUNNING and fabric.pending  # taken: its writes are on the wire
    awake_resend = handler.on_push(push(0))
    assert awake_resend.state is S.RUNNING  # awake: the resend is answered the push's state

    handler.suspend()  # RdmaProducer.suspend -> ProducerHandler.suspend; transport not closed yet
    resend = handler.on_push(push(0))

    # What the decode does with that answer to a PUSH it never got an answer for:
    pushes = Pushes.__new__(Pushes)
    pushes._lock, pushes._counts, pushes._running = threading.Lock(), Tally(PushCounters), {}
    pushes._clock = lambda: 0.0
    pushes._peer_failed = lambda peer, why: None
    handle = PushHandle(push(0).token, None, push(0), 0, 0, 0.0, hard_deadline=1e9)
    pushes._after(handle, resend, None)
    in_flight = len(fabric.pending)
    print("resent PUSH answered", resend.state.name, repr(resend.detail), "; decode handle done:", handle.done(),
          "error:", handle.error, "; writes still in flight into its blocks:", in_flight)
    assert not (handle.done() and in_flight), (
        f"a resend of a RUNNING push was answered {resend.state.name} while the producer suspends; the decode "
        f"resolved it ({handle.error}) and hands its blocks back with {in_flight} write(s) into them in flight")


def test_a_new_push_is_refused_while_suspending():
    fabric, src, dsts, clock, leases, writer = setup()
    handler = ProducerHandler("P", wire.RankInfo(0, 1, 2), 30.0, leases, None, lambda: b"md",
                              writer._geometry)
    handler.pusher = writer
    handler.suspend()
    reply = handler.on_push(push(0))
    assert reply.state is S.REFUSED and "asleep" in reply.detail and not fabric.pending


def test_a_decode_that_introduces_itself_as_the_producer_wakes_is_told_it_sleeps_not_that_it_runs_pull(monkeypatch):
    """``ProducerHandler.resume`` published the new transport's metadata (a
    handshake is answered from then on) before the new pusher: a decode that
    handshook in that gap had its PUSH_HELLO refused "this producer runs
    mode 'push'; push needs mode 'push' on both engines", an operator's
    hunt for a configuration that was right. The pusher is now published
    first; a hello at either point of the wake is told the KV cache is not
    registered yet, and one after it is taken."""
    fabric, src, dsts, clock, leases, writer = setup()
    handler = ProducerHandler("P", wire.RankInfo(0, 1, 2), 30.0, leases, None, lambda: b"md",
                              writer._geometry)
    handler.attach(writer)
    handler.suspend()
    handler.detach()
    d = fabric.factory("D9")
    geometry = wire.GeometryWire.from_geometry(writer._geometry)
    hello = wire.PushHello(wire.PROTOCOL_VERSION, "D9", wire.RankInfo(0, 2, 2), INC, 1, d.metadata(), geometry)
    during = []
    real_attach = handler.attach

    def attach(pusher):  # the wake, half done: before and after the pusher is published
        during.append(handler.on_push_hello(hello))
        real_attach(pusher)
        during.append(handler.on_push_hello(hello))

    monkeypatch.setattr(handler, "attach", attach)
    handler.resume(lambda: b"md2", writer._geometry, 2, writer)
    for reply in during:
        assert reply.state is S.REFUSED and "not registered" in reply.detail, reply
    assert handler.on_push_hello(hello).state is S.DONE
