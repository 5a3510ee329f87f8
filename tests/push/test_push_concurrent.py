"""Push mode with concurrent dispatch: the decode registers its blocks under
the router's ``transfer_id`` before (or after) the prefill ran; the producer
writes once the prefill under that id finished. The request ids carry the
prefill's registered address as vllm-router's moriio mode and Ray Serve
write them (``___prefill_addr_..___decode_addr_.._<32 hex>``). Harness
engines in this process over the fake transport; every block verified."""

from __future__ import annotations

import functools
import secrets
import threading
import time
import uuid

import pytest
from fakes import FakeFabric
from rdma_testutil import wait_until

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma import pusher as pusher_module
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.params import format_router_address
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.errors import PeerError
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(120)

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=128, dtype="float32")
BLOCK_NBYTES = SHAPE.num_layers * 2 * SHAPE.num_kv_heads * SHAPE.head_size * SHAPE.block_size * 4
"""One block, every layer's K and V (float32)."""


def config(role: str, engine_id: str, mode: str = "push", **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                            kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"mode": mode, "rpc_timeout_s": 1.0, "load_timeout_s": 10.0,
                                                       "push_layerwise": True, **extra})


class Pair:
    def __init__(self, p_extra=None, d_mode="push", start_load="after_forward"):
        self.fabric = FakeFabric()
        kw = {"transport_factory": self.fabric.factory}
        self.P = Engine(config("kv_producer", "prefill-1", **(p_extra or {})), SHAPE, connector_kwargs=kw,
                        start_load=start_load)
        self.D = Engine(config("kv_consumer", "decode-1", mode=d_mode), SHAPE, connector_kwargs=kw)

    def close(self):
        self.P.shutdown()
        self.D.shutdown()

    def pump(self):
        self.P.step()
        self.D.step()

    def ids(self):
        """The two legs' request ids, as vLLM makes them from the router's X-Request-Id."""
        port = self.P.worker.worker.side_channel_port
        p_addr = format_router_address("127.0.0.1", port, "prefill-1", 1)
        header = f"___prefill_addr_{p_addr}___decode_addr_host:127.0.0.1,handshake:1,engine:decode-1,tp:1_" \
                 f"{uuid.uuid4().hex}"
        return f"cmpl-{header}-0-aaaa1111", f"cmpl-{header}-0-bbbb2222", f"tx-{uuid.uuid4().hex}"

    def prefill(self, rid, prompt, tid):
        self.P.add_request(rid, prompt, {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid,
                                         "remote_engine_id": None, "remote_block_ids": None,
                                         "remote_dp_size": 1, "remote_tp_size": 1})

    def decode(self, rid, prompt, tid):
        self.D.add_request(rid, prompt, {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
                                         "remote_engine_id": None, "remote_block_ids": None,
                                         "remote_dp_size": 1, "remote_tp_size": 1})

    def decode_registered(self, rng):
        """A decode leg registered with the producer before its prefill leg
        was sent: (prefill id, decode id, transfer id, prompt of 4 whole
        blocks and a partial one)."""
        p_rid, d_rid, tid = self.ids()
        prompt = rng.integers(1, 999, 4 * SHAPE.block_size + 3).tolist()
        self.decode(d_rid, prompt, tid)
        wait_until(lambda: self.registered() == 1, step=self.pump, what="the decode's registration")
        return p_rid, d_rid, tid, prompt

    def pushed(self, rng):
        """One request end to end, decode leg first: its decode's result."""
        p_rid, d_rid, tid, prompt = self.decode_registered(rng)
        self.prefill(p_rid, prompt, tid)
        wait_until(lambda: self.finished(d_rid), step=self.pump, what="the decode")
        return self.D.results[d_rid]

    def writer(self):
        return self.P.worker.worker.side_channel_handler.pusher

    def hello_of(self, engine_id):
        """A PUSH_HELLO of decode ``engine_id`` (this pair's decode's KV cache),
        to be given its link and that link's endpoint ordinal."""
        local = self.D.worker.worker._local
        return functools.partial(wire.PushHello, wire.PROTOCOL_VERSION, engine_id, wire.RankInfo(0, 1, 1),
                                 b"x" * 8, 1, local.transport.metadata(),
                                 wire.GeometryWire.from_geometry(local.geometry))

    def connect(self):
        """The decode dials the producer rank, as a load's admission does (no
        push): the new peer, its handshake under way."""
        from rdma_kv.connector.rdma.meta import PeerAddress

        consumer = self.D.worker.worker._consumer
        address = PeerAddress("prefill-1", "127.0.0.1", self.P.worker.worker.side_channel_port, 1)
        with consumer._lock:
            peer = consumer.peers._connect(address, 0)
        assert peer is not None
        return peer

    def handshaken(self, peer):
        """``peer`` once its handshake ended (READY or FAILED)."""
        wait_until(lambda: peer.state.value != "connecting", step=self.pump, what="the handshake")
        return peer

    def dial(self):
        return self.handshaken(self.connect())

    def dial_failing_once(self, why):
        """The decode dials the producer rank twice (``PEER_RETRY_S``
        patched to 0): the first handshake fails saying ``why`` and its link
        is fenced, the second makes the peer READY, which is returned."""
        peer = self.dial()
        assert peer.state.value == "failed" and why in peer.error, peer.error
        fenced = self.D.worker.worker._consumer._local.transport.fenced
        assert len(fenced) == 1, "the link whose handshake failed is fenced"
        peer = self.dial()
        assert peer.state.value == "ready", peer.error
        return peer

    def registered(self):
        """Registrations the producer holds, not yet resolved."""
        return self.P.worker.worker.resources().get("pushes_running", 0)

    def finished(self, rid):
        r = self.D.results.get(rid)
        return r is not None and r.status.value in ("finished", "failed")


