"""RdmaWorker.register_kv_caches only refuses a second call while a
transport is open; while asleep (_transport None) it registers again but
leaves ``_asleep`` True and ``_registration`` unchanged. The handshake then
publishes the *same* registration number as before the sleep (peers that
cached keys/geometry of that registration keep them), and the next
``unregister_kv_caches`` (the next sleep) returns early: the KV memory is
freed by the engine while still registered with UCX and served to peers.

Correct behaviour asserted: it behaves as a wake (a new registration, and
the next sleep unregisters). Found by an adversarial review."""
from __future__ import annotations

from fakes import FakeFabric

from rdma_kv.connector import KVTransferConfig
from rdma_kv.harness.engine import Engine, ModelShape

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=16, dtype="float32")


def test_register_kv_caches_while_asleep():
    fabric = FakeFabric()
    cfg = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", engine_id="P", kv_port=0)
    P = Engine(cfg, SHAPE, connector_kwargs={"transport_factory": fabric.factory}, prefix_caching=False)
    try:
        worker = P.worker.worker
        before = worker.handshake_metadata()
        P.sleep()
        P.worker.register_kv_caches(P.kv_caches)
        after = worker.handshake_metadata()
        transport = worker._transport
        worker.unregister_kv_caches()  # the next sleep
        still_open = not transport.closed
        print(f"registration before sleep {before.registration}, after re-register {after.registration}; "
              f"transport left open by the next sleep: {still_open}")
        assert after.registration != before.registration and not still_open, (
            f"register_kv_caches while asleep published registration {after.registration} (same as before the "
            f"sleep: {before.registration}) and the next unregister_kv_caches left the transport open "
            f"(regions still registered: {transport.regions})")
    finally:
        P.shutdown()


def test_a_sleep_whose_transport_closed_wedged_is_refused():
    """A close that found a thread stuck in UCX leaves the memory
    registered (``Agent.wedged``): a stuck transfer could still write into
    it. ``unregister_kv_caches`` used to report the sleep done all the
    same, and the engine freed the memory; now it raises, so the engine
    keeps it (argued by an adversarial review)."""
    import pytest

    from rdma_kv.errors import UCXError

    fabric = FakeFabric()
    cfg = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", engine_id="P", kv_port=0)
    P = Engine(cfg, SHAPE, connector_kwargs={"transport_factory": fabric.factory}, prefix_caching=False)
    try:
        worker = P.worker.worker
        transport = worker._transport
        close = transport.close

        def wedged_close():
            close()
            transport.wedge = True

        transport.close = wedged_close
        with pytest.raises(UCXError, match="stays registered"):
            worker.unregister_kv_caches()
        assert transport.closed
        # A retried sleep is refused as well (found by a review: it returned
        # early, reporting the sleep done), and so is one after a wake.
        with pytest.raises(UCXError, match="stays registered"):
            worker.unregister_kv_caches()
        worker.restore_kv_caches()
        with pytest.raises(UCXError, match="stays registered"):
            worker.unregister_kv_caches()
    finally:
        P.shutdown()
