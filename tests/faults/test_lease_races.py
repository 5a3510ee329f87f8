"""Lease races end to end, through harness engines over UCX loopback: the
same kv_transfer_params loaded twice (a router retry on another engine, or
a second request on the same engine), before and after the first load
released them and the producer reused the blocks; a peer that releases a
lease it was never handed (the next generation, guessed) or a lease
another consumer claimed; a lease forced to expire mid-read; a client that
edits its own genuine params to name another request's blocks, while that
request's lease is live and after its blocks were released and reused.

Every load ends verified bit-exact or as a load error (recomputed), never
as data read from reused blocks and accepted. The default run does a cut of
each scenario and a short random campaign; ``-m slow`` runs 1,000 random
interleavings (``RDMA_KV_LEASE_TRIALS`` sets how many).
"""

from __future__ import annotations

import os
import secrets
import time

import pytest
from faults_util import BS, SHAPE, check_loaded, config, prefill

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.params import LeaseRef, parse_kv_transfer_params
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

HELD, CLAIMED, UNKNOWN = wire.LeaseStatus.HELD, wire.LeaseStatus.CLAIMED, wire.LeaseStatus.UNKNOWN


GATED = {"load_timeout_s": 15.0, "read_timeout_s": 15.0}
"""The decodes' bounds: a scenario holds a load's reads (the gate) while it
waits for the claim and makes its own calls, which on a loaded host can
take more than the 4 s default of these tests; every outcome here comes
from the producer's answers, none from a timeout."""


@pytest.fixture(scope="module")
def engines():
    with EngineProcess("prefill-lr", config("kv_producer", "PLR"), SHAPE) as p, \
            EngineProcess("decode-lr1", config("kv_consumer", "DLR1", **GATED), SHAPE,
                          faults={"gate_reads": True}) as d1, \
            EngineProcess("decode-lr2", config("kv_consumer", "DLR2", **GATED), SHAPE,
                          faults={"gate_reads": True}) as d2:
        peer = SideChannelClient("127.0.0.1", p.info["port"], rpc_timeout_s=5.0)
        try:
            yield Race(p, d1, d2, peer)
        finally:
            peer.close()


class Race:
    """The engines, a side-channel peer playing a third party, and helpers."""

    def __init__(self, p, d1, d2, peer):
        self.p, self.d1, self.d2, self.peer = p, d1, d2, peer
        self.n = 0

    def prompts(self, rng, k=1):
        out = {}
        for _ in range(k):
            self.n += 1
            out[f"q{self.n}"] = rng.integers(1, 999, int(rng.integers(20, 300))).tolist()
        return out

    def load(self, d, rid, prompt, params):
        d.add(rid, prompt, params)
        return check_loaded(rid, d.wait_results([rid], timeout_s=30)[rid])

    def reuse(self):
        """The producer hands the released blocks to other prompts: here, by
        overwriting every free block."""
        self.p.wait_status(lambda s: s["leases"] == 0 and s["held"] == 0, timeout_s=15)
        self.p.call("scribble_free")

    def settle(self):
        self.p.wait_status(lambda s: s["leases"] == 0 and s["held"] == 0, timeout_s=15)
        for d in (self.d1, self.d2):
            d.wait_status(lambda s: s["inflight_loads"] == 0 and s["held"] == 0, timeout_s=15)

    def third_party(self, kind, ref):
        """A lease call from a peer that is not the lease's consumer."""
        calls = [wire.LeaseWire.of(ref, secrets.token_bytes(wire.CLAIM_BYTES))]
        message = (wire.Confirm(wire.PROTOCOL_VERSION, calls, release=True) if kind is wire.Confirm
                   else kind(wire.PROTOCOL_VERSION, calls))
        return self.peer.lease_call(message).statuses[0]

    def wait_claimed(self, rid):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(x["request_id"] == rid and x["claimed"] for x in self.p.call("leases")):
                return
            time.sleep(0.01)
        raise AssertionError(f"the lease of {rid} was never claimed")


# --- the scenarios (each returns the outcome of every load it made) ------------------------------


