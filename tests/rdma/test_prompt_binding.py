"""The params bind the prompt whose KV they hand over (``remote_prompt_digest``).

A decode request carrying the valid params of another prompt of the same
length (a router mixing two requests' params up, a retry carrying stale
ones, a client replaying its params under another prompt) used to load that
other prompt's KV: the lease token covered the engine, TP size, token count
and block ids, not the prompt, so every check passed and the decode
generated from the wrong KV, silently. Harness engines over the fake
transport; the harness verifies every loaded block against the prompt."""

from __future__ import annotations

import logging

import pytest
from fakes import FakeFabric
import rdma_testutil

from rdma_kv.connector import KVTransferConfig
from rdma_kv.harness.engine import Engine, ModelShape

pytestmark = pytest.mark.timeout(120)

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64)


def engine(fabric, role, engine_id):
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=engine_id, kv_port=0,
                              kv_ip="127.0.0.1", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"rpc_timeout_s": 1.0, "load_timeout_s": 5.0})
    return Engine(config, SHAPE, connector_kwargs={"transport_factory": fabric.factory})


@pytest.fixture
def pair():
    fabric = FakeFabric()
    p, d = engine(fabric, "kv_producer", "P"), engine(fabric, "kv_consumer", "D")
    yield fabric, p, d
    p.shutdown()
    d.shutdown()


def pump_until(p, d, predicate, what):
    rdma_testutil.pump_until(p, d, predicate, what, timeout_s=30)


PROMPT_A = list(range(1, 20))
PROMPT_B = list(range(101, 120))  # same length, other tokens
PROMPT_C = list(range(201, 220))


def prefilled(p, d, prompts, extra_keys=()):
    for rid, prompt in prompts.items():
        p.add_request(rid, prompt, {"do_remote_decode": True}, extra_keys=extra_keys)
    pump_until(p, d, lambda: all(r in p.results and p.results[r].status.value == "finished" for r in prompts),
               "prefills")
    return {rid: dict(p.results[rid].kv_transfer_params) for rid in prompts}


def decoded(p, d, rid, prompt, params, extra_keys=()):
    d.add_request(rid, prompt, params, extra_keys=extra_keys)
    pump_until(p, d, lambda: rid in d.results and d.results[rid].status.value in ("finished", "failed"), "decode")
    return d.results[rid]


def test_the_params_carry_the_digest_of_the_prompt(pair):
    from rdma_kv.connector.rdma.params import prompt_digest

    fabric, p, d = pair
    params = prefilled(p, d, {"a": PROMPT_A})["a"]
    assert params["remote_prompt_digest"] == prompt_digest(PROMPT_A).hex()
    assert prompt_digest(PROMPT_A) != prompt_digest(PROMPT_B)
    assert prompt_digest(PROMPT_A) == prompt_digest(tuple(PROMPT_A))  # of the ids, not of their container
    assert prompt_digest([1, 2]) != prompt_digest([1, 2, 0])


def test_params_of_another_prompt_of_equal_length_are_refused(pair, caplog):
    """The decode of B given A's genuine params (a mix-up): nothing is read,
    the request is computed locally, the reason is logged and counted; B's
    own params still load."""
    fabric, p, d = pair
    params = prefilled(p, d, {"a": PROMPT_A, "b": PROMPT_B, "c": PROMPT_C})
    reads = fabric.reads
    with caplog.at_level(logging.WARNING):
        result = decoded(p, d, "b", PROMPT_B, params["a"])
    assert result.status.value == "finished"
    assert result.external_tokens == 0, "the decode loaded another prompt's KV"
    assert result.bad_blocks == []
    assert fabric.reads == reads, "a read was posted for another prompt's KV"
    assert d.scheduler.scheduler.refused_other_prompt == 1
    assert "remote_prompt_digest" in caplog.text and "another 19-token prompt" in caplog.text
    assert "computing locally" in caplog.text

    # The normal path (a prompt the decode holds no prefix of): its own params load.
    result = decoded(p, d, "c", PROMPT_C, params["c"])
    assert result.status.value == "finished" and not result.load_failed
    assert result.external_tokens == len(PROMPT_C) and result.bad_blocks == []
    assert fabric.reads > reads


def test_a_client_replaying_its_params_under_another_prompt_is_refused(pair):
    """One request id, one params set, the prompt changed (same length)."""
    fabric, p, d = pair
    params = prefilled(p, d, {"r": PROMPT_A})["r"]
    reads = fabric.reads
    result = decoded(p, d, "r", PROMPT_B, params)
    assert result.status.value == "finished" and result.external_tokens == 0 and result.bad_blocks == []
    assert fabric.reads == reads


def test_an_edited_digest_is_refused_by_the_lease_token(pair):
    """A's params with their digest edited to B's pass the decode's own
    comparison (the decode's prompt is B) but not the producer's token:
    every lease call answers FORGED, the load fails and B is recomputed;
    nothing read is used."""
    from rdma_kv.connector.rdma.params import prompt_digest

    fabric, p, d = pair
    params = prefilled(p, d, {"a": PROMPT_A})["a"]
    params["remote_prompt_digest"] = prompt_digest(PROMPT_B).hex()
    result = decoded(p, d, "a", PROMPT_B, params)
    assert result.status.value == "finished"
    assert result.load_failed and result.recomputed_from_block == 0
    assert result.bad_blocks == []
    pump_until(p, d, lambda: p.worker.worker.leases.stats.refused_forged >= 1, "a lease call refused FORGED")


