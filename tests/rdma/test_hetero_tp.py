"""Heterogeneous tensor parallel end to end: harness engines at different TP
sizes (one worker per rank, each holding its share of the KV heads), the
real side channel on 127.0.0.1, and the fake transport; every loaded block is
verified bit for bit on every consumer rank. One case runs over real UCX."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from rdma_testutil import wait_until
from fakes import FakeFabric
from netutil import free_base_port

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.geometry import derive_geometry
from rdma_kv.connector.rdma.slots import HeadSlice, SlotTable
from rdma_kv.connector.specs import FullAttentionSpec, KVCacheConfig
from rdma_kv.errors import DescriptorError
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(120)


def shape(heads: int) -> ModelShape:
    return ModelShape(num_layers=2, num_kv_heads=heads, head_size=8, block_size=4, num_blocks=128,
                      dtype="float32")


def config(role: str, engine_id: str, port: int, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id,
                            kv_port=port, kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"rpc_timeout_s": 1.0, "load_timeout_s": 5.0, **extra})


class Deployment:
    def __init__(self, p_tp: int, d_tp: int, heads: int, kwargs=None):
        kwargs = kwargs or {}
        self.P = Engine(config("kv_producer", "P", free_base_port(p_tp)), shape(heads), tp_size=p_tp,
                        connector_kwargs=kwargs)
        try:
            self.D = Engine(config("kv_consumer", "D", free_base_port(d_tp)), shape(heads), tp_size=d_tp,
                            connector_kwargs=kwargs)
        except BaseException:
            self.P.shutdown()
            raise

    def pump(self):
        self.P.step()
        self.D.step()

    def run(self, prompts):
        for rid, prompt in prompts.items():
            self.P.add_request(rid, prompt, {"do_remote_decode": True})
        wait_until(lambda: all(self.P.results.get(r) and self.P.results[r].status.value == "finished"
                               for r in prompts), step=self.pump, what="prefills")
        for rid, prompt in prompts.items():
            self.D.add_request(rid, prompt, self.P.results[rid].kv_transfer_params)
        wait_until(lambda: all(self.D.results.get(r) and self.D.results[r].status.value
                               in ("finished", "failed") for r in prompts), step=self.pump, what="decodes")
        return {rid: self.D.results[rid] for rid in prompts}

    def settle(self):
        """Every producer rank handed every block back; nothing in flight."""
        wait_until(lambda: not self.P.held and not self.D.requests
                   and all(len(r.worker.worker.leases) == 0 for r in self.P.ranks),
                   step=self.pump, what="producer blocks all handed back")
        assert self.P.num_free_blocks() == self.P.shape.num_blocks
        assert all(r.worker.worker.num_inflight() == 0 for r in self.D.ranks)

    def close(self):
        self.P.shutdown()
        self.D.shutdown()


def prompts(rng, n=6):
    return {f"r{i}": rng.integers(1, 999, int(rng.integers(5, 30))).tolist() for i in range(n)}


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [
    (2, 1, 4),  # one consumer rank reads two producer ranks
    (1, 2, 4),  # two consumer ranks read one producer rank
    (4, 2, 4),
    (2, 4, 4),
    (1, 2, 1),  # consumer replicas of one head
    (4, 1, 2),  # producer replicas: two ranks read, two only released
    (2, 2, 4),  # equal sizes: whole blocks, as before
])
def test_every_block_arrives_bit_exact(rng, p_tp, d_tp, heads):
    dep = Deployment(p_tp, d_tp, heads, {"transport_factory": FakeFabric().factory})
    try:
        results = dep.run(prompts(rng))
        for rid, r in results.items():
            assert r.status.value == "finished" and not r.load_failed, (rid, r.error)
            assert r.external_tokens and r.bad_blocks == [], rid
        dep.settle()
    finally:
        dep.close()


def test_a_dead_producer_rank_fails_the_load_and_the_request_recomputes(rng):
    fabric = FakeFabric()
    dep = Deployment(2, 1, 4, {"transport_factory": fabric.factory})
    try:
        ok = dep.run(prompts(rng, 2))
        assert all(not r.load_failed for r in ok.values())
        # The second producer rank dies: its reads fail, the first rank's succeed.
        fabric.kill(dep.P.ranks[1].worker.worker.agent_name)
        more = prompts(rng, 3)
        more = {f"k{rid}": p for rid, p in more.items()}
        results = dep.run(more)
        for rid, r in results.items():
            assert r.status.value == "finished" and r.load_failed, rid
            assert r.recomputed_from_block == 0 and r.bad_blocks == []
        for part in dep.D.ranks:
            wait_until(lambda: part.worker.worker.num_inflight() == 0, step=dep.pump, what="no load left")
    finally:
        dep.close()


def test_tables_are_prepared_without_the_consumers_lock(rng):
    """The transport runs due completion callbacks, which take the consumer's
    lock, while it holds its own lock, and preparing tables takes the
    transport's lock (transport/agent.py, lock order). So the consumer must
    never prepare tables while holding its own lock: with two sources
    (P2 -> D1) one source's reads completing while the other's tables were
    prepared deadlocked the engine. Every prep checks, from another thread,
    that the consumer's lock can be taken."""
    fabric = FakeFabric()
    dep = Deployment(2, 1, 4, {"transport_factory": fabric.factory})
    locks = [r.worker.worker._consumer._lock for r in dep.D.ranks]
    preps, held = [], []

    def check(agent: str) -> None:
        for lock in locks:
            taken: list[bool] = []

            def take(lock=lock, taken=taken) -> None:
                taken.append(lock.acquire(timeout=2.0))
                if taken[0]:
                    lock.release()

            thread = threading.Thread(target=take)
            thread.start()
            thread.join(5.0)
            preps.append(agent)
            if taken != [True]:
                held.append(agent)

    fabric.on_prep = check
    try:
        results = dep.run(prompts(rng, 3))
        assert all(r.status.value == "finished" and not r.load_failed for r in results.values())
        assert preps, "no table was prepared: the check did not run"
        assert not held, f"tables prepared under the consumer's lock (agents {sorted(set(held))})"
    finally:
        fabric.on_prep = None
        dep.close()