def dup_after_release(race, rng, same_engine):
    """Loaded, confirmed, released; the blocks reused; the params loaded again.
    On the same engine the prompt's full blocks are a local prefix hit, so the
    prompt ends in a partial block: that one is read again."""
    (rid, prompt), = race.prompts(rng).items()
    if same_engine and len(prompt) % BS == 0:
        prompt = prompt + [7]
    params = prefill(race.p, {rid: prompt})[rid]
    first = race.load(race.d1, rid, prompt, params)
    race.reuse()
    again = race.d1 if same_engine else race.d2
    again.add(f"{rid}-again", prompt, params)
    result = again.wait_results([f"{rid}-again"], timeout_s=30)[f"{rid}-again"]
    second = check_loaded(f"{rid}-again", result)
    assert first == "verified"
    assert result["external_tokens"] > 0, "the duplicate did not read: the scenario tests nothing"
    assert second == "load_error", "the same params loaded after release and reuse were accepted"
    return [first, second]


def dup_concurrent(race, rng):
    """A router retry while the first load is in flight: one load at least
    is verified, none accepts other bytes. The first claim owns the lease
    (renewals, releases); the other engine's load is verified too when its
    held words, read after its data, still named the lease (it read the
    same KV while the lease held it), else it is a load error."""
    (rid, prompt), = race.prompts(rng).items()
    params = prefill(race.p, {rid: prompt})[rid]
    first, second = (race.d1, race.d2) if rng.random() < 0.5 else (race.d2, race.d1)
    first.add(rid, prompt, params)
    if rng.random() < 0.5:
        time.sleep(float(rng.random()) * 0.05)
    second.add(rid, prompt, params)
    outcomes = [check_loaded(rid, d.wait_results([rid], timeout_s=30)[rid]) for d in (first, second)]
    assert "verified" in outcomes, outcomes  # (check_loaded: a verified load's bytes are the producer's)
    return outcomes


def advance_release(race, rng):
    """A peer guesses the next lease (epoch, generation, request id) and
    confirms-and-releases it before it is granted: refused, nothing recorded."""
    (warm, warm_prompt), = race.prompts(rng).items()
    warm_params = prefill(race.p, {warm: warm_prompt})[warm]
    outcomes = [race.load(race.d1, warm, warm_prompt, warm_params)]
    seen = parse_kv_transfer_params(warm_params).lease
    (rid, prompt), = race.prompts(rng).items()
    guess = LeaseRef(seen.epoch, seen.generation + 1, rid, secrets.token_bytes(16), seen.binding)
    assert race.third_party(wire.Confirm, guess) is UNKNOWN
    assert race.third_party(wire.Release, guess) is UNKNOWN
    params = prefill(race.p, {rid: prompt})[rid]
    assert parse_kv_transfer_params(params).lease.generation == guess.generation
    outcome = race.load(race.d2, rid, prompt, params)
    assert outcome == "verified", "a guessed lease call freed the victim's blocks"
    return outcomes + [outcome]


def third_party_release(race, rng):
    """A peer holding the params (but not the consumer's claim) releases a
    lease the consumer claimed and is reading: refused; the read is verified."""
    (rid, prompt), = race.prompts(rng).items()
    params = prefill(race.p, {rid: prompt})[rid]
    ref = parse_kv_transfer_params(params).lease
    race.d1.close_gate()
    try:
        race.d1.add(rid, prompt, params)
        race.wait_claimed(rid)
        assert race.third_party(wire.Release, ref) is CLAIMED
        assert race.third_party(wire.Confirm, ref) is CLAIMED
        assert race.third_party(wire.Renew, ref) is CLAIMED
    finally:
        race.d1.open_gate()
    outcome = check_loaded(rid, race.d1.wait_results([rid], timeout_s=30)[rid])
    assert outcome == "verified"
    return [outcome]


def _pointed_at(own, victim):
    """``own`` params (genuine: a client's own prefill) edited to name the
    blocks of ``victim``: what a client of the decode server can send, since
    vLLM's OpenAI server accepts kv_transfer_params in the request body."""
    return {**own, "remote_block_ids": victim["remote_block_ids"]}


def _two_prompts_of_one_length(race, rng):
    (victim, victim_prompt), (attacker, attacker_prompt) = race.prompts(rng, 2).items()
    attacker_prompt = (attacker_prompt + victim_prompt)[:len(victim_prompt)]
    attacker_prompt[-1] = victim_prompt[-1] % 998 + 1  # differs in the last block at least
    return victim, victim_prompt, attacker, attacker_prompt