@pytest.mark.parametrize("order", ["decode_first", "prefill_first", "together"])
def test_the_decode_registers_under_the_transfer_id_and_the_producer_writes(rng, order):
    pair = Pair()
    try:
        legs = {}
        for i in range(6):
            p_rid, d_rid, tid = pair.ids()
            prompt = rng.integers(1, 999, int(rng.integers(3, 40))).tolist()
            legs[d_rid] = (p_rid, prompt, tid)
        for d_rid, (p_rid, prompt, tid) in legs.items():
            if order == "prefill_first":
                pair.prefill(p_rid, prompt, tid)
                wait_until(lambda: p_rid in pair.P.results, step=pair.pump, what="the prefill")
                pair.decode(d_rid, prompt, tid)
            elif order == "decode_first":
                pair.decode(d_rid, prompt, tid)
                for _ in range(3):  # the decode registers; its prefill has not started
                    pair.pump()
                pair.prefill(p_rid, prompt, tid)
            else:
                pair.prefill(p_rid, prompt, tid)
                pair.decode(d_rid, prompt, tid)
        wait_until(lambda: all(pair.finished(r) for r in legs), step=pair.pump, what="the decodes")
        for rid in legs:
            r = pair.D.results[rid]
            assert r.status.value == "finished" and not r.load_failed, (rid, r.error)
            assert r.external_tokens and r.bad_blocks == [], rid
        assert pair.fabric.writes >= len(legs) and pair.fabric.reads == 0
        wait_until(lambda: not pair.P.held and not pair.D.requests and len(pair.P.worker.worker.leases) == 0,
                   step=pair.pump, what="the producer freeing every block")
    finally:
        pair.close()


def test_a_registration_no_prefill_matches_ends_as_a_load_error_within_its_bound(caplog):
    pair = Pair(p_extra={"load_timeout_s": 1.5})  # the producer keeps a registration 1.5 s
    try:
        _, d_rid, tid = pair.ids()
        prompt = list(range(1, 30))
        t0 = time.monotonic()
        pair.decode(d_rid, prompt, tid)  # its prefill never comes (the router's prefill leg failed)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode", timeout_s=30)
        r = pair.D.results[d_rid]
        assert r.load_failed and r.recomputed_from_block == 0 and r.bad_blocks == [], r
        assert time.monotonic() - t0 < 20
        assert f"no prefill under transfer id {tid!r} finished" in caplog.text
        assert pair.fabric.writes == 0
    finally:
        pair.close()


def test_a_pull_decode_given_a_transfer_id_computes_locally_and_says_why(caplog):
    pair = Pair(d_mode="pull")
    try:
        _, d_rid, tid = pair.ids()
        pair.decode(d_rid, list(range(1, 30)), tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode")
        assert pair.D.results[d_rid].external_tokens == 0
        assert "needs mode 'push' on both engines" in caplog.text
    finally:
        pair.close()


def producer_push_totals(pair: Pair) -> dict:
    return pair.P.worker.get_kv_connector_stats()["totals"]


@pytest.mark.parametrize("start_load", ["after_forward", "before_forward"])
def test_a_registration_before_the_prefill_is_written_layer_by_layer_then_sealed(rng, start_load):
    """The decode registers first: each layer's complete blocks go out as the
    producer's forward pass stores that layer (save_kv_layer), the rest and
    the notification at the seal (a flush of every endpoint). In either
    order of ``start_load_kv``: vLLM 0.32 calls it after the forward pass
    (its loads are asynchronous), so the step's layer-wise writes are set up
    when the metadata is bound. (Set up in ``start_load_kv``, no layer went
    out during vLLM's forward passes: every byte was written after them.)"""
    pair = Pair(start_load=start_load)
    try:
        r = pair.pushed(rng)
        assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)
        stats = pair.P.worker.get_kv_connector_stats()
        totals = stats["totals"]
        # One batch per layer for the four whole blocks, one for the partial block at the seal.
        assert totals["push_layer_writes"] == SHAPE.num_layers + 1, totals
        assert totals["push_done"] == 1 and totals["push_registrations_early"] == 1, totals
        assert totals["push_layer_steps"] == 1 and "push_layer_steps_caught_up" not in totals, totals
        (record,) = stats["pushes"]
        assert record["overlapped_nbytes"] == 4 * BLOCK_NBYTES and record["nbytes"] == 5 * BLOCK_NBYTES, record
    finally:
        pair.close()


