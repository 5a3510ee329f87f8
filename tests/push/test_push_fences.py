"""Layer-wise push writes on a CUDA KV cache wait for the layer's fence
(``rdma_kv.connector.rdma.fences``): vLLM hands a layer to
``save_kv_layer`` when its forward was *enqueued*, and a write posted
before the GPU stored the layer would send the blocks' old contents, with
no error anywhere.

Harness engines over the fake transport, with a fake stream: when the
producer hands a layer over, its KV is replaced by a canary (the GPU has
not run the kernel yet) and comes back when the fake GPU gets there; the
fence factory the producer uses records points on that stream. Every
decode block is verified, so a write posted early shows as bad blocks
(the control without fences does)."""

from __future__ import annotations

import pytest
import torch
from rdma_testutil import wait_until
from test_push_concurrent import BLOCK_NBYTES, SHAPE, Pair

from rdma_kv.connector.geometry import KVCacheGeometry, Region
from rdma_kv.connector.rdma import RdmaConnector, fences

pytestmark = pytest.mark.timeout(120)

CANARY = -7.0


class FakeStream:
    """The producer's GPU: the blocks a step's forward wrote hold a canary
    from the moment the layer is handed over until the GPU gets there."""

    def __init__(self, keeps_up: bool):
        self.keeps_up = keeps_up  # the GPU has stored each layer by the time the next is handed over
        self.before: dict[str, torch.Tensor] = {}  # the KV as of the last step's end
        self.enqueued: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (KV, blocks, what they get)
        self.done = 0
        self.synchronized = 0

    def enqueue(self, name: str, kv: torch.Tensor) -> None:
        if self.keeps_up:
            self.run(len(self.enqueued))
        before = self.before.setdefault(name, torch.zeros_like(kv))  # (the engine's KV starts zeroed)
        written = (kv != before).flatten(1).any(1)  # the blocks this step's forward wrote
        self.enqueued.append((kv, written, kv[written].clone()))
        kv[written] = CANARY

    def run(self, upto: int) -> None:
        for kv, written, stored in self.enqueued[self.done:upto]:
            kv[written] = stored
        self.done = max(self.done, upto)

    def step_ended(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.run(len(self.enqueued))  # the step's output synchronises the stream
        self.enqueued, self.done = [], 0
        self.before = {name: kv.clone() for name, kv in kv_caches.items()}

    def factory(self):
        stream = self

        class Fence:
            def __init__(self):
                self.upto = len(stream.enqueued)

            def query(self):
                return stream.done >= self.upto

            def synchronize(self):
                stream.synchronized += 1
                stream.run(self.upto)

        return Fence


def on_fake_gpu(monkeypatch, stream: FakeStream, with_fences: bool = True) -> Pair:
    """A producer and a decode whose producer stores its layers on
    ``stream`` (its pusher's fences are the stream's, or none: the control)."""
    monkeypatch.setattr(fences, "stream_fences", lambda geometry: stream.factory() if with_fences else None)
    pair = Pair()
    original_save, original_wait = RdmaConnector.save_kv_layer, RdmaConnector.wait_for_save

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs):
        if self is pair.P.worker:
            stream.enqueue(layer_name, kv_layer)
        original_save(self, layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        original_wait(self)
        if self is pair.P.worker:
            stream.step_ended(pair.P.kv_caches)

    monkeypatch.setattr(RdmaConnector, "save_kv_layer", save_kv_layer)
    monkeypatch.setattr(RdmaConnector, "wait_for_save", wait_for_save)
    return pair


def push_one(pair: Pair, rng):
    p_rid, d_rid, tid, prompt = pair.decode_registered(rng)  # registered first: its layers go out layer-wise
    pair.prefill(p_rid, prompt, tid)
    wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode")
    stats = pair.P.worker.get_kv_connector_stats()
    return pair.D.results[d_rid], stats["totals"], stats["pushes"]


@pytest.mark.parametrize("keeps_up", [False, True], ids=["gpu_behind", "gpu_keeps_up"])
def test_a_layer_is_written_only_once_its_fence_passed(rng, monkeypatch, keeps_up):
    """GPU behind: no fence passes during the pass, every layer is written
    at ``wait_for_save`` after one wait for the stream (nothing overlapped).
    GPU keeping up: each layer goes out at the next one's ``save_kv_layer``
    (overlapped), the last after the wait. Either way every block is right."""
    stream = FakeStream(keeps_up)
    pair = on_fake_gpu(monkeypatch, stream)
    try:
        r, totals, pushes = push_one(pair, rng)
        assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)
        (record,) = pushes
        assert record["outcome"] == "done" and record["nbytes"] == 5 * BLOCK_NBYTES, record
        # One batch per layer for the four whole blocks, one for the partial block at the seal.
        assert totals["push_layer_writes"] == SHAPE.num_layers + 1 and totals["push_layer_steps"] == 1, totals
        assert stream.synchronized >= 1, "wait_for_save never waited for the stream"
        layer_nbytes = 4 * BLOCK_NBYTES // SHAPE.num_layers
        expected = (SHAPE.num_layers - 1) * layer_nbytes if keeps_up else 0
        assert record["overlapped_nbytes"] == expected, record
    finally:
        pair.close()


