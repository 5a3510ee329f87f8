"""A request id reused while the aborted load under it may still land is
computed locally, not lost.

The scheduler forgot an aborted load's request at once, so the same id
added again (an engine that reuses ids: the harness, or vLLM with
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``) shipped a second load. The
worker still held the first (its reads on the wire) and dropped the second
with a warning: never reported, its lease neither renewed nor released,
and the request waited for ever. Found by an adversarial review."""

from __future__ import annotations

import logging

import pytest

from rdma_testutil import wait_until
from test_connector_fake import Pair

pytestmark = pytest.mark.timeout(60)


def test_a_request_id_reused_while_its_aborted_load_lands_is_computed_locally(fabric, caplog):
    pair = Pair(fabric, d_extra={"load_timeout_s": 5.0})
    try:
        prompts = {"p1": list(range(1, 30)), "p2": list(range(100, 130))}
        params = pair.prefill(prompts)
        fabric.hold = True
        pair.D.add_request("x", prompts["p1"], params["p1"])
        wait_until(lambda: fabric.pending, step=pair.pump, what="reads in flight")
        pair.D.abort_request("x")  # its reads are on the wire: the load stays with the worker
        with caplog.at_level(logging.WARNING):
            pair.D.add_request("x", prompts["p2"], params["p2"])  # the client retries under the same id
            for _ in range(3):
                pair.pump()
        assert any("computing this one locally" in r.getMessage() for r in caplog.records)
        fabric.hold = False
        fabric.release_all()
        wait_until(lambda: pair.D.results["x"].status.value == "finished", step=pair.pump,
                   what="the second 'x' to finish", timeout_s=20)
        result = pair.D.results["x"]
        assert result.bad_blocks == [] and result.external_tokens == 0  # computed here, nothing read
        pair.settle()  # both leases released on the producer, nothing held on either side
    finally:
        pair.close()
