"""Push mode between a prefill and a decode engine in two processes, KV over
UCX loopback, through the harness: the producer writes the decode's blocks
(one-sided PUT), the decode's load finishes on the producer's notification."""

from __future__ import annotations

import contextlib
import time

import pytest

from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(180)]

from test_integration import ROOMY, SHAPE, assert_loaded_bit_exact, prefill, settle, twin_waves  # noqa: E402  (tests/rdma: the pull tests' engines)
from test_integration import config as pull_config  # noqa: E402
from rdma_testutil import wait_until  # noqa: E402

BS = SHAPE.block_size


def config(role, engine_id, mode="push", **extra):
    return pull_config(role, engine_id, mode=mode, **extra)


def test_push_many_requests_bit_exact(rng):
    with EngineProcess("prefill", config("kv_producer", "P", **ROOMY), SHAPE) as p, \
            EngineProcess("decode", config("kv_consumer", "D", **ROOMY), SHAPE) as d:
        prompts = {f"q{i}": rng.integers(1, 999, int(rng.integers(1, 600))).tolist() for i in range(24)}
        params = prefill(p, prompts)
        for rid, prompt in prompts.items():
            d.add(rid, prompt, params[rid])
        assert_loaded_bit_exact(d.wait_results(prompts, timeout_s=60))
        settle(p, d)


def test_two_decodes_given_one_engine_id_each_load_their_own_blocks(rng):
    """An operator gave two decode engines one ``engine_id``. Each
    introduces its KV cache to the producer under that id and rank 0; before
    the incarnation, the second's PUSH_HELLO was answered 'known' and its
    pushes wrote into the first decode's blocks (which the first's own
    requests held), while its own loads waited for notifications that went
    to the first. Now the producer knows each decode by its incarnation."""
    with EngineProcess("prefill", config("kv_producer", "P", **ROOMY), SHAPE) as p, \
            EngineProcess("decode-a", config("kv_consumer", "D", **ROOMY), SHAPE) as a, \
            EngineProcess("decode-b", config("kv_consumer", "D", **ROOMY), SHAPE) as b:
        twin_waves(rng, {"a": p, "b": p}, {"a": a, "b": b})
        settle(p, a)
        settle(p, b)


def test_a_mode_mismatch_is_refused_naming_both_modes_and_the_request_recomputes(capfd):
    with EngineProcess("prefill", config("kv_producer", "P", mode="pull"), SHAPE) as p, \
            EngineProcess("decode", config("kv_consumer", "D", mode="push"), SHAPE) as d:
        prompt = list(range(1, 200))
        params = prefill(p, {"m": prompt})
        d.add("m", prompt, params["m"])
        r = d.wait_results(["m"], timeout_s=30)["m"]
        assert r["status"] == "finished" and r["load_failed"] and r["recomputed_from_block"] == 0
        settle(p, d)
    err = capfd.readouterr().err
    assert "refused the handshake: incompatible KV caches (transfer_mode: producer 'pull' vs consumer 'push'); " \
           "both engines must run the same transfer mode" in err, err


@contextlib.contextmanager
def gated_engines():
    """A producer whose pushes are held before their writes are posted."""
    with EngineProcess("prefill", config("kv_producer", "P"), SHAPE, faults={"gate_writes": True}) as p, \
            EngineProcess("decode", config("kv_consumer", "D"), SHAPE) as d:
        yield p, d


def start_held_push(p, d, rid, prompt):
    params = prefill(p, {rid: prompt})
    p.close_gate()
    d.add(rid, prompt, params[rid])
    p.wait_status(lambda s: s["resources"].get("pushes_running") == 1, timeout_s=60)
    d.wait_status(lambda s: rid in s["reading_ids"], timeout_s=60)