def forged_ids_live(race, rng):
    """The victim's lease is live (prefilled, not yet loaded): a client loads
    its own params pointed at the victim's blocks. A load error; the
    victim's load that follows is verified."""
    victim, victim_prompt, attacker, attacker_prompt = _two_prompts_of_one_length(race, rng)
    params = prefill(race.p, {victim: victim_prompt, attacker: attacker_prompt})
    assert params[victim]["remote_block_ids"] != params[attacker]["remote_block_ids"]
    d, other = (race.d1, race.d2) if rng.random() < 0.5 else (race.d2, race.d1)
    forged = race.load(d, attacker, attacker_prompt, _pointed_at(params[attacker], params[victim]))
    assert forged == "load_error", "params pointed at another request's blocks were accepted"
    honest = race.load(other, victim, victim_prompt, params[victim])
    assert honest == "verified", "the victim's own load suffered from the forgery"
    # The attacker's own lease was never claimed by the forgery: it expires or is released.
    race.p.call("expire_leases")
    return [forged, honest]


def forged_ids_after_reuse(race, rng):
    """The victim loaded, released; its blocks reused. A client's own params,
    pointed at those blocks: a load error."""
    victim, victim_prompt, attacker, attacker_prompt = _two_prompts_of_one_length(race, rng)
    params = prefill(race.p, {victim: victim_prompt})
    honest = race.load(race.d1, victim, victim_prompt, params[victim])
    race.reuse()
    params.update(prefill(race.p, {attacker: attacker_prompt}))
    forged = race.load(race.d2, attacker, attacker_prompt, _pointed_at(params[attacker], params[victim]))
    assert honest == "verified"
    assert forged == "load_error", "params pointed at released, reused blocks were accepted"
    race.p.call("expire_leases")
    return [honest, forged]


def expiry_mid_read(race, rng):
    """The lease expires while the reads are in flight and the blocks are
    reused: a load error."""
    (rid, prompt), = race.prompts(rng).items()
    params = prefill(race.p, {rid: prompt})[rid]
    d = race.d1 if rng.random() < 0.5 else race.d2
    d.close_gate(before_post=True)  # the reads themselves held: a completion already includes their held words' read
    try:
        d.add(rid, prompt, params)
        d.wait_status(lambda s: rid in s["loading_ids"], timeout_s=10)
        race.wait_claimed(rid)
        assert race.p.call("expire_leases") == 1
        race.p.wait_status(lambda s: s["held"] == 0, timeout_s=10)
        race.p.call("scribble_free")
    finally:
        d.open_gate()
    outcome = check_loaded(rid, d.wait_results([rid], timeout_s=30)[rid])
    assert outcome == "load_error", "a read from an expired, reused lease was accepted"
    return [outcome]


SCENARIOS = {
    "dup_other_engine_after_release": lambda race, rng: dup_after_release(race, rng, same_engine=False),
    "dup_same_engine_after_release": lambda race, rng: dup_after_release(race, rng, same_engine=True),
    "dup_concurrent": dup_concurrent,
    "advance_release": advance_release,
    "third_party_release": third_party_release,
    "expiry_mid_read": expiry_mid_read,
    "forged_ids_live": forged_ids_live,
    "forged_ids_after_reuse": forged_ids_after_reuse,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_lease_race(engines, rng, name):
    SCENARIOS[name](engines, rng)
    engines.settle()


def campaign(race, rng, trials):
    names = list(SCENARIOS)
    counts = {"verified": 0, "load_error": 0}
    for _ in range(trials):
        for outcome in SCENARIOS[names[int(rng.integers(len(names)))]](race, rng):
            counts[outcome] += 1
        race.settle()
    print(f"lease races: {trials} random interleavings, {counts}, 0 silent corruptions")
    return counts


@pytest.mark.timeout(300)
def test_lease_races_random_cut(engines, rng):
    campaign(engines, rng, 12)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_lease_races_campaign(engines, rng):
    campaign(engines, rng, int(os.environ.get("RDMA_KV_LEASE_TRIALS", "1000")))