def test_a_failed_layer_write_fails_the_push_even_though_the_seal_flush_succeeds(rng, monkeypatch):
    """No notification for a push one of whose layer batches failed: the
    decode recomputes, and its blocks never counted as loaded."""
    from rdma_kv.connector.rdma.consumer import peers

    monkeypatch.setattr(peers, "PEER_RETRY_S", 0.0)  # the decode retries the producer at once
    pair = Pair()
    try:
        p_rid, d_rid, tid, prompt = pair.decode_registered(rng)
        pair.fabric.hold = True
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: len(pair.fabric.pending) >= SHAPE.num_layers, step=pair.pump, what="layer writes held")
        pair.fabric.hold = False
        pair.fabric.release_all(error=RuntimeError("injected layer write failure"))
        wait_until(lambda: pair.finished(d_rid), step=lambda: (pair.fabric.release_all(), pair.pump()),
                   what="the decode")
        r = pair.D.results[d_rid]
        assert r.load_failed and r.recomputed_from_block == 0 and r.bad_blocks == [], r
        totals = producer_push_totals(pair)
        assert totals.get("push_done", 0) == 0 and totals["push_failed"] == 1, totals
        # The failed write may have closed the transport's endpoint to the decode: the producer
        # forgot the decode, and its next push introduces it again (a fresh add_peer) and lands.
        # (Kept, every later push to the decode failed against the dead endpoint.)
        p_rid, d_rid, tid, prompt = pair.decode_registered(rng)
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the next decode")
        r = pair.D.results[d_rid]
        assert not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)
        totals = producer_push_totals(pair)
        assert totals["push_hellos"] == 1 and totals["push_done"] == 1, totals
    finally:
        pair.close()


def test_layers_the_engine_never_hands_to_save_kv_layer_are_written_after_the_pass(rng, monkeypatch):
    """vLLM skips ``save_kv_layer`` where a layer has no attention metadata.
    The blocks of a step count as written only once every layer was posted:
    ``wait_for_save`` posts the missing ones. (Counting them written anyway
    sent vLLM's decodes blocks never written: completions differed, silently.)"""
    from rdma_kv.connector.rdma import RdmaConnector

    original = RdmaConnector.save_kv_layer
    skipped = SHAPE.layer_names[-1]

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs):
        if layer_name != skipped:
            original(self, layer_name, kv_layer, attn_metadata, **kwargs)

    monkeypatch.setattr(RdmaConnector, "save_kv_layer", save_kv_layer)
    pair = Pair()
    try:
        r = pair.pushed(rng)
        assert not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)
        stats = pair.P.worker.get_kv_connector_stats()
        totals = stats["totals"]
        # The skipped layer went out after the forward pass (wait_for_save), not at the seal.
        assert totals["push_layer_steps_caught_up"] == 1 and totals.get("push_layer_steps", 0) == 0, totals
        (record,) = stats["pushes"]
        assert record["outcome"] == "done" and 0 < record["overlapped_nbytes"] < record["nbytes"], record
    finally:
        pair.close()



@pytest.mark.parametrize("when", ["first_layer", "last_layer", "after_forward"])
def test_a_decode_that_registers_during_the_prefills_forward_pass_joins_it(rng, monkeypatch, when):
    """With concurrent dispatch the decode's registration usually arrives
    while the prefill's (single-step) forward pass runs. It joins at the
    next layer stored, and gets the layers stored before it came in the same
    batch; one that comes after the last layer gets every layer when the
    forward pass ends (wait_for_save); the partial last block goes at the
    seal. The decode's blocks are all verified; the producer's per-request
    record says how much overlapped the forward pass."""
    from rdma_kv.connector.rdma import RdmaConnector

    pair = Pair()
    p_rid, d_rid, tid = pair.ids()
    prompt = rng.integers(1, 999, 4 * SHAPE.block_size + 3).tolist()  # 4 whole blocks and a partial one
    hook_layer = {"first_layer": SHAPE.layer_names[0], "last_layer": SHAPE.layer_names[-1]}.get(when)
    state = {"registered": False}

    def register_now():
        pair.decode(d_rid, prompt, tid)
        wait_until(lambda: pair.registered() == 1, step=pair.D.step, what="the decode's registration")
        state["registered"] = True

    original_save, original_wait = RdmaConnector.save_kv_layer, RdmaConnector.wait_for_save

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs):
        if self is pair.P.worker and layer_name == hook_layer and not state["registered"]:
            register_now()
        original_save(self, layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        if self is pair.P.worker and when == "after_forward" and not state["registered"]:
            register_now()
        original_wait(self)

    monkeypatch.setattr(RdmaConnector, "save_kv_layer", save_kv_layer)
    monkeypatch.setattr(RdmaConnector, "wait_for_save", wait_for_save)
    try:
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode")
        assert state["registered"]
        r = pair.D.results[d_rid]
        assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)
        stats = pair.P.worker.get_kv_connector_stats()
        totals = stats["totals"]
        (record,) = stats["pushes"]
        assert record["outcome"] == "done" and record["nbytes"] == 5 * BLOCK_NBYTES, record
        if when == "after_forward":
            # Every layer of the four whole blocks in one batch after the forward pass, the partial block at the seal.
            assert totals["push_layer_steps_caught_up"] == 1 and totals["push_layer_writes"] == 2, totals
            assert record["overlapped_nbytes"] == 0, record
        else:
            # Joined during the pass: the layers stored before it came went with the current one.
            expected_batches = {"first_layer": SHAPE.num_layers, "last_layer": 1}[when] + 1
            assert totals["push_layer_steps"] == 1 and totals["push_layer_writes"] == expected_batches, totals
            assert record["overlapped_nbytes"] == 4 * BLOCK_NBYTES, record
            assert totals["push_overlapped_bytes"] == 4 * BLOCK_NBYTES, totals
    finally:
        pair.close()


