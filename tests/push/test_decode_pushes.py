"""The decode's side of a push (``consumer/pushes.Pushes``) when the
producer is slow to answer: its side channel without a CPU for longer than
the RPC's attempts, so that the PUSH gets no answer. Scripted side-channel
answers, a fake clock; the RPC threads run inline.

What must hold: a PUSH the producer has not taken yet is sent again (not
failed: the producer merely had no CPU), and the decode gives a push up
only on an answer that makes a late attempt of its PUSH harmless -- the
producer's UNKNOWN to an *abort* (which it remembers; test_pusher.py), never
on its own say-so."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from leaseutil import Clock, ref

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.pushes import Pushes
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease

S = wire.PushState
TOKEN = b"t" * 16


class Client:
    """A side channel that answers from a script: a reply, or an exception to raise."""

    host, port = "127.0.0.1", 1

    def __init__(self, *script):
        self.script = list(script)
        self.sent = []

    def call(self, request, timeout_s=None):
        self.sent.append(request)
        out = self.script.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out


class Pool:
    def __init__(self, client):
        self.client = client

    def get(self, host, port):
        return self.client

    def submit(self, fn, handle, to=None):
        fn(handle)  # the RPC thread, inline
        return True


def setup(client):
    clock = Clock()
    settings = SimpleNamespace(rpc_timeout_s=2.0, lease_max_s=120.0, read_timeout_s=10.0, tp_rank=0)
    table = SimpleNamespace(group_nbytes=np.array([4096]), row_group=np.array([0]), num_groups=1)
    local = SimpleNamespace(transport=SimpleNamespace(get_notifications=lambda: [],
                                                      progress_report=lambda: "own worker: pump asleep"))
    failed = []
    pushes = Pushes(local, "D", 1, b"i" * 8, settings, Pool(client), lambda peer, why: failed.append(why),
                    lambda heads: (table, None), clock=clock)
    peer = SimpleNamespace(address=SimpleNamespace(rank_address=lambda rank: (Client.host, Client.port)),
                           rank=0, connection=None)
    lease = RemoteLease(PeerAddress("P", "127.0.0.1", 1, 1), ref(1), b"A" * 16).to_wire()
    request = wire.Push(wire.PROTOCOL_VERSION, lease, TOKEN, "D", 0, b"i" * 8, 1, [[40, 41]], [[10, 11]])
    return pushes, clock, request, peer, failed


def step(pushes, clock, s=1.0):
    clock.t += s
    pushes.poll()


def kinds(client):
    return [("abort" if getattr(r, "abort", False) else type(r).__name__) for r in client.sent]


def test_a_push_that_got_no_answer_and_is_not_taken_yet_is_sent_again_and_completes():
    client = Client(TimeoutError("no answer"), wire.PushReply(S.UNKNOWN, "no push of this token"),
                    wire.PushReply(S.RUNNING, "", 10.0), wire.PushReply(S.DONE))
    pushes, clock, request, peer, failed = setup(client)
    handle = pushes._begin(peer, request, [[40, 41]])
    step(pushes, clock)  # the query: UNKNOWN, the producer has not taken it yet
    assert not handle.done(), handle.error
    step(pushes, clock)  # the PUSH again, under the same token: RUNNING
    step(pushes, clock, 2.0)  # no notification within a second: the query reads DONE
    assert handle.done() and handle.error is None, handle.error
    assert kinds(client) == ["Push", "PushQuery", "Push", "PushQuery"]
    assert client.sent[2].token == TOKEN
    assert pushes.take_counters().resent == 1 and not failed


def test_an_aborted_push_that_got_no_answer_asks_the_producer_before_giving_up():
    """The load gives up while its PUSH has no answer: the abort goes to the
    producer (which then refuses a late attempt), and only its UNKNOWN
    resolves the push; no PUSH is sent after the abort."""
    client = Client(TimeoutError("no answer"), wire.PushReply(S.UNKNOWN, "no push of this token"))
    pushes, clock, request, peer, failed = setup(client)
    handle = pushes._begin(peer, request, [[40, 41]])
    pushes.abort(handle)
    assert not handle.done()
    step(pushes, clock)
    assert handle.done() and "aborted before the producer took the push" in str(handle.error)
    assert "no answer" in str(handle.error)  # why the PUSH got none
    assert kinds(client) == ["Push", "abort"]


@pytest.mark.parametrize("life, fenced", [(b"L1", False), (b"L2", True), (b"", True)],
                         ids=["same-life", "woke-or-restarted", "asleep"])
def test_an_aborted_push_that_got_no_answer_is_fenced_when_another_life_answers(life, fenced):
    """The PUSH got no answer; the abort is answered "never taken". From
    the life of the producer's transport the push was sent to, that holds:
    nothing posted, nothing fenced. From another (it woke, or its process
    restarted; asleep: none) it says nothing of what the first life took
    and posted before its transport closed: the producer is fenced before
    the push resolves (found by a review in stop 66; fenced since protocol
    14, whose answers name the life)."""
    client = Client(TimeoutError("no answer"), wire.PushReply(S.UNKNOWN, "no push of this token", 0.0, life))
    pushes, clock, request, peer, failed = setup(client)
    peer.connection = SimpleNamespace(life=b"L1")
    order, resolve = [], pushes._resolve
    pushes._peer_failed = lambda p, why: order.append(("fenced", why))
    pushes._resolve = lambda h, error: (order.append(("resolved", str(error))), resolve(h, error))
    handle = pushes._begin(peer, request, [[40, 41]])
    pushes.abort(handle)
    step(pushes, clock)
    assert handle.done() and "aborted before the producer took the push" in str(handle.error)
    assert [kind for kind, _ in order] == (["fenced", "resolved"] if fenced else ["resolved"]), order
    if fenced:
        assert "life 4c31" in order[0][1], order


def test_a_push_answered_pending_then_aborted_asks_the_producer_before_giving_up():
    """PENDING: the producer did not take this attempt, but an earlier one
    the client gave up on may still arrive. Aborting, the decode asks (abort)
    instead of sending the PUSH again, and resolves on the answer."""
    client = Client(wire.PushReply(S.PENDING, "the grant has not reached this worker"),
                    wire.PushReply(S.UNKNOWN, "no push of this token"))
    pushes, clock, request, peer, failed = setup(client)
    handle = pushes._begin(peer, request, [[40, 41]])
    assert not handle.done()
    pushes.abort(handle)
    assert not handle.done(), "resolved without asking the producer"
    step(pushes, clock, 0.01)
    assert handle.done() and "aborted before the producer took the push" in str(handle.error)
    assert kinds(client) == ["Push", "abort"]


def test_a_push_whose_producer_stops_answering_after_running_fails_at_its_bound_saying_how_this_side_ran():
    """RUNNING, then no answer at all: the push fails once the writes' own
    timeout (plus a second) has passed, not before, and the error carries
    this decode's progress threads (did this side run while it waited?)."""
    client = Client(wire.PushReply(S.RUNNING, "", 10.0), *[TimeoutError("no answer")] * 40)
    pushes, clock, request, peer, failed = setup(client)
    handle = pushes._begin(peer, request, [[40, 41]])
    for _ in range(10):
        step(pushes, clock)  # 10 s: still within the writes' timeout
    assert not handle.done(), handle.error
    step(pushes, clock, 1.5)
    assert handle.done() and "unreachable since the push" in str(handle.error), handle.error
    assert "this decode's progress threads: own worker: pump asleep" in str(handle.error)
    assert pushes.take_counters().unreachable == 1
    # A write the producer's transport abandoned may still land when the network heals: fenced first.
    assert len(failed) == 1 and "unreachable past a push's bound" in failed[0], failed


