"""Faults between engine processes over UCX loopback, repeated: a producer
SIGKILLed mid-read, a consumer killed while holding leases, leases forced to
expire while reads are in flight. The default run does a cut of each
(``-m "not slow"``); ``-m slow`` runs the full trial counts."""

from __future__ import annotations

import time

import pytest
from faults_util import SHAPE, check_loaded, config, idle, prefill

from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

LOAD_ERROR_BOUND_S = 5.0
"""The issue's bound: a request whose producer died is a load error within
this many seconds of the kill (generous next to read_timeout_s=2)."""
LEASE_TTL_S = 4.0
"""Long enough that a lease granted at a prefill outlives its claim by a
decode on a loaded host (2 s could lapse before a slow decode claimed it)."""


def random_prompts(rng, prefix, n, lo=20, hi=400):
    return {f"{prefix}{i}": rng.integers(1, 999, int(rng.integers(lo, hi))).tolist() for i in range(n)}


def kill_producer_trials(rng, trials):
    outcomes = {"trials": 0, "verified": 0, "load_error": 0, "max_detect_s": 0.0}
    with EngineProcess("decode-f", config("kv_consumer", "DF"), SHAPE, faults={"gate_reads": True}) as d, \
            EngineProcess("prefill-healthy", config("kv_producer", "PH"), SHAPE) as healthy:
        for trial in range(trials):
            # gated: every load's completion is held at the kill; else racing.
            gated = trial % 2 == 0
            with EngineProcess(f"prefill-k{trial}", config("kv_producer", f"PK{trial}"), SHAPE) as p:
                prompts = random_prompts(rng, f"t{trial}-", 7, 40, 900)
                params = prefill(p, prompts)
                # The last is loaded after the kill: a load error, and the contact that tells
                # the decode its producer is gone (loads that all finished before the kill,
                # trusted on their read pins, leave nothing to learn it from).
                late = prompts.pop(f"t{trial}-6")
                if gated:
                    d.close_gate()
                for rid, prompt in prompts.items():
                    d.add(rid, prompt, params[rid])
                if gated:
                    d.wait_status(lambda s: s["inflight_loads"] == 6, timeout_s=15)
                else:  # racing: kill as soon as the decode engine took the requests
                    d.call("status")
                p.kill()
                t0 = time.monotonic()
                if gated:
                    d.open_gate()
                results = d.wait_results(prompts, timeout_s=LOAD_ERROR_BOUND_S)
                outcomes["max_detect_s"] = max(outcomes["max_detect_s"], time.monotonic() - t0)
                d.add(f"t{trial}-6", late, params[f"t{trial}-6"])
                after = d.wait_results([f"t{trial}-6"], timeout_s=LOAD_ERROR_BOUND_S)[f"t{trial}-6"]
                assert check_loaded(f"t{trial}-6", after) == "load_error", "a load from a dead producer"
            for rid, r in results.items():
                # Verified bit-exact or a load error, never accepted with wrong blocks. A gated
                # load is verified only on its read pin (granted before the kill, reads complete
                # before it, completions held since); without pins every gated load is a load
                # error, as tests/rdma/test_integration.py checks with read_pin off.
                outcomes[check_loaded(rid, r)] += 1
            # The decode engine keeps serving: a healthy producer's KV loads bit-exact.
            fresh = random_prompts(rng, f"h{trial}-", 2)
            fresh_params = prefill(healthy, fresh)
            for rid, prompt in fresh.items():
                d.add(rid, prompt, fresh_params[rid])
            for rid, r in d.wait_results(fresh, timeout_s=15).items():
                assert check_loaded(rid, r) == "verified"
            d.wait_status(idle(), timeout_s=15)
            outcomes["trials"] += 1
        healthy.wait_status(idle(), timeout_s=15)
        left = (d.call("stats") or {}).get("resources", {})
    print(f"producer SIGKILLed mid-read: {outcomes}; decode side afterwards: {left}")
    # Dead producers' endpoints are gone; only the healthy producer's remains.
    assert left.get("transport_peers", 0) <= 1 and left.get("transfers_inflight", 0) == 0, left
    return outcomes