def test_a_registration_naming_blocks_past_the_decodes_cache_is_refused_before_any_write(rng):
    """Layer-wise writes go out as the prefill's forward pass stores each
    layer, long before the seal plans the whole push: a PUSH_REG whose
    block ids lie past the decode's cache was written into the next row
    (another layer's blocks, never named) before the seal's check failed
    the push. The producer now refuses such a registration when it comes,
    naming the ids and the cache; nothing is written for it."""
    pair = Pair()
    try:
        p_rid, d_rid, tid = pair.ids()  # an honest pair first: the decode introduces its KV cache
        prompt = rng.integers(1, 999, 4 * SHAPE.block_size + 3).tolist()
        pair.decode(d_rid, prompt, tid)
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the honest decode")
        assert not pair.D.results[d_rid].load_failed
        writes = pair.fabric.writes
        p2, _, tid2 = pair.ids()
        prompt2 = rng.integers(1, 999, 4 * SHAPE.block_size).tolist()
        n = SHAPE.num_blocks
        client = SideChannelClient("127.0.0.1", pair.P.worker.worker.side_channel_port, rpc_timeout_s=5.0, retries=0)
        try:
            reply = client.call(wire.PushReg(wire.PROTOCOL_VERSION, tid2, secrets.token_bytes(16), "decode-1", 0,
                                              pair.D.worker.worker._incarnation, 1, 0, len(prompt2), [[n - 1, n, n + 1, n + 2]]))
        finally:
            client.close()
        assert isinstance(reply, wire.PushReply) and reply.state is wire.PushState.REFUSED, reply
        assert f"decode block ids [{n}, {n + 1}, {n + 2}] are outside [0, {n})" in reply.detail
        pair.prefill(p2, prompt2, tid2)  # its prefill runs, layer by layer: nothing goes to the decode
        wait_until(lambda: p2 in pair.P.results, step=pair.pump, what="the prefill")
        for _ in range(5):
            pair.pump()
        assert pair.fabric.writes == writes
        assert pair.registered() == 0
    finally:
        pair.close()


def test_a_producer_knows_at_most_max_decodes_and_a_forgotten_decode_introduces_itself_again(rng, monkeypatch):
    """Each PUSH_HELLO of a new decode rank kept its geometry (a peer may send
    a megabyte of it) for ever: 60 introductions took the producer from 234
    to 376 MB. Past MAX_DECODES (2 here) a new one replaces the least
    recently used decode with no push under way; that decode, pushed to
    again, is told to introduce itself. It does not on the same link (the
    producer's new endpoint would pair with none of its own, out of reach
    of its fence: protocol 13): that load is refused and recomputed, the
    decode fences the link, and the next load dials the producer again,
    introduces itself, and reads."""
    monkeypatch.setattr(pusher_module, "MAX_DECODES", 2)
    pair = Pair()
    try:
        def serve(what):
            p_rid, d_rid, tid = pair.ids()
            prompt = rng.integers(1, 999, 3 * SHAPE.block_size + 1).tolist()
            pair.decode(d_rid, prompt, tid)
            pair.prefill(p_rid, prompt, tid)
            wait_until(lambda: pair.finished(d_rid), step=pair.pump, what=what)
            r = pair.D.results[d_rid]
            assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)

        serve("the first decode")
        writer = pair.P.worker.worker.side_channel_handler.pusher
        local = pair.D.worker.worker._local  # other decode ranks' introductions, as one peer may make them
        geometry = wire.GeometryWire.from_geometry(local.geometry)
        client = SideChannelClient("127.0.0.1", pair.P.worker.worker.side_channel_port, rpc_timeout_s=5.0, retries=0)
        try:
            for i in range(5):
                other = pair.fabric.factory(f"other-{i}")  # a worker of its own
                other.regions = list(local.transport.regions)
                reply = client.call(wire.PushHello(wire.PROTOCOL_VERSION, f"other-{i}", wire.RankInfo(0, 1, 1),
                                                   b"i" * 8, 1, other.metadata(), geometry, f"other-{i}", 1))
                assert isinstance(reply, wire.PushReply) and reply.state is wire.PushState.DONE, reply
                assert len(writer._decodes) == 2
        finally:
            client.close()
        assert ("decode-1", 0, pair.D.worker.worker._incarnation) not in writer._decodes
        p_rid, d_rid, tid = pair.ids()  # the forgotten decode: refused with 'introduce', recomputed
        prompt = rng.integers(1, 999, 3 * SHAPE.block_size + 1).tolist()
        pair.decode(d_rid, prompt, tid)
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the forgotten decode")
        r = pair.D.results[d_rid]
        assert r.load_failed and r.recomputed_from_block == 0 and r.bad_blocks == [], (r.error, r.bad_blocks)
        assert pair.D.worker.worker._local.transport.fenced, "the link the producer forgot was not fenced"
        from rdma_kv.connector.rdma.consumer import peers as peers_module

        monkeypatch.setattr(peers_module, "PEER_RETRY_S", 0.0)  # the decode dials the producer again at once
        serve("the forgotten decode, dialled again")  # introduces itself on the new link
        totals = producer_push_totals(pair)
        assert totals["push_decodes_forgotten"] == 5 and totals["push_hellos"] == 7, totals
    finally:
        pair.close()