def test_over_ucx(rng):
    dep = Deployment(1, 2, 4)
    try:
        results = dep.run(prompts(rng, 4))
        assert all(r.status.value == "finished" and not r.load_failed and r.bad_blocks == []
                   for r in results.values())
        dep.settle()
    finally:
        dep.close()


# --- head-sliced slot tables -------------------------------------------------------------------


def _cache(layout: str, heads: int = 4, blocks: int = 6, bs: int = 4, hd: int = 8):
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hd, dtype="float32")
    cfg = KVCacheConfig.uniform(blocks, ["l0"], spec)
    if layout == "cpu":  # vLLM CPU: [blocks, heads, block_size, 2 * head]
        t = np.arange(blocks * heads * bs * 2 * hd, dtype=np.float32).reshape(blocks, heads, bs, 2 * hd)
        head_of = lambda b, h: t[b, h].ravel()  # noqa: E731
    elif layout == "hnd":  # [2, blocks, heads, block_size, head]
        t = np.arange(2 * blocks * heads * bs * hd, dtype=np.float32).reshape(2, blocks, heads, bs, hd)
        head_of = lambda b, h: np.concatenate([t[0, b, h].ravel(), t[1, b, h].ravel()])  # noqa: E731
    elif layout == "kv_inner":  # FlashInfer HND: [blocks, 2, heads, block_size, head]
        t = np.arange(blocks * 2 * heads * bs * hd, dtype=np.float32).reshape(blocks, 2, heads, bs, hd)
        head_of = lambda b, h: np.concatenate([t[b, 0, h].ravel(), t[b, 1, h].ravel()])  # noqa: E731
    else:  # NHD: [2, blocks, block_size, heads, head]
        t = np.arange(2 * blocks * bs * heads * hd, dtype=np.float32).reshape(2, blocks, bs, heads, hd)
        head_of = None
    return t, derive_geometry({"l0": t}, cfg), head_of


@pytest.mark.parametrize("layout", ["cpu", "hnd", "kv_inner"])
def test_a_head_slice_table_covers_exactly_those_heads(layout):
    t, geometry, head_of = _cache(layout)
    base = t.__array_interface__["data"][0]
    table = SlotTable(geometry, HeadSlice(1, 2, 4))
    whole = SlotTable(geometry)
    assert table.bytes_per_block * 2 == whole.bytes_per_block
    flat = t.reshape(-1).view(np.uint8)
    for block in (0, 5):
        got = b"".join(flat[int(a) - base:int(a) - base + int(n)].tobytes()
                       for a, n in zip(table.descs.addrs[table.indices(np.array([block]), "x")],
                                       table.descs.lengths[table.indices(np.array([block]), "x")]))
        want = b"".join(head_of(block, h).tobytes() for h in (1, 2)) if layout == "cpu" else None
        if want is None:  # K parts of both heads, then V parts
            parts = [np.split(head_of(block, h), 2) for h in (1, 2)]
            want = b"".join(p[0].tobytes() for p in parts) + b"".join(p[1].tobytes() for p in parts)
        assert got == want


def test_nhd_cannot_be_sliced_and_says_what_to_do():
    _, geometry, _ = _cache("nhd", bs=8)
    assert geometry.layers[0].head_nbytes == 0
    SlotTable(geometry)  # whole blocks are fine
    with pytest.raises(DescriptorError, match="HND"):
        SlotTable(geometry, HeadSlice(0, 2, 4))