@pytest.mark.timeout(300)
def test_producer_killed_mid_read(rng):
    kill_producer_trials(rng, 5)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_producer_killed_mid_read_slow(rng):
    kill_producer_trials(rng, 50)


def consumer_killed_trials(rng, trials):
    freed = 0
    with EngineProcess("prefill-c", config("kv_producer", "PC", lease_ttl_s=LEASE_TTL_S), SHAPE) as p:
        for trial in range(trials):
            # The decode engine starts first: an engine's start can take longer
            # than the TTL, and the leases must be alive when it claims them.
            with EngineProcess(f"decode-c{trial}", config("kv_consumer", f"DC{trial}"), SHAPE,
                               faults={"gate_reads": True}) as d:
                prompts = random_prompts(rng, f"c{trial}-", 8)
                params = prefill(p, prompts)
                held = p.call("status")["held"]
                assert held == len(prompts)
                d.close_gate()
                ids = list(prompts)
                for rid in ids[:6]:  # six loading (renewing their leases), two never sent
                    d.add(rid, prompts[rid], params[rid])
                d.wait_status(lambda s: s["inflight_loads"] == 6, timeout_s=15)
                # The consumer was alive and renewing: each of its leases was
                # claimed and renewed by it before the kill, the others never.
                leases = wait_leases(p, lambda ls: sum(x["renewals"] > 0 for x in ls) == 6, timeout_s=10)
                renewed = {x["request_id"] for x in leases if x["renewals"] > 0 and x["claimed"]}
                assert renewed == set(ids[:6]), leases
                d.kill()
            # No consumer renews now: every lease expires, every block frees.
            p.wait_status(idle(), timeout_s=LEASE_TTL_S * 3 + 10)
            freed += held
    print(f"consumer killed holding leases: {trials} trials, {freed} held requests all freed on expiry")


def wait_leases(p, predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while True:
        leases = p.call("leases")
        if predicate(leases) or time.monotonic() > deadline:
            return leases
        time.sleep(0.02)


@pytest.mark.timeout(300)
def test_consumer_killed_holding_leases(rng):
    consumer_killed_trials(rng, 3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_consumer_killed_holding_leases_slow(rng):
    consumer_killed_trials(rng, 20)


def forced_expiry_trials(rng, trials):
    detected = 0
    with EngineProcess("prefill-x", config("kv_producer", "PX"), SHAPE) as p, \
            EngineProcess("decode-x", config("kv_consumer", "DX"), SHAPE, faults={"gate_reads": True}) as d:
        for trial in range(trials):
            prompts = random_prompts(rng, f"x{trial}-", int(rng.integers(1, 4)))
            params = prefill(p, prompts)
            d.close_gate(before_post=True)  # the reads themselves held: a completion already includes their held words' read
            try:
                for rid, prompt in prompts.items():
                    d.add(rid, prompt, params[rid])
                d.wait_status(lambda s: s["inflight_loads"] == len(prompts), timeout_s=10)
                p.wait_status(lambda s: s["leases"] == len(prompts), timeout_s=10)
                assert p.call("expire_leases") == len(prompts)
                p.wait_status(lambda s: s["held"] == 0, timeout_s=10)  # blocks handed back ...
                p.call("scribble_free")  # ... and reused
            finally:
                d.open_gate()
            for rid, r in d.wait_results(prompts, timeout_s=10).items():
                assert check_loaded(rid, r) == "load_error", f"{rid}: read from an expired lease accepted"
                detected += 1
            d.wait_status(idle(), timeout_s=10)
    print(f"forced lease expiry during reads: {trials} trials, {detected}/{detected} loads detected")


@pytest.mark.timeout(300)
def test_forced_lease_expiry_during_reads(rng):
    forced_expiry_trials(rng, 10)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_forced_lease_expiry_during_reads_slow(rng):
    forced_expiry_trials(rng, 100)
