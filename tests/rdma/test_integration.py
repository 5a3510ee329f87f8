"""Prefill and decode engines in two processes, KV over UCX loopback, through
the harness: concurrency, prefix and full hits, aborts, lease expiry during
reads, a producer SIGKILLed mid-read, a refused handshake."""

from __future__ import annotations

import time

import pytest

from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(120)]

SHAPE = ModelShape(num_layers=4, num_kv_heads=4, head_size=32, block_size=16, num_blocks=4096)
# 48 prompts of up to 600 tokens are all held by the producer at once: room for all.
BS = SHAPE.block_size


def config(role, engine_id, policy="recompute", **extra):
    return {"kv_connector": "RdmaKVConnector", "kv_role": role, "engine_id": engine_id, "kv_port": 0,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"read_timeout_s": 2.0, "load_timeout_s": 4.0,
                                          "rpc_timeout_s": 1.0, "connect_timeout_s": 1.0, **extra}}


ROOMY = {"read_timeout_s": 30.0, "load_timeout_s": 60.0, "rpc_timeout_s": 5.0, "connect_timeout_s": 5.0}
"""Bounds for engines whose every load must succeed: a loaded CI host has
left engine processes without a CPU for seconds (docs/reliability.md), and
``config``'s short ones are for the tests that wait for a failure."""

PIN_S = 0.5
"""The producer's read_timeout_s, which is how long its read pins last."""


@pytest.fixture(scope="module")
def engines():
    with EngineProcess("prefill", config("kv_producer", "P", read_timeout_s=PIN_S), SHAPE) as p, \
            EngineProcess("decode", config("kv_consumer", "D", **ROOMY), SHAPE, faults={"gate_reads": True}) as d:
        yield p, d


def prefill(p, prompts):
    for rid, prompt in prompts.items():
        p.add(rid, prompt, {"do_remote_decode": True})
    results = p.wait_results(prompts, timeout_s=30)
    return {rid: results[rid]["kv_transfer_params"] for rid in prompts}


def assert_loaded_bit_exact(results):
    """Every load finished, from its producer, and every block matches the producer's."""
    for rid, r in results.items():
        assert r["status"] == "finished" and not r["load_failed"], (rid, r["error"])
        assert r["bad_blocks"] == [], f"{rid}: blocks {r['bad_blocks']} differ from its producer's"


def twin_waves(rng, prefills, decodes, waves=3):
    """Three waves of 4 prompts each for "a" and "b": prefilled on
    ``prefills[who]``, loaded by ``decodes[who]``, every block checked.
    Two engines given one engine id: each side must still be itself."""
    for wave in range(waves):
        prompts = {f"{who}{wave}-{i}": rng.integers(1, 999, int(rng.integers(40, 300))).tolist()
                   for who in "ab" for i in range(4)}
        params = {}
        for who in "ab":
            params.update(prefill(prefills[who], {k: v for k, v in prompts.items() if k[0] == who}))
        for rid, prompt in prompts.items():
            decodes[rid[0]].add(rid, prompt, params[rid])
        for d in {id(d): d for d in decodes.values()}.values():
            assert_loaded_bit_exact(d.wait_results([r for r in prompts if decodes[r[0]] is d], timeout_s=60))


def settle(p, d):
    p.wait_status(lambda s: s["held"] == 0 and s["leases"] == 0 and s["free_blocks"] == SHAPE.num_blocks,
                  timeout_s=15)
    d.wait_status(lambda s: s["held"] == 0 and s["inflight_loads"] == 0
                  and s["free_blocks"] == SHAPE.num_blocks, timeout_s=15)