def test_a_layer_pushed_ahead_of_its_save_kv_layer_fails_verification(rng, monkeypatch):
    """The harness stores each layer's KV in its turn (vLLM's attention
    hooks: wait_for_layer_load, the layer, save_kv_layer), so a producer that
    writes a layer before the engine handed it over sends what was in memory
    then. Before, the harness's forward stored every layer before the first
    save_kv_layer: a pusher that posted all layers at the first one passed,
    bit-exact, where vLLM would have sent the later layers unwritten."""
    from rdma_kv.connector.rdma.pushreg import ConcurrentDispatch

    def write_every_layer(self, layer_name):  # the bug: layers ahead of their save_kv_layer
        if self._step:
            for layer in self._geometry.layers:
                if layer.name not in self._stored:
                    self._layer_stored(layer.name, overlapped=True)

    monkeypatch.setattr(ConcurrentDispatch, "write_layer", write_every_layer)
    pair = Pair()
    try:
        r = pair.pushed(rng)
        assert r.status.value == "finished" and not r.load_failed, r.error
        assert r.bad_blocks == [0, 1, 2, 3], r.bad_blocks  # the whole blocks went out layer-wise; the partial one at the seal
    finally:
        pair.close()


def test_children_of_one_decode_request_register_once_and_none_fails(rng):
    """vLLM runs a request with ``n > 1`` as child requests (``<i>_<id>``)
    that all carry its ``kv_transfer_params``, here one ``transfer_id``. Each
    child registered under it; the producer takes one registration per
    reader at a time, so the others were REFUSED: a load error (under
    kv_load_failure_policy=fail, an error for the client's request). Now the
    first child registers and the others wait for its KV, then are computed
    locally (in vLLM from the prefix cache its load filled), as in pull mode
    (tests/rdma/test_consumer_edge_review.py)."""
    pair = Pair()
    try:
        p_rid, d_rid, tid = pair.ids()
        prompt = rng.integers(1, 999, 4 * SHAPE.block_size + 3).tolist()
        children = [f"{i}_{d_rid}" for i in range(3)]
        for rid in children:
            pair.decode(rid, prompt, tid)
        for _ in range(3):
            pair.pump()
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: all(pair.finished(r) for r in children), step=pair.pump, what="the children")
        for rid in children:
            r = pair.D.results[rid]
            assert r.status.value == "finished" and not r.load_failed, (rid, r.error)
        assert [rid for rid in children if pair.D.results[rid].external_tokens] == children[:1]
        assert pair.D.results[children[0]].bad_blocks == []
    finally:
        pair.close()


def test_every_link_is_introduced_at_its_handshake_with_or_without_a_push(rng):
    """The decode's fence closes its own endpoint to a producer rank, which
    stops the producer's writes only through UCX's pairing of the two sides'
    endpoints by count (docs/reliability.md, "The fence and UCX's endpoint
    pairing"). A link made at a handshake and never introduced (its load
    aborted before the push) put the decode's count ahead for good. Now the
    handshake introduces the decode on each new link, before any push, and
    a second handshake (the producer dialled again) introduces it again."""
    pair = Pair()
    try:
        consumer = pair.D.worker.worker._consumer
        writer = pair.P.worker.worker.side_channel_handler.pusher
        links: list[str] = []
        for _ in range(2):
            peer = pair.dial()  # a dial, as a load's admission makes one; no push
            assert peer.state.value == "ready", peer.error
            (decode,) = writer._decodes.values()  # introduced, on this link, with no push sent
            assert decode.link == peer.connection.name and decode.link not in links
            # Both imports ``paired``: one endpoint each, the only one the producer writes through,
            # and the one the decode's fence closes (a lane's would pair with none of the decode's).
            assert consumer._local.transport.paired[decode.link] and writer._transport.paired[decode.name]
            links.append(decode.link)
            assert not writer._pushes and pair.registered() == 0  # (nothing pushed nor registered)
            with consumer._lock:  # forgotten as idle: the next dial makes a new link
                names = consumer.peers.prune(float("inf"), set)
            consumer.peers.remove(names)
    finally:
        pair.close()