def test_params_without_a_digest_are_refused_naming_the_field(pair, caplog):
    """A producer older than protocol 11 names no digest: refused at parse,
    computed locally, the message says what to do."""
    fabric, p, d = pair
    params = prefilled(p, d, {"a": PROMPT_A})["a"]
    del params["remote_prompt_digest"]
    reads = fabric.reads
    with caplog.at_level(logging.WARNING):
        result = decoded(p, d, "a", PROMPT_A, params)
    assert result.status.value == "finished" and result.external_tokens == 0
    assert fabric.reads == reads
    assert "remote_prompt_digest" in caplog.text and "protocol 11" in caplog.text


IMAGE_1 = (("mm", "img-1", 3),)
IMAGE_2 = (("mm", "img-2", 3),)


@pytest.mark.parametrize("prefill_keys, decode_keys", [
    (IMAGE_1, IMAGE_2),                                  # the same placeholder tokens, another image
    ((("lora", "sql"),), (("lora", "chat"),)),           # another adapter
    ((("cache_salt", "tenant-7"),), ()),                  # the salt dropped
    ((), (("lora", "sql"),)),                            # an adapter added
], ids=["image", "adapter", "salt-dropped", "adapter-added"])
def test_the_same_tokens_with_other_extra_keys_are_refused(pair, prefill_keys, decode_keys, caplog):
    """What besides the token ids decides the KV (``Request.extra_keys``:
    an image's identifier, the LoRA adapter, the cache salt) is bound too:
    the same token ids with another image or adapter hold other KV. Before,
    the digest covered the ids only and the decode loaded the prefill's KV
    silently (in a real engine, KV of another image)."""
    fabric, p, d = pair
    params = prefilled(p, d, {"a": PROMPT_A}, prefill_keys)["a"]
    reads = fabric.reads
    with caplog.at_level(logging.WARNING):
        result = decoded(p, d, "a", PROMPT_A, params, decode_keys)
    assert result.status.value == "finished"
    assert result.external_tokens == 0 and fabric.reads == reads, "loaded KV made with other extra keys"
    assert "another image, LoRA adapter or cache salt" in caplog.text

    # The same keys on both sides: loaded.
    params = prefilled(p, d, {"b": PROMPT_B}, prefill_keys)["b"]
    result = decoded(p, d, "b", PROMPT_B, params, prefill_keys)
    assert result.external_tokens == len(PROMPT_B) and not result.load_failed and result.bad_blocks == []
    assert fabric.reads > reads


def test_a_prompt_without_extra_keys_keeps_the_digest_of_protocol_11():
    """Requests without extra keys (plain text) digest as they did before
    the keys were bound, so producers and decodes on either side of that
    change still load each other's text prompts; with keys, they differ."""
    import hashlib
    import struct

    from rdma_kv.connector.rdma.params import prompt_digest

    ids = [7, 1 << 40, 3]
    before = hashlib.blake2b(struct.pack("<Q", 3), digest_size=16, person=b"rdma-kv prompt 1")
    before.update(struct.pack("<3q", *ids))
    assert prompt_digest(ids) == prompt_digest(ids, ()) == before.digest()
    assert prompt_digest(ids, IMAGE_1) not in (before.digest(), prompt_digest(ids, IMAGE_2))
    assert prompt_digest(ids, IMAGE_1) == prompt_digest(tuple(ids), [("mm", "img-1", 3)])  # by value
    assert prompt_digest(ids, (("mm", "img-1", None),)) != prompt_digest(ids, (("mm", "img-1", 0),))


def test_an_int_key_beyond_64_bits_is_bound_not_a_crash(pair):
    """``extra_keys`` may be any hashable values; an int MessagePack cannot
    hold (a SHA-256 of an adapter as an int) raised OverflowError out of the
    producer's request_finished (the engine's step) before."""
    fabric, p, d = pair
    big = int("f" * 64, 16)
    keys = (("adapter", big),)
    result = decoded(p, d, "a", PROMPT_A, prefilled(p, d, {"a": PROMPT_A}, keys)["a"], keys)
    assert result.external_tokens == len(PROMPT_A) and not result.load_failed and result.bad_blocks == []

    from rdma_kv.connector.rdma.params import prompt_digest

    digests = {prompt_digest(PROMPT_A, ((k,),)) for k in (big, big - 1, -big, 1 << 64, str(big), 5)}
    assert len(digests) == 6


def test_a_set_among_the_extra_keys_digests_alike_in_every_process():
    """A frozenset is hashable, so a valid key; MessagePack wrote its items
    in iteration order, which for strings follows the process's hash seed:
    two engines digested one request differently and refused its loads."""
    import os
    import subprocess
    import sys

    code = ("from rdma_kv.connector.rdma.params import prompt_digest; "
            "print(prompt_digest([1, 2], (('tags', frozenset({'a', 'b', 'c', 'd', 'e'})),)).hex())")
    seen = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        seen.add(out.stdout.strip())
    assert len(seen) == 1, seen

    from rdma_kv.connector.rdma.params import prompt_digest

    assert prompt_digest([1], (frozenset({"a"}),)) != prompt_digest([1], (frozenset({"b"}),))
    assert prompt_digest([1], (frozenset({"a"}),)) != prompt_digest([1], (("a",),))