def test_a_failed_push_fences_the_producer_before_its_blocks_go_back():
    """FAILED (the producer's write batch passed its deadline: its
    transport may have abandoned it, the bytes still queued) resolves the
    push only after the producer was fenced (``PeerDirectory.failed``
    force-closes its endpoints: tests/transport/test_fence.py), answered
    first or not. An ABORTED push (every write completed) is not fenced."""
    for script in ([wire.PushReply(S.RUNNING, "", 10.0), wire.PushReply(S.FAILED, "writes failed: deadline")],
                   [wire.PushReply(S.FAILED, "writes failed: deadline")]):
        client = Client(*script)
        pushes, clock, request, peer, failed = setup(client)
        order, resolve = [], pushes._resolve
        pushes._peer_failed = lambda p, why: order.append(("fenced", why))
        pushes._resolve = lambda h, error: (order.append(("resolved", str(error))), resolve(h, error))
        handle = pushes._begin(peer, request, [[40, 41]])
        step(pushes, clock, 2.0)
        assert handle.done() and "push failed: writes failed" in str(handle.error), handle.error
        assert order == [("fenced", "a push from it failed: writes failed: deadline"),
                         ("resolved", "push failed: writes failed: deadline")], order
    client = Client(wire.PushReply(S.RUNNING, "", 10.0), wire.PushReply(S.ABORTED, "aborted by the decode"))
    pushes, clock, request, peer, failed = setup(client)
    handle = pushes._begin(peer, request, [[40, 41]])
    pushes.abort(handle)
    step(pushes, clock, 2.0)
    assert handle.done() and "aborted" in str(handle.error) and not failed


