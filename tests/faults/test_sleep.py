"""Sleep mode (vLLM >= 0.33: ``unregister_kv_caches`` before the KV memory
is unmapped, ``restore_kv_caches`` after it is mapped again), end to end
through harness engines over UCX loopback. The harness's sleep overwrites
the KV memory after the unregister, as a remapped allocation would read.

- A producer sleeps while a consumer's reads of its blocks are in flight:
  every such load ends as a load error (its leases ended: GONE), none is
  accepted. After the wake, params issued before the sleep are a load error
  (their lease epoch ended with the sleep: GONE; a consumer that still holds
  a peer of the old registration reads through a dead endpoint, one that
  handshakes anew is refused before reading); new params are read and
  verified, through a peer handshaken again (the consumer's cached one was
  of the old registration).
- A consumer sleeps with loads in flight: they fail once no read can land;
  after its wake it reads and verifies again.
"""

from __future__ import annotations

import pytest
from faults_util import BS, SHAPE, check_loaded, config, idle, prefill

from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(180)]


def prompts(rng, prefix, n):
    return {f"{prefix}{i}": rng.integers(1, 999, int(rng.integers(2, 12)) * BS + 3).tolist() for i in range(n)}


def test_a_producer_sleeping_under_reads_fails_them_and_serves_its_new_registration_after_wake(rng):
    with EngineProcess("prefill-sl", config("kv_producer", "PSL"), SHAPE) as p, \
            EngineProcess("decode-sl", config("kv_consumer", "DSL", read_timeout_s=30.0, load_timeout_s=60.0),
                          SHAPE, faults={"gate_reads": True}) as d:
        warm = prompts(rng, "w", 1)
        warm_params = prefill(p, warm)
        assert {check_loaded(r, x) for r, x in d_load(d, warm, warm_params).items()} == {"verified"}
        racing = prompts(rng, "r", 3)
        racing_params = prefill(p, racing)
        kept = prompts(rng, "k", 1)  # prefilled before the sleep, loaded after the wake
        kept_params = prefill(p, kept)
        d.close_gate(before_post=True)  # the reads themselves held: a completion already includes their held words' read
        try:
            for rid, prompt in racing.items():
                d.add(rid, prompt, racing_params[rid])
            d.wait_status(lambda s: set(racing) <= set(s["loading_ids"]), timeout_s=30)
            p.call("sleep")
            p.wait_status(lambda s: s["leases"] == 0 and s["held"] == 0, timeout_s=15)
        finally:
            d.open_gate()
        outcomes = {rid: check_loaded(rid, r) for rid, r in d.wait_results(list(racing), timeout_s=60).items()}
        assert set(outcomes.values()) == {"load_error"}, outcomes
        p.call("wake_up")
        stale = d_load(d, {f"{rid}-after": kept[rid] for rid in kept},
                       {f"{rid}-after": kept_params[rid] for rid in kept})
        for rid, r in stale.items():
            assert check_loaded(rid, r) == "load_error", "params of the old registration were accepted"
        fresh = prompts(rng, "f", 3)
        results = d_load(d, fresh, prefill(p, fresh))
        assert {check_loaded(r, x) for r, x in results.items()} == {"verified"}, results
        p.wait_status(idle(), timeout_s=15)
        d.wait_status(idle(), timeout_s=15)


def test_a_consumer_sleeping_with_loads_in_flight_fails_them_and_reads_again_after_wake(rng):
    with EngineProcess("prefill-cs", config("kv_producer", "PCS"), SHAPE) as p, \
            EngineProcess("decode-cs", config("kv_consumer", "DCS", read_timeout_s=2.0, load_timeout_s=60.0),
                          SHAPE, faults={"gate_reads": True}) as d:
        racing = prompts(rng, "r", 3)
        params = prefill(p, racing)
        d.close_gate()
        try:
            for rid, prompt in racing.items():
                d.add(rid, prompt, params[rid])
            d.wait_status(lambda s: set(racing) <= set(s["loading_ids"]), timeout_s=30)
            d.call("sleep")  # reads held past read_timeout_s: the closing transport fails them
        finally:
            d.open_gate()
        outcomes = {rid: check_loaded(rid, r) for rid, r in d.wait_results(list(racing), timeout_s=60).items()}
        assert set(outcomes.values()) == {"load_error"}, outcomes
        d.call("wake_up")
        fresh = prompts(rng, "f", 3)
        results = d_load(d, fresh, prefill(p, fresh))
        assert {check_loaded(r, x) for r, x in results.items()} == {"verified"}, results
        p.call("expire_leases")  # the failed loads released theirs; nothing else is held
        p.wait_status(idle(), timeout_s=15)
        d.wait_status(idle(), timeout_s=15)


def d_load(d, prompts_, params):
    for rid, prompt in prompts_.items():
        d.add(rid, prompt, params[rid])
    return d.wait_results(list(prompts_), timeout_s=60)