def test_a_decode_abort_mid_push_keeps_its_blocks_until_no_write_can_land():
    with gated_engines() as (p, d):
        prompt = list(range(3, 400))
        start_held_push(p, d, "ab", prompt)
        steps = d.call("status")["steps"]
        d.abort("ab")
        # The producer took the decode's abort (the writes are still to be
        # posted), and the decode stepped since: its blocks stay held.
        asked = 0

        def abort_taken():
            nonlocal asked  # stats are counted since the last call
            asked += ((p.call("stats") or {}).get("totals") or {}).get("push_abort_asked", 0)
            return asked >= 1

        wait_until(abort_taken, timeout_s=30, what="the producer to take the decode's abort")
        status = d.wait_status(lambda s: s["steps"] >= steps + 3, timeout_s=10)
        assert "ab" in status["held_ids"], "an aborted request's blocks were handed back while a push could land"
        assert p.call("status")["resources"]["pushes_running"] == 1
        p.open_gate()  # the writes go out and resolve: the producer answers ABORTED
        assert d.wait_results(["ab"], timeout_s=60)["ab"]["status"] == "aborted"
        settle(p, d)


def test_a_producer_killed_mid_push_is_a_load_error_at_once_and_the_decode_recomputes(capfd):
    with gated_engines() as (p, d):
        prompt = list(range(7, 500))
        start_held_push(p, d, "k", prompt)
        t0 = time.monotonic()
        p.kill()
        r = d.wait_results(["k"], timeout_s=20)["k"]
        waited = time.monotonic() - t0
        assert r["status"] == "finished" and r["load_failed"] and r["recomputed_from_block"] == 0, r
        # At once: far inside lease_max_s (300 s), the bound for a producer that is unreachable but maybe alive.
        assert waited < 60, f"the load error took {waited:.1f} s"
        err = capfd.readouterr().err
        assert "KV load failed: push from 'P' rank 0: producer rank 0 is gone" in err, err
        d.wait_status(lambda s: s["held"] == 0 and s["inflight_loads"] == 0
                      and s["free_blocks"] == SHAPE.num_blocks, timeout_s=60)


def test_forged_block_ids_write_nothing_and_the_victims_load_is_exact(capfd):
    """An attacker's params edited to name the victim's blocks: the push is
    refused (FORGED), nothing is written, and the victim loads its own KV."""
    with EngineProcess("prefill", config("kv_producer", "P"), SHAPE) as p, \
            EngineProcess("decode", config("kv_consumer", "D"), SHAPE) as d:
        prompts = {"victim": list(range(11, 11 + 12 * BS)), "attacker": list(range(900, 900 + 12 * BS))}
        params = prefill(p, prompts)
        forged = dict(params["attacker"], remote_block_ids=params["victim"]["remote_block_ids"])
        d.add("attacker", prompts["attacker"], forged)
        r = d.wait_results(["attacker"], timeout_s=30)["attacker"]
        assert r["load_failed"], r
        d.add("victim", prompts["victim"], params["victim"])
        v = d.wait_results(["victim"], timeout_s=30)["victim"]
        assert not v["load_failed"] and v["bad_blocks"] == [], v
        # (The attacker's own lease is held until its TTL, as in pull: docs/security.md.)
        d.wait_status(lambda s: s["held"] == 0 and s["inflight_loads"] == 0
                      and s["free_blocks"] == SHAPE.num_blocks, timeout_s=60)
    err = capfd.readouterr().err
    # Refused by whichever lease call came first: the renewal at load start, or the PUSH itself; FORGED
    # once the producer's worker holds the lease, and before its grant reached the worker (the grant
    # ships with the producer's next step: vLLM's order, start_load_kv after the forward pass) UNKNOWN:
    # a token that does not verify is never taken for a grant still on its way.
    assert ("request 'attacker': KV load failed: push from 'P' rank 0: push refused: lease FORGED" in err
            or "request 'attacker': KV load failed: producer 'P' refused lease" in err and "altered" in err
            or "request 'attacker': KV load failed: producer 'P' never granted lease" in err
            and "its token does not verify" in err and "altered" in err), err
    assert "request 'victim': KV load failed" not in err, err
