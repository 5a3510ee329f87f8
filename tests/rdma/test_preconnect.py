"""Pre-connecting: the consumer scheduler names a request's producer in the
step metadata (``connects``) the first time it sees the request, and the
worker starts the handshake before any load needs it. Against the fake
transport with a real side channel on 127.0.0.1 (as test_connector_fake)."""

from __future__ import annotations

import collections
import logging

import pytest
from rdma_testutil import wait_until
from fakes import FakeFabric
from netutil import free_port
from test_connector_fake import Pair, scheduler

from rdma_kv.connector import Request, SchedulerOutput
import rdma_kv.connector.rdma.consumer.peers as peers
from rdma_kv.connector.rdma import RdmaConnectorMetadata
from rdma_kv.connector.rdma.meta import PeerAddress
from rdma_kv.connector.rdma.params import parse_kv_transfer_params

pytestmark = pytest.mark.timeout(60)


class Events:
    """The decode worker's event counters and load records, accumulated
    (``RdmaWorker.stats()`` hands out what happened since its last call)."""

    def __init__(self, worker):
        self.worker, self.counts, self.records = worker, collections.Counter(), []

    def __getitem__(self, name):
        stats = self.worker.stats()
        if stats is not None:
            self.counts.update(stats.totals.events())
            self.records.extend(stats.requests)
        return self.counts[name]


@pytest.fixture
def pair():
    p = Pair(FakeFabric())
    yield p
    p.close()


def address(params):
    return PeerAddress.of(parse_kv_transfer_params(params))


def test_a_preconnected_peer_is_ready_for_the_first_load(pair):
    prompts = {"a": list(range(1, 40)), "b": list(range(50, 90))}
    params = pair.prefill(prompts)
    worker = pair.D.worker.worker
    events = Events(worker)
    worker.on_step(RdmaConnectorMetadata(connects=(address(params["a"]),)))
    wait_until(lambda: events["handshakes"] == 1, what="the pre-connect's handshake")
    assert pair.D.num_free_blocks() == pair.D.shape.num_blocks  # no load, no block touched
    results = pair.decode(prompts, params)
    assert all(results[r].status.value == "finished" and not results[r].load_failed for r in prompts)
    assert not any(results[r].bad_blocks for r in prompts)  # the KV read is the producer's, bit-exact
    assert events["handshakes"] == 1, "the load handshook again with a peer that was READY"
    # The decode requests' own connects found the peer known: nothing dialled.
    assert events["preconnects"] == 1
    loads = [r for r in events.records if r.request_id in prompts]
    assert len(loads) == 2 and all(r.ok and r.handshake_s is None for r in loads), loads
    pair.settle()


def test_a_load_waits_on_a_preconnect_in_flight_instead_of_dialling_again(pair):
    """The scheduler's connects and the load arrive in one step (admission
    at once): the load joins the pre-connect's handshake."""
    params = pair.prefill({"c": list(range(1, 30))})
    events = Events(pair.D.worker.worker)
    pair.decode({"c": list(range(1, 30))}, params)
    assert not pair.D.results["c"].load_failed
    assert events["preconnects"] == 1 and events["handshakes"] == 1
    pair.settle()


def test_a_failed_preconnect_is_a_failed_handshake_no_more(pair, monkeypatch, caplog):
    """A pre-connect that fails marks the peer FAILED exactly as a load's
    failed handshake does: loads from it fail at once while PEER_RETRY_S
    runs (computed locally under ``recompute``; nothing read, nothing
    waits), and after it the next load dials again and reads."""
    prompts = {f"f{i}": list(range(i * 60 + 1, i * 60 + 40)) for i in range(2)}
    params = pair.prefill(prompts)
    fabric, worker = pair.fabric, pair.D.worker.worker
    events = Events(worker)
    monkeypatch.setattr(peers, "PEER_RETRY_S", 3600.0)
    producer = fabric.agents.pop("P/tp0")  # add_peer now fails: unknown agent
    with caplog.at_level(logging.WARNING, logger="rdma_kv"):
        worker.on_step(RdmaConnectorMetadata(connects=(address(params["f0"]),)))
        wait_until(lambda: "handshake with" in caplog.text, what="the failed pre-connect")
    fabric.agents["P/tp0"] = producer
    assert events["handshakes"] == 0
    r = pair.decode({"f0": prompts["f0"]}, params)["f0"]
    assert r.load_failed and r.status.value == "finished" and fabric.reads == 0
    assert "is unavailable" in caplog.text  # the existing rule, with the pre-connect's reason
    monkeypatch.setattr(peers, "PEER_RETRY_S", 0.0)  # the retry window is over
    r = pair.decode({"f1": prompts["f1"]}, params)["f1"]
    # the data, its held words' read chained behind it
    assert not r.load_failed and r.status.value == "finished" and (fabric.reads, fabric.chained) == (1, 1)
    assert events["handshakes"] == 1
    pair.settle()


def test_a_failed_preconnect_elsewhere_leaves_other_producers_alone(pair):
    dead_port = free_port()  # nobody listens there (outside the ephemeral range: no client's port either)
    params = pair.prefill({"g": list(range(1, 30))})
    worker = pair.D.worker.worker
    events = Events(worker)
    dead = PeerAddress(address(params["g"]).engine_id, "127.0.0.1", dead_port, 1)
    worker.on_step(RdmaConnectorMetadata(connects=(dead,)))
    r = pair.decode({"g": list(range(1, 30))}, params)["g"]
    assert not r.load_failed and events["handshakes"] == 1
    pair.settle()


def test_the_scheduler_names_each_new_requests_producer_once():
    s = scheduler()
    prefill = Request("p", range(1, 9), {"do_remote_decode": True})
    prefill.num_computed_tokens = 8
    _, params = s.request_finished(prefill, [1, 2])
    other = Request("p2", range(1, 9), {"do_remote_decode": True})  # a second lease of the same producer
    other.num_computed_tokens = 8
    _, params2 = s.request_finished(other, [3, 4])
    s.build_connector_meta(SchedulerOutput())
    # (two requests with one lease's params: the second waits for the first, test_consumer_edge_review.py)
    first, second = Request("d1", range(1, 9), params), Request("d2", range(1, 9), params2)
    assert s.get_num_new_matched_tokens(first, 0) == (8, True)
    assert s.get_num_new_matched_tokens(second, 0) == (8, True)
    assert s.build_connector_meta(SchedulerOutput()).connects == (address(params),)  # one per step
    assert s.get_num_new_matched_tokens(first, 0) == (8, True)  # still waiting for admission
    assert s.build_connector_meta(SchedulerOutput()).connects == ()
    bad = Request("d3", range(1, 5), params)  # prompt length differs: computed locally
    assert s.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert s.build_connector_meta(SchedulerOutput()).connects == ()