@pytest.mark.parametrize("taken", [True, False], ids=["taken", "never-arrived"])
def test_an_introduction_whose_answer_was_lost_is_made_up_at_the_next_link(monkeypatch, taken):
    """The decode's introduction on its first link got no answer: the
    producer took it (imported the decode) or it never arrived; the decode
    cannot tell. It fences that link and dials again, and its next
    introduction names the new link's endpoint number (2): the producer
    makes its import that number, making up the first when it never
    imported it, so the two sides' endpoints stay paired (protocol 14;
    before, the never-arrived case left the producer's import paired with
    the decode's fenced first endpoint, and every later fence missed)."""
    from rdma_kv.connector.rdma.consumer import peers as peers_module

    lose = [True]
    real_call = SideChannelClient.call

    def call(self, request, *args, **kwargs):
        if isinstance(request, wire.PushHello) and lose[0]:
            lose[0] = False
            if taken:
                real_call(self, request, *args, **kwargs)
            raise PeerError("side channel: no answer (the test lost it)")
        return real_call(self, request, *args, **kwargs)

    monkeypatch.setattr(SideChannelClient, "call", call)
    monkeypatch.setattr(peers_module, "PEER_RETRY_S", 0.0)
    pair = Pair()
    try:
        writer = pair.P.worker.worker.side_channel_handler.pusher
        transport = pair.D.worker.worker._consumer._local.transport
        peer = pair.dial_failing_once("no answer")
        link = peer.connection.name
        (decode,) = writer._decodes.values()
        assert decode.link == link and transport.ordinal(link) == 2 and decode.ordinal == 2
        assert writer._transport.ordinal(decode.name) == 2  # paired with the decode's second endpoint
        assert writer._transport.padded == (0 if taken else 1)
    finally:
        pair.close()


def test_an_introduction_answered_by_another_life_of_the_producer_fails_the_handshake(monkeypatch):
    """The producer's life changed while it answered the decode's
    introduction (it slept and woke under the call): which transport
    imported the decode, and against which worker its endpoint was
    numbered, is not known, and the answer says so (an empty life). The
    decode's check (the answer's life must be the handshake's) fails the
    handshake and fences the link; the next dial introduces the decode to
    the new transport (found by a review; before, any DONE was taken). The
    producer's own check (protocol 15: a hello naming another life is
    refused) is the other test's."""
    from rdma_kv.connector.rdma.consumer import peers as peers_module

    monkeypatch.setattr(peers_module, "PEER_RETRY_S", 0.0)
    pair = Pair()
    handler = pair.P.worker.worker.side_channel_handler
    writer = pair.writer()
    real_hello = writer.hello

    once = [True]

    def hello(request):
        reply = real_hello(request)
        if once:
            once.pop()
            handler.life = writer.life = secrets.token_bytes(8)  # (a wake under the call: a new life)
        return reply

    monkeypatch.setattr(writer, "hello", hello)
    try:
        pair.dial_failing_once("restarted")
    finally:
        pair.close()


@pytest.mark.parametrize("links_before", [1, 3])
def test_a_producer_that_sleeps_and_wakes_under_an_introduction_takes_the_next_dial(monkeypatch, links_before):
    """The producer really sleeps and wakes (new transport, worker and
    pusher) while the decode's PUSH_HELLO is on its way, after
    ``links_before`` links to its old worker. The hello names the life that
    answered its handshake (protocol 15): the new pusher refuses it before
    importing anything, the handshake fails and the link is fenced, and the
    next dial (the decode's first endpoint to the new worker) is taken.
    Before, the new pusher imported the decode under the old worker's
    number and refused the next ``links_before`` dials "out of date" (a
    review's reproduction: 1 and 3 refusals)."""
    from rdma_kv.connector.rdma.consumer import peers as peers_module

    monkeypatch.setattr(peers_module, "PEER_RETRY_S", 0.0)
    real_call = SideChannelClient.call
    hold, arrived, armed = threading.Event(), threading.Event(), [False]

    def call(self, request, *args, **kwargs):
        if isinstance(request, wire.PushHello) and armed[0] and not arrived.is_set():
            arrived.set()
            assert hold.wait(30)
        return real_call(self, request, *args, **kwargs)

    monkeypatch.setattr(SideChannelClient, "call", call)
    pair = Pair()
    try:
        consumer = pair.D.worker.worker._consumer
        for _ in range(links_before - 1):  # links to the producer's first worker, each fenced (failed pushes)
            peer = pair.dial()
            assert peer.state.value == "ready", peer.error
            consumer.peers.failed(peer, "test: a failed push")
        armed[0] = True
        peer = pair.connect()
        assert arrived.wait(30), "no PUSH_HELLO"
        pair.P.sleep()  # the producer's engine sleeps and wakes while the hello is on its way
        pair.P.wake_up()
        hold.set()
        pair.handshaken(peer)
        assert peer.state.value == "failed" and "another life" in peer.error, peer.error
        assert not pair.writer()._decodes, "the new pusher recorded an introduction meant for the old worker"
        peer = pair.dial()
        assert peer.state.value == "ready", peer.error
    finally:
        pair.close()


