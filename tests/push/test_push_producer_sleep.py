"""A producer that goes to sleep while one of its push writes into a decode
is still in flight answers the decode's PUSH_QUERY 'UNKNOWN' (its pusher is
dropped at the very start of ``RdmaProducer.suspend``, before the transport
is closed, i.e. before its in-flight writes are drained/failed). The decode
treats 'UNKNOWN after an answer' as 'forgotten long after it resolved'
(consumer/pushes.py), fails the load and hands the blocks back to its engine
while the write into them can still land.

The fake transport's ``close`` is made to model the real Agent.close drain
(in-flight operations are let finish for up to close_drain_s=1 s before
being failed): it waits until the test lets it go, then the held write
completes (it lands, as a write that finished within the drain does).

Correct behaviour asserted: the decode never releases blocks that a write
still in flight targets. Found by an adversarial review: request x, given
r's blocks afterwards, had 8 blocks overwritten by the late write. Now the
producer's pusher answers queries (RUNNING) until its transport is closed,
and a decode told UNKNOWN after an answer drops its endpoints to the
producer before the blocks go back.
"""
from __future__ import annotations

import threading
import time

import pytest
from fakes import FakeFabric, FakeTransport
from test_push_sleep import SHAPE, config, held_push

from rdma_kv.harness.engine import Engine

pytestmark = pytest.mark.timeout(90)

def test_decode_does_not_release_blocks_while_a_push_write_into_them_is_in_flight():
    fabric = FakeFabric()
    kw = {"transport_factory": fabric.factory}
    P = Engine(config("kv_producer", "P", "fail"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    D = Engine(config("kv_consumer", "D", "fail"), SHAPE, connector_kwargs=kw, prefix_caching=False)
    drain = threading.Event()
    orig_close = FakeTransport.close

    def draining_close(self):
        if self.name.startswith("P/"):
            drain.wait(20)  # the real close lets in-flight ops finish (close_drain_s) first
            fabric.release_all(reader=self.name)  # ...and this one finished within the drain: it lands
        orig_close(self)

    FakeTransport.close = draining_close
    sleeper = None
    try:
        held_push(P, D, fabric)
        # let the decode get its RUNNING answer
        for _ in range(20):
            D.step()
            time.sleep(0.01)
        d_blocks = list(D.requests["r"].block_ids)
        # The producer goes to sleep (vLLM calls unregister_kv_caches on its worker).
        sleeper = threading.Thread(target=P.sleep, daemon=True)
        sleeper.start()
        released_while_pending = None
        deadline = time.monotonic() + 10
        while "r" in D.requests and time.monotonic() < deadline:
            D.step()
            time.sleep(0.01)
        if "r" not in D.requests:
            with fabric.lock:
                pending_into_d = [x for x in fabric.pending if x.peer.startswith("D/")]
            released_while_pending = (D.results["r"].status.value, len(pending_into_d),
                                      set(d_blocks) <= set(range(SHAPE.num_blocks)) and D.pool.num_free)
        # Another request now takes the freed blocks, computed locally on D.
        other = list(range(100, 100 + SHAPE.num_blocks * SHAPE.block_size - 1))  # every block of the pool
        D.add_request("x", other)
        xreq = D.requests["x"]
        D.step()
        assert D.verify_blocks(xreq, range(len(xreq.block_ids))) == []  # x's KV is right when computed
        drain.set()
        sleeper.join(10)
        corrupted = D.verify_blocks(xreq, range(len(xreq.block_ids)))
        print("x's blocks", xreq.block_ids, "overlap with r's", sorted(set(xreq.block_ids) & set(d_blocks)),
              "; x's blocks overwritten by the late push:", corrupted)
        print("decode resolved:", released_while_pending)
        assert released_while_pending is None or released_while_pending[1] == 0, (
            f"decode finished request r ({released_while_pending[0]}) and freed its blocks {d_blocks} "
            f"while {released_while_pending[1]} push write(s) into its KV cache were still in flight on the "
            "sleeping producer (it answered the decode's query UNKNOWN)"
            f"; request x, later given blocks {xreq.block_ids}, had blocks {corrupted} overwritten by that write")
    finally:
        FakeTransport.close = orig_close
        drain.set()
        fabric.hold = False
        fabric.release_all()
        P.shutdown()
        D.shutdown()
