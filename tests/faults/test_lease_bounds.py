"""A lease lives a bounded time, and leases cannot starve new prefills:
end to end through harness engines over UCX loopback.

- A decode whose reads are held (so it keeps renewing) cannot keep the
  producer's blocks past ``lease_max_s``: the lease ends (LIFETIME), the
  blocks go back, and the load ends as a load error, recomputed.
- Decodes holding most of a small producer's KV cache (reads held, leases
  renewed) cannot make a new prefill wait: under that pressure the oldest
  leases beyond ``lease_max_share`` end, the new prefill runs, and the
  reclaimed loads end as load errors; the others are verified.

No assertion on time: each outcome is awaited with a bound, and the bound
is far below what the behaviour without the fix would take.
"""

from __future__ import annotations

import dataclasses

import pytest
from faults_util import BS, SHAPE, check_loaded, config, idle, prefill

from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_a_lease_renewed_past_its_lifetime_ends_and_the_load_recomputes(rng):
    # TTL 6 s, renewed every third of it while the reads are held: without
    # the bound the lease lives as long as the gate stays closed. (A TTL of
    # 1 s ended the lease as expired, not at its lifetime, whenever a loaded
    # host delayed one renewal by 0.7 s; 4 s left 2.7 s.)
    p_cfg = config("kv_producer", "PLB", lease_ttl_s=6.0, lease_max_s=15.0)
    d_cfg = config("kv_consumer", "DLB", load_timeout_s=120.0, read_timeout_s=120.0)
    with EngineProcess("prefill-lb", p_cfg, SHAPE) as p, \
            EngineProcess("decode-lb", d_cfg, SHAPE, faults={"gate_reads": True}) as d:
        prompt = rng.integers(1, 999, 10 * BS).tolist()
        params = prefill(p, {"long": prompt})
        d.close_gate(before_post=True)  # the reads themselves held: a completion already includes their held words' read
        try:
            d.add("long", prompt, params["long"])
            d.wait_status(lambda s: "long" in s["loading_ids"], timeout_s=20)
            # The producer hands the blocks back on its own, while the decode still renews.
            p.wait_status(lambda s: s["held"] == 0 and s["leases"] == 0, timeout_s=60)
            events = p.call("lease_events")
            assert events.get("lifetime") == 1 and events.get("renewed", 0) >= 2, events
        finally:
            d.open_gate()
        assert check_loaded("long", d.wait_results(["long"], timeout_s=30)["long"]) == "load_error"
        p.wait_status(idle(), timeout_s=15)
        d.wait_status(idle(), timeout_s=15)


SMALL = dataclasses.replace(SHAPE, num_blocks=64)  # the same model, a small cache


def test_leases_holding_the_cache_are_reclaimed_for_a_waiting_prefill(rng):
    # Six 10-block prompts fill 60 of the producer's 64 blocks under leases
    # whose reads are held; a new 20-block prefill needs 20.
    # TTL 10 s: every lease must live, renewed, until the pressure reclaims it.
    p_cfg = config("kv_producer", "PMP", lease_ttl_s=10.0)
    d_cfg = config("kv_consumer", "DMP", load_timeout_s=120.0, read_timeout_s=120.0)
    with EngineProcess("prefill-mp", p_cfg, SMALL) as p, \
            EngineProcess("decode-mp", d_cfg, SHAPE, faults={"gate_reads": True}) as d:
        held = {f"h{i}": rng.integers(1, 999, 10 * BS).tolist() for i in range(6)}
        params = {}
        for rid, prompt in held.items():  # one at a time: each prefill needs its blocks
            params.update(prefill(p, {rid: prompt}))
        d.close_gate()
        try:
            for rid, prompt in held.items():
                d.add(rid, prompt, params[rid])
            d.wait_status(lambda s: set(s["loading_ids"]) == set(held), timeout_s=30)
            assert p.call("status")["free_blocks"] == SMALL.num_blocks - 60
            # The new prefill: with 4 blocks free it waits, which is the pressure.
            new = rng.integers(1, 999, 20 * BS).tolist()
            p.add("new", new, {"do_remote_decode": True})
            p.wait_results(["new"], timeout_s=60)  # without reclaims: until the leases' 300 s bound
            events = p.call("lease_events")
            # The oldest leases ended until at most half the cache (32 blocks) was held.
            assert events.get("reclaimed") == 3, events
        finally:
            d.open_gate()
        outcomes = {rid: check_loaded(rid, r) for rid, r in d.wait_results(list(held), timeout_s=60).items()}
        assert outcomes == {**{f"h{i}": "load_error" for i in range(3)},
                            **{f"h{i}": "verified" for i in range(3, 6)}}, outcomes
        p.call("expire_leases")  # the new prefill's own lease: nobody reads it
        p.wait_status(idle(SMALL), timeout_s=15)
        d.wait_status(idle(), timeout_s=15)