def test_a_push_that_got_no_answer_and_is_then_refused_fences_the_producer_first():
    """A PUSH with no answer may have been taken, its writes posted, by a
    producer that then went to sleep (its transport closed) and forgot it:
    the query says UNKNOWN (the PUSH is sent again) and the PUSH again
    REFUSED. That answer says nothing of the first attempt's writes, so the
    producer is fenced before the push resolves (found by a review; before,
    it resolved with no fence)."""
    client = Client(TimeoutError("no answer"), wire.PushReply(S.UNKNOWN, "no push of this token"),
                    wire.PushReply(S.REFUSED, "this producer is asleep"))
    pushes, clock, request, peer, failed = setup(client)
    order, resolve = [], pushes._resolve
    pushes._peer_failed = lambda p, why: order.append(("fenced", why))
    pushes._resolve = lambda h, error: (order.append(("resolved", str(error))), resolve(h, error))
    handle = pushes._begin(peer, request, [[40, 41]])
    step(pushes, clock)  # the query: UNKNOWN, sent again
    step(pushes, clock)  # the PUSH again: REFUSED
    assert handle.done() and "asleep" in str(handle.error), handle.error
    assert kinds(client) == ["Push", "PushQuery", "Push"]
    assert [kind for kind, _ in order] == ["fenced", "resolved"], order
    assert "got no answer (TimeoutError: no answer), then refused" in order[0][1], order


def test_a_push_refused_at_once_is_not_fenced():
    """REFUSED with every PUSH answered: nothing was posted, nothing fenced."""
    client = Client(wire.PushReply(S.REFUSED, "the lease is gone"))
    pushes, clock, request, peer, failed = setup(client)
    handle = pushes._begin(peer, request, [[40, 41]])
    assert handle.done() and "the lease is gone" in str(handle.error)
    assert not failed


# --- a side-channel Refused, not a PushReply (a review, stop 69) ------------------------------------


REFUSED_VERSION = wire.Refused("side-channel protocol version 15 is not supported; this producer speaks "
                               "version 16: run the same rdma-kv release on both sides")


def test_a_push_answered_running_whose_producer_then_answers_refused_resolves_within_its_bound():
    """RUNNING, then the producer rank's port answers Refused to every
    query (the producer process was replaced by another release). The
    writes' bound (writes_end_within_s + 1) is checked only when a call
    raises: a Refused *reply* is 'a query misunderstood: keep asking', so
    the push, its load and its blocks are held for ever, and an abort asks
    the same way for ever."""
    client = Client(wire.PushReply(S.RUNNING, "", 10.0), *[REFUSED_VERSION] * 400)
    pushes, clock, request, peer, failed = setup(client)
    handle = pushes._begin(peer, request, [[40, 41]])
    t0 = clock.t
    for _ in range(60):
        step(pushes, clock)  # 60 s: six times the writes' bound
    pushes.abort(handle)  # the load's deadline passed long ago
    for _ in range(60):
        step(pushes, clock)
    assert handle.done(), (f"after {clock.t - t0:.0f} s and {len(client.sent)} calls the push is unresolved: its "
                           f"blocks never go back ({kinds(client)[-3:]})")


def test_a_push_that_got_no_answer_and_is_then_refused_by_the_side_channel_fences_first():
    """The PUSH got no answer (it may have been taken, its writes posted,
    by the process that then went away: over TCP its kernel still sends
    what it queued); the next call is answered Refused by whoever listens
    there now. The PushReply REFUSED twin of this is fenced
    (test_decode_pushes.py::..._then_refused_fences_the_producer_first);
    this one resolves with no fence and the blocks go back."""
    client = Client(TimeoutError("no answer"), REFUSED_VERSION)
    pushes, clock, request, peer, failed = setup(client)
    order, resolve = [], pushes._resolve
    pushes._peer_failed = lambda p, why: order.append(("fenced", why))
    pushes._resolve = lambda h, error: (order.append(("resolved", str(error))), resolve(h, error))
    handle = pushes._begin(peer, request, [[40, 41]])
    step(pushes, clock)  # the query: Refused
    assert handle.done(), handle
    assert [kind for kind, _ in order] == ["fenced", "resolved"], (
        f"a push whose PUSH got no answer resolved on a Refused reply with no fence: {order}")