def test_many_concurrent_requests_bit_exact(engines, rng):
    p, d = engines
    prompts = {"s0": list(range(1, 3 * BS + 5))}
    for i in range(47):
        roll = rng.random()
        earlier = list(prompts.values())
        if earlier and roll < 0.15:  # block-aligned repeat: a full hit on the decode side
            base = earlier[int(rng.integers(len(earlier)))]
            prompts[f"c{i}"] = base[: max(1, len(base) // BS) * BS] if len(base) >= BS else list(base)
        elif earlier and roll < 0.4:  # shared prefix: a partial hit
            base = earlier[int(rng.integers(len(earlier)))]
            prompts[f"c{i}"] = base[: len(base) // BS * BS] + rng.integers(1, 999, int(rng.integers(1, 40))).tolist()
        else:
            prompts[f"c{i}"] = rng.integers(1, 999, int(rng.integers(1, 600))).tolist()
    prompts["s1"] = prompts["s0"][: 3 * BS] + [9, 9]  # in the second wave: a certain prefix hit
    params = prefill(p, prompts)
    ids = list(prompts)
    for rid in ids[:24]:  # all of the first wave in flight at once
        d.add(rid, prompts[rid], params[rid])
    d.wait_results(ids[:24], timeout_s=60)
    for rid in ids[24:]:
        d.add(rid, prompts[rid], params[rid])
    results = d.wait_results(ids, timeout_s=60)
    assert_loaded_bit_exact(results)
    assert any(r["local_hit_tokens"] and r["external_tokens"] for r in results.values())
    stats = d.call("stats")
    assert stats["totals"]["ops_posted"] == stats["totals"]["block_runs"]
    print(f"{len(results)} requests, {stats['totals']['nbytes']} bytes, "
          f"{stats['totals']['num_descs']} descriptors -> {stats['totals']['ops_posted']} ops")
    settle(p, d)


def test_aborts_before_and_during_load(engines):
    p, d = engines
    prompts = {"ab0": list(range(1, 100)), "ab1": list(range(200, 333))}
    params = prefill(p, prompts)
    d.close_gate()
    try:
        d.add("ab0", prompts["ab0"], params["ab0"])
        d.abort("ab0")  # before the engine admitted it
        d.add("ab1", prompts["ab1"], params["ab1"])
        d.wait_status(lambda s: "ab1" in s["loading_ids"], timeout_s=10)
        steps = d.call("status")["steps"]
        d.abort("ab1")  # its reads are in flight (completions gated)
        # Three engine steps after the abort (not a guessed sleep): each had
        # its chance to free the blocks, and none may while reads can land.
        status = d.wait_status(lambda s: s["steps"] >= steps + 3, timeout_s=10)
        assert "ab1" in status["held_ids"], "an aborted request's blocks were freed while reads could land"
    finally:
        d.open_gate()
    assert d.wait_results(prompts, timeout_s=10)["ab1"]["status"] == "aborted"
    settle(p, d)


def test_lease_expiry_during_reads_is_a_load_error(engines):
    p, d = engines
    prompt = list(range(5, 300))
    params = prefill(p, {"lx": prompt})
    # The reads are held before they are posted (a read's completion already
    # includes its held words' read, chained behind the data in the shim):
    # the lease expires and its blocks are reused, then the reads go out and
    # read the reused blocks; their words name no lease, the consumer
    # CONFIRMs them and learns it (had a pin been posted, it would hold the
    # lease against expiry and expire_leases wait for it: the same end).
    d.close_gate(before_post=True)
    try:
        d.add("lx", prompt, params["lx"])
        d.wait_status(lambda s: "lx" in s["loading_ids"], timeout_s=10)
        p.wait_status(lambda s: s["leases"] == 1, timeout_s=10)  # the grant reached the worker
        assert p.call("expire_leases") == 1
        p.wait_status(lambda s: s["held"] == 0, timeout_s=10)  # the producer freed the blocks
        p.call("scribble_free")  # ... and reused them
    finally:
        d.open_gate()
    r = d.wait_results(["lx"], timeout_s=10)["lx"]
    assert r["load_failed"], "a read from blocks whose lease expired was accepted"
    assert r["status"] == "finished" and r["recomputed_from_block"] == 0
    settle(p, d)


def test_handshake_mismatch_is_refused(engines):
    p, _ = engines
    other = ModelShape(num_layers=4, num_kv_heads=4, head_size=32, block_size=32, num_blocks=512)
    prompt = list(range(1, 70))
    params = prefill(p, {"mm": prompt})
    with EngineProcess("decode-mismatch", config("kv_consumer", "D2", "fail"), other) as d2:
        d2.add("mm", prompt, params["mm"])
        r = d2.wait_results(["mm"], timeout_s=15)["mm"]
        assert r["status"] == "failed" and r["load_failed"]
        # Released, not stranded: the decode's RELEASE goes out on its RPC
        # thread after the load failed, so wait for it with the decode still
        # up (closing drops RPCs not started yet; the lease would then wait
        # out its TTL).
        p.wait_status(lambda s: s["leases"] == 0 and s["held"] == 0, timeout_s=10)


@pytest.mark.parametrize("read_pin", [True, False], ids=["pinned", "confirmed"])
def test_producer_killed_mid_read(rng, read_pin):
    """Reads whose completions are held while the producer is SIGKILLed.
    Without pins every load needs a CONFIRM, which a dead producer cannot
    give: all are load errors. With pins, a load whose pin was granted
    before the kill and whose reads completed read held blocks: it may
    finish, verified bit-exact; the others are load errors."""
    with EngineProcess("prefill-k", config("kv_producer", "PK"), SHAPE) as p, \
            EngineProcess("decode-k", config("kv_consumer", "DK", "fail", read_pin=read_pin), SHAPE,
                          faults={"gate_reads": True}) as d:
        prompts = {f"k{i}": rng.integers(1, 999, int(rng.integers(20, 400))).tolist() for i in range(12)}
        params = prefill(p, prompts)
        ids = list(prompts)
        d.close_gate()
        for rid in ids[:8]:
            d.add(rid, prompts[rid], params[rid])
        d.wait_status(lambda s: s["inflight_loads"] == 8, timeout_s=15)
        p.kill()
        t0 = time.monotonic()
        d.open_gate()
        first = d.wait_results(ids[:8], timeout_s=5.0)  # bounded: load errors within 5 s
        for rid in ids[8:]:  # the producer is gone: new loads fail too, still bounded
            d.add(rid, prompts[rid], params[rid])
        second = d.wait_results(ids[8:], timeout_s=5.0)
        elapsed = time.monotonic() - t0
        for rid, r in second.items():
            assert r["status"] == "failed" and r["load_failed"], (rid, r)
        verified = 0
        for rid, r in first.items():
            if read_pin and not r["load_failed"]:
                assert r["status"] == "finished" and r["bad_blocks"] == [], (rid, r)
                verified += 1
            else:
                assert r["status"] == "failed" and r["load_failed"], (rid, r)
        print(f"12 loads from a SIGKILLed producer: {verified} verified on their pins, {12 - verified} "
              f"reported as load errors, in {elapsed:.2f} s")
        d.wait_status(lambda s: s["inflight_loads"] == 0 and s["free_blocks"] == SHAPE.num_blocks,
                      timeout_s=10)


def test_producer_killed_with_reads_racing(rng):
    """No gate: the kill lands wherever the loads are (handshake, reads, confirm).
    Each request ends verified bit-exact or as a load error, within 5 s."""
    big = ModelShape(num_layers=8, num_kv_heads=8, head_size=64, block_size=16, num_blocks=1024)
    with EngineProcess("prefill-r", config("kv_producer", "PR"), big) as p, \
            EngineProcess("decode-r", config("kv_consumer", "DR", "fail"), big) as d:
        prompts = {f"x{i}": rng.integers(1, 999, int(rng.integers(200, 900))).tolist() for i in range(10)}
        params = prefill(p, prompts)
        for rid in prompts:
            d.add(rid, prompts[rid], params[rid])
        d.call("status")  # the decode engine took the requests (its pipe is in order); where its
        p.kill()          # loads are at the kill is up to the race, as the test intends
        results = d.wait_results(prompts, timeout_s=5.0)
        outcomes = {"verified": 0, "load_error": 0}
        for rid, r in results.items():
            if r["load_failed"]:
                assert r["status"] == "failed", (rid, r)
                outcomes["load_error"] += 1
            else:
                assert r["status"] == "finished" and r["bad_blocks"] == [], (rid, r)
                outcomes["verified"] += 1
        print(f"kill with reads racing: {outcomes}")


def test_two_lanes_split_reads_bit_exact(rng):
    """A decode engine with ``lanes: 2``: loads above 8 MiB are read by two
    workers at once, and every block still matches the producer's."""
    with EngineProcess("prefill-l", config("kv_producer", "PL"), SHAPE) as p, \
            EngineProcess("decode-l", config("kv_consumer", "DL", lanes=2, **ROOMY), SHAPE) as d:
        # A block is 4 layers x 8 KiB: 4,200+ tokens (263+ blocks) is over 8 MiB,
        # twice the default lane_min_bytes (4 MiB), so those loads are split.
        sizes = [int(rng.integers(4200, 4500)) for _ in range(4)] + [int(rng.integers(300, 900)) for _ in range(8)]
        prompts = {f"l{i}": rng.integers(1, 999, n).tolist() for i, n in enumerate(sizes)}
        params = prefill(p, prompts)
        for rid in prompts:
            d.add(rid, prompts[rid], params[rid])
        results = d.wait_results(list(prompts), timeout_s=60)
        assert_loaded_bit_exact(results)
        totals = d.call("stats")["totals"]
        # A run the cut falls into is posted once per part.
        assert totals["nbytes"] > 4 * (8 << 20)
        assert totals["block_runs"] <= totals["ops_posted"] <= totals["block_runs"] + len(prompts)
        settle(p, d)


def test_two_producers_that_claim_one_engine_id_are_each_read_as_themselves(rng):
    """An operator gave two prefill engines one ``engine_id``. Each answers
    its own handshake, and their agents' metadata name the same agent
    (``P2/tp0``): imported under that name, the second replaced the first
    in the decode's transport, whose later loads read the second's memory at
    the first's block ids (or failed). The decode names each producer by
    the side channel it dialled."""
    with EngineProcess("prefill-a", config("kv_producer", "P2"), SHAPE) as a, \
            EngineProcess("prefill-b", config("kv_producer", "P2"), SHAPE) as b, \
            EngineProcess("decode-2", config("kv_consumer", "D2", **ROOMY), SHAPE) as d:
        twin_waves(rng, {"a": a, "b": b}, {"a": d, "b": d})
