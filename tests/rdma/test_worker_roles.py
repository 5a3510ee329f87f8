"""The worker's parts per role: a consumer-only worker has no side channel;
a producer-only worker handed a lease (a decode request sent to the wrong
engine) still gives the lease back at once rather than letting it expire."""

from __future__ import annotations

import pytest
from fakes import FakeFabric
from rdma_testutil import wait_until
from test_connector_fake import SHAPE, Pair, config

from rdma_kv.harness.engine import Engine

pytestmark = pytest.mark.timeout(60)


def test_a_producer_only_engine_releases_a_lease_it_cannot_load():
    fabric = FakeFabric()
    pair = Pair(fabric)
    other = Engine(config("kv_producer", "P2"), SHAPE, connector_kwargs={"transport_factory": fabric.factory})
    try:
        assert pair.D.worker.worker.side_channel_port is None  # consumer only: no producer part
        prompt = list(range(1, 30))
        params = pair.prefill({"a": prompt})
        other.add_request("a", prompt, params["a"])  # P2 cannot load: it computes locally

        def pump():
            pair.pump()
            other.step()

        leases = pair.P.worker.worker.leases
        wait_until(lambda: leases.stats.released == 1 and not pair.P.held, step=pump,
                   what="P's lease released by the producer-only engine P2")
        assert leases.stats.expired == 0
        wait_until(lambda: "a" in other.results, step=pump, what="P2 finished the request")
        assert other.results["a"].external_tokens == 0
    finally:
        other.shutdown()
        pair.close()