def test_a_prefill_no_decode_has_registered_for_waits_for_no_stream(rng, monkeypatch):
    """A prefill under a transfer id with no decode registered yet (the
    decode leg comes later): its step has no layer-wise writes, so
    ``wait_for_save`` does not wait for the stream (the engine keeps its
    CPU/GPU overlap); the decode that registers afterwards is written at
    the seal, every block right."""
    stream = FakeStream(keeps_up=False)
    pair = on_fake_gpu(monkeypatch, stream)
    try:
        p_rid, d_rid, tid = pair.ids()
        prompt = rng.integers(1, 999, 4 * SHAPE.block_size + 3).tolist()
        pair.prefill(p_rid, prompt, tid)
        wait_until(lambda: p_rid in pair.P.results, step=pair.pump, what="the prefill")
        assert stream.synchronized == 0
        pair.decode(d_rid, prompt, tid)
        wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode")
        r = pair.D.results[d_rid]
        assert not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)
        assert stream.synchronized == 0
    finally:
        pair.close()


def test_without_fences_the_same_pass_sends_blocks_the_gpu_has_not_stored(rng, monkeypatch):
    """The control: the same fake GPU with the writes not fenced (a host
    KV cache's rule applied to a CUDA one) sends the canary, and nothing
    errs. This is what the fences prevent, and what the test above would
    see if they did not hold."""
    pair = on_fake_gpu(monkeypatch, FakeStream(keeps_up=False), with_fences=False)
    try:
        r, totals, pushes = push_one(pair, rng)
        assert not r.load_failed and pushes[0]["outcome"] == "done", (r.error, pushes)
        assert len(r.bad_blocks) == 4, r.bad_blocks  # the four whole blocks went out layer-wise, early
    finally:
        pair.close()


def test_a_stream_that_cannot_be_waited_for_fails_the_push_and_the_decode_recomputes(rng, monkeypatch, caplog):
    """``synchronize`` raising (a CUDA error) at ``wait_for_save``: the
    step's pushes fail, nothing more of them is posted, the decode's load
    fails and it recomputes; the producer's next push is unaffected."""
    from rdma_kv.connector.rdma.consumer import peers

    monkeypatch.setattr(peers, "PEER_RETRY_S", 0.0)  # the decode retries the producer at once
    stream = FakeStream(keeps_up=False)
    fence_cls = stream.factory()
    broken = {"on": True}

    class BrokenFence(fence_cls):
        def synchronize(self):
            if broken["on"]:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super().synchronize()

    stream.factory = lambda: BrokenFence
    pair = on_fake_gpu(monkeypatch, stream)
    try:
        r, totals, pushes = push_one(pair, rng)
        assert r.load_failed and r.recomputed_from_block == 0 and r.bad_blocks == [], r
        assert pushes[0]["outcome"] != "done", pushes
        assert "waiting for the forward pass's stream failed: CUDA error" in caplog.text  # the decode says why
        assert totals.get("push_layer_writes", 0) == 0, totals  # nothing of it was posted
        broken["on"] = False
        r, totals, pushes = push_one(pair, rng)
        assert not r.load_failed and r.bad_blocks == [], (r.error, r.bad_blocks)
    finally:
        pair.close()


def geometry_on(*devices: str) -> KVCacheGeometry:
    """Regions on ``devices`` (which is all ``stream_fences`` looks at)."""
    regions = tuple(Region(0x1000 * (i + 1), 0x1000, device, (f"l{i}",)) for i, device in enumerate(devices))
    return KVCacheGeometry(regions, ())


def test_which_kv_caches_need_fences():
    assert fences.stream_fences(geometry_on("cpu", "cpu")) is None  # the forward stored it already
    with pytest.raises(ValueError, match="spans devices"):
        fences.stream_fences(geometry_on("cuda:0", "cuda:1"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_fence_passes_after_the_work_recorded_before_it():
    kv = torch.zeros(1 << 20, device="cuda")
    record = fences.stream_fences(geometry_on("cuda:0"))
    assert record is not None
    kv.add_(1.0)
    fence = record()
    fence.synchronize()
    assert fence.query() and float(kv[-1]) == 1.0
