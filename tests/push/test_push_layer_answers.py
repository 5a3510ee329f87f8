"""Layer-wise writes never land after the producer gave the decode its
final answer (found by an adversarial review; each test fails on the code
before: the write landed).

- A decode's abort answered between the engine thread's check of the
  registration and its post of a layer batch: ABORTED, then the batch.
- A registration expired (its prefill slow) while its layers were being
  written: the expiry's flush posted and answered REFUSED, and the next
  layer of the same step was posted after it.
- A seal that found a problem (the legs' prompt lengths differ) answered
  REFUSED at once while layer batches were on the wire.
"""

from __future__ import annotations

import types

from leaseutil import ref
from test_pusher import INC, S, Setup

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.meta import LayerPushSpec, SendSpec
from rdma_kv.connector.rdma.pusher import PushWriter


def layer_setup():
    s = Setup()
    s.writer = PushWriter(s.p, s.writer._geometry, s.leases, write_timeout_s=5.0, clock=s.clock, block_size=4,
                          layerwise=True, wait_s=30.0)
    hello = wire.PushHello(wire.PROTOCOL_VERSION, "D", wire.RankInfo(0, 1, 2), INC, 1, s.d.metadata(),
                           wire.GeometryWire.from_geometry(s.g_dst))
    assert s.writer.hello(hello).state is S.DONE
    token = b"T" * 16
    reg = wire.PushReg(wire.PROTOCOL_VERSION, "t1", token, "D", 0, INC, 1, 0, 8, [[40, 41]])
    assert s.writer.register(reg).state is S.WAITING
    return s, token


def landed(s, layer):
    return bool(s.dst[layer][[40, 41]].any())


def test_an_abort_answered_before_a_layer_post_stops_the_post():
    s, token = layer_setup()
    answers = []
    real = s.p.prep_remote

    def racing(name, descs):  # the side channel thread takes the decode's abort here
        answers.append(s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token, abort=True)))
        answers.append((landed(s, "l0"), landed(s, "l1")))
        return real(name, descs)

    s.p.prep_remote = racing
    s.writer.begin_step([LayerPushSpec("t1", "r1", (10, 11), 0, 8)])
    s.writer.write_layer("l0")  # engine thread
    assert answers[0].state is S.ABORTED
    assert not landed(s, "l0"), "a layer write landed after the producer answered ABORTED"


def slow_flushes(s):
    """Every flush takes its round trip: pending until the test completes it."""
    fabric, orig, flushes = s.fabric, s.p.flush, []

    def slow_flush(peer, notify=None, timeout_s=None):
        dummy = types.SimpleNamespace(reader=s.p.name, peer=s.p.aliases.get(peer, peer), via=peer)
        with fabric.lock:
            fabric.pending.append(dummy)
        x = orig(peer, notify=notify, timeout_s=timeout_s)
        with fabric.lock:
            fabric.pending.remove(dummy)
            if x in fabric.pending:
                fabric.pending.remove(x)
        flushes.append(x)
        return x

    s.p.flush = slow_flush
    return flushes


def test_a_layer_of_a_registration_that_expired_mid_step_is_not_posted():
    s, token = layer_setup()
    fabric = s.fabric
    flushes = slow_flushes(s)
    s.writer.begin_step([LayerPushSpec("t1", "r1", (10, 11), 0, 8)])
    s.writer.write_layer("l0")  # posted and complete at once
    s.clock.t += 31  # the prefill is slow: the registration's wait_s passes mid-step
    s.writer.reap()  # side channel thread (a PUSH_REG or PUSH_QUERY arrived): expired, flush posted
    assert len(flushes) == 1 and not flushes[0].done()  # (on the wire until resolved below)
    fabric.hold = True  # the l1 batch takes its time on the wire, as any write does
    s.writer.write_layer("l1")  # engine thread: the next layer of the same step
    flushes[0]._resolve(None)  # the flush completes (it covers only what was posted before it)
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token))
    assert reply.state is S.REFUSED  # the decode now hands blocks 40, 41 back to its engine
    s.dst["l1"][[40, 41]] = 0  # (canary: the engine reused the blocks)
    fabric.release_all()  # the l1 batch posted after the flush completes
    assert not landed(s, "l1"), "a layer write landed after the producer answered REFUSED"


def test_a_seal_that_finds_a_problem_answers_only_after_the_layer_writes_are_flushed():
    """The seal finds a problem (here: the legs' prompt lengths differ) and
    answers REFUSED at once, although layer-wise writes of the registration
    are still on the wire."""
    s, token = layer_setup()
    s.fabric.hold = True
    s.writer.begin_step([LayerPushSpec("t1", "r1", (10, 11), 0, 8)])
    s.writer.write_layer("l0")
    s.writer.write_layer("l1")
    s.writer.end_step()
    s.writer.granted(SendSpec("r1", [10, 11], ref(1), 10.0, transfer_id="t1", num_tokens=7))
    reply = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token))
    terminal = reply.state not in (S.RUNNING, S.WAITING)  # the decode hands blocks 40, 41 back now
    s.fabric.release_all()
    assert not (terminal and (landed(s, "l0") or landed(s, "l1"))), "layer writes landed after a final answer"
    final = s.writer.query(wire.PushQuery(wire.PROTOCOL_VERSION, token))
    assert final.state not in (S.RUNNING, S.WAITING, S.DONE)
