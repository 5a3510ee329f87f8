"""A load whose reads were posted always resolves, whatever happens in the
consumer between the post and its completion callback.

``RdmaConsumer._post`` recorded the post's figures before it attached the
callback that resolves the source: an exception there (any bug in those
lines) left the source unresolved with its reads on the wire. The step's
error handler failed the load, which for a load whose reads may still land
only records the error, and the deadline check skips a load with an error:
the request waited for ever ('status waiting ... resolved: [False]').
Found by an adversarial review."""

from __future__ import annotations

import pytest

from rdma_testutil import wait_until
from test_connector_fake import Pair

from rdma_kv.connector.rdma.slots import SlotTable

pytestmark = pytest.mark.timeout(60)


def test_a_bug_between_the_post_and_its_callback_fails_the_load_instead_of_hanging_it(fabric, monkeypatch):
    pair = Pair(fabric, d_extra={"load_timeout_s": 1.0})
    try:
        prompt = list(range(1, 30))
        params = pair.prefill({"x": prompt})

        def boom(self, counts):
            raise RuntimeError("injected: a bug in the figures recorded after the post")

        monkeypatch.setattr(SlotTable, "skipped_nbytes", boom)
        pair.decode({"x": prompt}, params, wait=False)
        wait_until(lambda: "x" in pair.D.results and pair.D.results["x"].status.value in ("finished", "failed"),
                   step=pair.pump, what="the load to end", timeout_s=20)
        result = pair.D.results["x"]
        # It ends: its reads landed and were CONFIRMed (the bug is logged as
        # one), so the load may be trusted; the harness checks its blocks.
        assert result.status.value == "finished" and result.bad_blocks == []
        monkeypatch.undo()
        pair.settle()  # nothing held on either side
    finally:
        monkeypatch.undo()
        pair.close()