def test_a_handshake_answered_across_a_sleep_and_wake_is_refused(monkeypatch):
    """The producer's side channel read its transport's metadata, then lost
    the CPU while the engine slept and woke: the reply named the old
    worker's metadata under the new life, so the decode's introduction
    check passed against the wrong worker (found by a review). The handler
    now reads the life first and refuses when it changed under the
    metadata; the next dial is answered by the new transport."""
    from rdma_kv.connector.rdma.consumer import peers as peers_module

    monkeypatch.setattr(peers_module, "PEER_RETRY_S", 0.0)
    pair = Pair()
    try:
        handler = pair.P.worker.worker.side_channel_handler
        real_md = handler._agent_metadata
        hold, arrived = threading.Event(), threading.Event()

        def slow_metadata():
            md = real_md()
            arrived.set()
            assert hold.wait(30)  # the side channel thread loses the CPU here
            return md

        handler._agent_metadata = slow_metadata
        peer = pair.connect()
        assert arrived.wait(30)
        pair.P.sleep()
        pair.P.wake_up()
        hold.set()
        pair.handshaken(peer)
        assert peer.state.value == "failed" and "registered again during this handshake" in peer.error, peer.error
        assert handler._agent_metadata is not slow_metadata  # (the wake gave the handler the new transport's)
        assert pair.dial().state.value == "ready"
    finally:
        pair.close()


def test_a_registration_sent_on_a_link_the_producer_no_longer_imports_writes_nothing(rng):
    """A PUSH_REG waits for its prefill; meanwhile the decode introduces
    itself on another link (it dialled the producer rank again), and the
    producer's import of it is now that link's. The registration names the
    link it was sent on, which the decode fences if it fails: the producer
    writes it over no other link (before, it wrote it over the new import,
    out of reach of that fence: found by a review). Nothing is written, the
    load fails and the request recomputes."""
    pair = Pair()
    try:
        p_rid, d_rid, tid, prompt = pair.decode_registered(rng)
        writer = pair.P.worker.worker.side_channel_handler.pusher
        (decode,) = writer._decodes.values()
        worker = pair.D.worker.worker
        local = worker._local
        reply = writer.hello(wire.PushHello(wire.PROTOCOL_VERSION, "decode-1", local.rank, worker._incarnation,
                                            decode.registration, local.transport.metadata(),
                                            wire.GeometryWire.from_geometry(local.geometry), "another-link",
                                            decode.ordinal + 1))
        assert reply.state is wire.PushState.DONE, reply
        writes = pair.fabric.writes
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode")
        r = pair.D.results[d_rid]
        assert r.load_failed and r.recomputed_from_block == 0 and r.bad_blocks == [], (r.error, r.bad_blocks)
        assert pair.fabric.writes == writes, "the registration was written over another link's import"
    finally:
        pair.close()


def test_a_new_link_the_transport_refuses_to_import_leaves_no_import_of_the_old_one(monkeypatch):
    """The decode introduces a new link (its old one is closed on its side)
    and the transport refuses the import (the endpoints missing are more
    than it makes up at once, UCX numbers no more, or a failed create left
    the count unknown): the answer says why, and the old link's import goes
    too, rather than stay in the transport with no decode record."""

    pair = Pair()
    try:
        writer, hello = pair.writer(), pair.hello_of("decode-x")
        assert writer.hello(hello("link-a", 1)).state is wire.PushState.DONE
        (decode,) = writer._decodes.values()
        assert decode.name in writer._transport.peers

        def refuse(*args, **kwargs):
            raise PeerError("70 more than this worker had made to it; 64 made up now, 6 left: introduce again")

        monkeypatch.setattr(writer._transport, "add_peer", refuse)
        reply = writer.hello(hello("link-b", 71))
        assert reply.state is wire.PushState.REFUSED and "introduce again" in reply.detail, reply
        assert not writer._decodes and decode.name not in writer._transport.peers
    finally:
        pair.close()


def test_an_introduction_older_than_the_imported_link_is_refused_and_replaces_nothing():
    """A PUSH_HELLO delayed past a newer one of the same decode (another
    connection) names a lower endpoint number: the producer refuses it and
    keeps the newer link, which its import pairs with."""
    pair = Pair()
    try:
        writer, hello = pair.writer(), pair.hello_of("decode-x")
        assert writer.hello(hello("link-b", 2)).state is wire.PushState.DONE
        reply = writer.hello(hello("link-a", 1))
        assert reply.state is wire.PushState.REFUSED and "out of date" in reply.detail, reply
        (decode,) = writer._decodes.values()
        assert decode.link == "link-b" and decode.ordinal == 2
    finally:
        pair.close()


