"""Push mode: the producer writes a decode's registration only the KV of its
prompt (PUSH_REG's ``prompt_digest`` against the prefill's).

Under protocol 10 nothing but the transfer id's secrecy bound the two legs
of a concurrent dispatch: a client of the prefill server that knew (or
reused) a decode's transfer id and sent a prompt of the same length under
it had its KV written into that decode's blocks, which answered DONE, and
the decode generated from another prompt's KV. Harness engines in this
process over the fake transport; every block verified."""

from __future__ import annotations

import logging

import pytest
from rdma_testutil import wait_until
from test_push_concurrent import Pair  # harness engines in push mode over the fake transport

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(1, 20))  # four whole blocks and a partial one
OTHER = list(range(501, 520))  # the same length, other tokens


@pytest.mark.parametrize("order", ["decode_first", "prefill_first"])
@pytest.mark.parametrize("prefill_prompt", ["other", "same"], ids=["other_prompt", "same_prompt"])
def test_a_prefill_of_another_prompt_under_the_decodes_transfer_id_is_not_written(order, prefill_prompt, caplog):
    """decode_first: the decode registered before the prefill ran (its
    layers would go out during the forward pass); prefill_first: the prefill
    was granted before the registration came. Another prompt of the same
    length: REFUSED with the reason, nothing written, the decode recomputes
    and its KV is its own; the prefill's lease is released. The same prompt
    (control): written, loaded."""
    pair = Pair()
    try:
        p_rid, d_rid, tid = pair.ids()
        other = prefill_prompt == "other"
        if order == "decode_first":
            pair.decode(d_rid, PROMPT, tid)
            wait_until(lambda: pair.registered() == 1, step=pair.pump, what="the decode's registration")
            pair.prefill(p_rid, OTHER if other else PROMPT, tid)
        else:
            pair.prefill(p_rid, OTHER if other else PROMPT, tid)
            wait_until(lambda: p_rid in pair.P.results and pair.P.results[p_rid].status.value == "finished",
                       step=pair.pump, what="the prefill")
            pair.decode(d_rid, PROMPT, tid)
        with caplog.at_level(logging.WARNING):
            wait_until(lambda: pair.finished(d_rid), step=pair.pump, what="the decode", timeout_s=30)
        r = pair.D.results[d_rid]
        assert r.status.value == "finished" and r.bad_blocks == [], (r.error, r.bad_blocks)
        if other:
            assert r.load_failed and r.recomputed_from_block == 0, r
            assert pair.fabric.writes == 0, "another prompt's KV was written into the decode"
            assert "computed another prompt than the decode's" in caplog.text
            totals = pair.P.worker.get_kv_connector_stats()["totals"]
            assert totals.get("push_refused") == 1 and "push_done" not in totals, totals
        else:
            assert not r.load_failed and r.external_tokens, r
            assert pair.fabric.writes > 0
        wait_until(lambda: not pair.P.held and len(pair.P.worker.worker.leases) == 0, step=pair.pump,
                   what="the producer releasing the prefill's lease")
    finally:
        pair.close()


def test_sequential_push_params_of_another_prompt_are_refused_at_admission():
    """Push mode dispatched sequentially (the params go to the decode): the
    decode compares the digest as in pull mode; no PUSH is sent."""
    pair = Pair()
    try:
        for rid, prompt in (("a", PROMPT), ("b", OTHER)):
            pair.P.add_request(rid, prompt, {"do_remote_decode": True})
        wait_until(lambda: all(r in pair.P.results and pair.P.results[r].status.value == "finished"
                               for r in ("a", "b")), step=pair.pump, what="the prefills")
        params = pair.P.results["a"].kv_transfer_params
        assert params and params["remote_request_id"] == "a"
        pair.D.add_request("b", OTHER, params)
        wait_until(lambda: pair.finished("b"), step=pair.pump, what="the decode")
        r = pair.D.results["b"]
        assert r.status.value == "finished" and r.external_tokens == 0 and r.bad_blocks == [], r
        assert pair.fabric.writes == 0
    finally:
        pair.close()