def test_a_producer_rank_read_by_two_decode_ranks_keeps_its_blocks_until_both_confirmed(rng):
    """P1 -> D2: both decode ranks read the one producer rank under one
    lease. The first rank's CONFIRM (which releases its share) must not hand
    the blocks back while the second rank's reads are still on the wire."""
    fabric = FakeFabric()
    dep = Deployment(1, 2, 4, {"transport_factory": fabric.factory})
    try:
        prompt = {"r0": rng.integers(1, 999, 20).tolist()}
        dep.P.add_request("r0", prompt["r0"], {"do_remote_decode": True})
        wait_until(lambda: dep.P.results.get("r0") and dep.P.results["r0"].status.value == "finished",
                   step=dep.pump, what="prefill")
        fabric.hold = True
        dep.D.add_request("r0", prompt["r0"], dep.P.results["r0"].kv_transfer_params)
        wait_until(lambda: len(fabric.pending) == 2, step=dep.pump, what="both ranks' reads posted")
        first, second = (r.worker.worker for r in dep.D.ranks)
        # Rank 0's reads land, then its held words' read (posted after them): released as they come.
        wait_until(lambda: (fabric.release_all(reader=first.agent_name), first.num_inflight() == 0)[1],
                   step=dep.pump, what="rank 0 confirmed its share")
        for _ in range(20):
            dep.pump()
        assert "r0" in dep.P.held, "the producer handed back blocks a decode rank is still reading"
        assert len(dep.P.ranks[0].worker.worker.leases) == 1 and second.num_inflight() == 1
        fabric.hold = False
        fabric.release_all()
        wait_until(lambda: dep.D.results.get("r0") and dep.D.results["r0"].status.value == "finished",
                   step=dep.pump, what="decode")
        r = dep.D.results["r0"]
        assert r.status.value == "finished" and not r.load_failed and r.bad_blocks == []
        dep.settle()
    finally:
        dep.close()


def test_tp_sizes_that_cannot_share_the_heads_recompute_and_release_every_producer_rank(rng):
    """A producer at TP=3 of a 4-head model (which no engine would run) and a
    decode at TP=2: no plan exists, every load fails clearly, and every
    producer rank is released at once (not after the lease TTL)."""
    dep = Deployment(3, 2, 4, {"transport_factory": FakeFabric().factory})
    try:
        results = dep.run(prompts(rng, 3))
        assert all(r.status.value == "finished" and r.load_failed for r in results.values())
        dep.settle()
    finally:
        dep.close()


def test_an_abort_between_two_decode_ranks_reports_frees_the_blocks_once_both_are_done(rng):
    """D2: rank 0's load is done and reported in done_recving; the request
    is aborted while rank 1 still reads. Each rank reports the load in
    done_recving exactly once (rank 1 once its reads resolved); the engine
    counts both before it frees (as vLLM's aggregator does). Before, an
    aborted load went to done_sending, rank 0 (already reported) never sent
    it there, and vLLM's adapter dropped it: neither count completed and the
    blocks leaked (found by an adversarial review against vLLM's aggregator)."""
    fabric = FakeFabric()
    dep = Deployment(1, 2, 4, {"transport_factory": fabric.factory})
    try:
        prompt = rng.integers(1, 999, 20).tolist()
        dep.P.add_request("r0", prompt, {"do_remote_decode": True})
        wait_until(lambda: dep.P.results.get("r0") and dep.P.results["r0"].status.value == "finished",
                   step=dep.pump, what="prefill")
        fabric.hold = True
        dep.D.add_request("r0", prompt, dep.P.results["r0"].kv_transfer_params)
        wait_until(lambda: len(fabric.pending) == 2, step=dep.pump, what="both ranks' reads posted")
        first, second = (r.worker.worker for r in dep.D.ranks)
        fabric.release_all(reader=first.agent_name)  # rank 0's reads land; their held words' read goes out
        wait_until(lambda: len(fabric.pending) == 2, step=dep.pump, what="rank 0's held words' read posted")
        fabric.release_all(reader=first.agent_name)
        wait_until(lambda: dep.D._reported["recving"].get("r0") == 1, step=dep.pump,
                   what="one rank reported its load")
        dep.D.abort_request("r0")
        for _ in range(10):
            dep.pump()
        assert "r0" in dep.D.held and second.num_inflight() == 1  # rank 1 may still write into them
        fabric.hold = False
        fabric.release_all()
        wait_until(lambda: "r0" not in dep.D.held, step=dep.pump, what="the aborted request's blocks freed")
        assert dep.D.results["r0"].status.value == "aborted"
        dep.settle()
    finally:
        dep.close()