def test_the_seal_of_layer_writes_is_not_flushed_over_a_link_imported_after_the_check(rng):
    """A registration's layer-wise writes went out over the import of link
    L1. ``_finish_layerwise`` checks the decode is still introduced on L1
    (under the writer's lock), releases the lock, then flushes *by name*.
    A PUSH_HELLO of a new link handled on the side channel thread in that
    window replaces the import under the same name: the flush and its
    notification go over the new link's endpoint, which never carried the
    writes, and the decode is told every byte landed. In UCX a flush of one
    endpoint says nothing of another's writes (and the old one was just
    force-closed by the replacement; over TCP its unflushed bytes may be
    dropped, and the decode has fenced L1 before it dialled L2). Found by a
    review; each import now has a name of its own, so the flush by the old
    name meets PeerError and the push fails (the decode recomputes)."""
    pair = Pair()
    try:
        p_rid, d_rid, tid, prompt = pair.decode_registered(rng)
        writer = pair.writer()
        (decode,) = writer._decodes.values()
        transport = writer._transport
        worker = pair.D.worker.worker
        local = worker._local
        seen = []
        real_flush = transport.flush

        def flush(name, **kwargs):
            if not seen:  # the side channel thread wins the race once, right after the check
                reply = writer.hello(wire.PushHello(
                    wire.PROTOCOL_VERSION, "decode-1", local.rank, worker._incarnation, decode.registration,
                    local.transport.metadata(), wire.GeometryWire.from_geometry(local.geometry),
                    "another-link", decode.ordinal + 1))
                assert reply.state is wire.PushState.DONE, reply
                seen.append((name, kwargs.get("notify") is not None))
            return real_flush(name, **kwargs)

        transport.flush = flush
        writes = pair.fabric.writes
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode")
        r = pair.D.results[d_rid]
        assert pair.fabric.writes > writes and seen, "no layer-wise write / no seal flush happened"
        name, notified = seen[0]
        assert name == decode.name and notified  # the seal, by the name of the import the writes went over
        (new,) = writer._decodes.values()
        assert new.name != decode.name and decode.name not in transport.peers
        assert r.load_failed, ("the decode took the push as complete: its seal was flushed and notified over "
                               "the new link's import, the writes went over the old one")
    finally:
        pair.close()


def test_a_new_link_whose_import_fails_in_ucx_leaves_no_import_of_the_old_one(monkeypatch):
    """As test_push_concurrent's ..._transport_refuses_to_import_leaves_no_import_of_the_old_one,
    but the import fails the way a failed ``ucp_ep_create`` fails it (the case
    ``lose_count`` is for): ``check_status`` raises UCXError, not PeerError.
    hello() deleted the old link's decode record before add_peer and caught
    only PeerError: the old link's import stayed in the transport with no
    record (no later hello removed it). Found by a review; the old import is
    now removed before the new one is made."""
    from rdma_kv.errors import UCXError

    pair = Pair()
    try:
        writer, hello = pair.writer(), pair.hello_of("decode-x")
        assert writer.hello(hello("link-a", 1)).state is wire.PushState.DONE
        (decode,) = writer._decodes.values()

        def fail(*args, **kwargs):
            raise UCXError("ucp_ep_create to 'decode-x' failed: UCS_ERR_NO_RESOURCE (UCS status -4)",
                           -4, "UCS_ERR_NO_RESOURCE")

        monkeypatch.setattr(writer._transport, "add_peer", fail)
        try:
            reply = writer.hello(hello("link-b", 2))
        except UCXError as exc:
            reply = exc
        assert not writer._decodes
        assert decode.name not in writer._transport.peers, (
            f"the old link's import stays with no decode record (hello answered {reply!r})")
    finally:
        pair.close()


def test_a_hello_the_transport_refuses_to_import_forgets_no_other_decode(monkeypatch):
    """``PushWriter.hello`` made room for a new decode (forgot the least
    recently used idle one, removing its import) before it knew whether the
    new decode's import would be made. A decode whose imports the transport
    refuses (its count of endpoints unknown after a failed ``ucp_ep_create``,
    past UCX's 65,535) dials again about every PEER_RETRY_S, and each dial
    evicted a healthy decode, whose next push was refused (a review, stop
    69). Room is now made once the import is made."""
    monkeypatch.setattr(pusher_module, "MAX_DECODES", 2)
    pair = Pair()
    try:
        writer = pair.writer()
        local = pair.D.worker.worker._local
        geometry = wire.GeometryWire.from_geometry(local.geometry)

        def hello(engine):
            other = pair.fabric.factory(engine)  # a decode worker of its own
            other.regions = list(local.transport.regions)
            return wire.PushHello(wire.PROTOCOL_VERSION, engine, wire.RankInfo(0, 1, 1), b"i" * 8, 1,
                                  other.metadata(), geometry, f"{engine}-link", 1, writer.life)

        for engine in ("healthy-a", "healthy-b"):
            assert writer.hello(hello(engine)).state is wire.PushState.DONE
        before = {key[0] for key in writer._decodes}
        real_add = writer._transport.add_peer

        def add_peer(blob, **kwargs):
            if "broken" in kwargs.get("name", ""):
                raise PeerError("peer 'broken': an endpoint to its worker failed to be made, and whether UCX "
                                "numbered it is not known ...; restart either side")
            return real_add(blob, **kwargs)

        monkeypatch.setattr(writer._transport, "add_peer", add_peer)
        for _ in range(2):  # the broken decode dials twice (a second apart, each load refused)
            reply = writer.hello(hello("broken"))
            assert reply.state is wire.PushState.REFUSED, reply
        after = {key[0] for key in writer._decodes}
        assert after == before, (f"the refused decode was never imported, yet {sorted(before - after)} were "
                                 f"forgotten for it ({writer.take_counters().decodes_forgotten} forgotten)")
    finally:
        pair.close()
