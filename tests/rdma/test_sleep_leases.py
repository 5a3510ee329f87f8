"""Sleep mode at the lease level (no UCX): a wake from sleep (the workers'
new registration in ``set_xfer_handshake_metadata``) starts a new lease
epoch, so a lease issued before the sleep and shipped after it is never
held, and every call naming it answers GONE; params carry the registration."""

from __future__ import annotations

import pytest

from rdma_kv.connector import (
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVConnectorRole,
    KVTransferConfig,
    Request,
    SchedulerOutput,
)
from rdma_kv.connector.rdma import RdmaConnector
from rdma_kv.connector.rdma.leases import LeaseCall
from rdma_kv.connector.rdma.meta import RdmaHandshakeMetadata
from rdma_kv.connector.rdma.params import parse_kv_transfer_params
from rdma_kv.connector.rdma.producer import RdmaProducer
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.wire import LeaseStatus

pytestmark = pytest.mark.timeout(60)

BS = 4
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="float32")


def scheduler():
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", engine_id="P", kv_port=5000)
    cache = KVCacheConfig(64, (KVCacheTensor(64 * SPEC.page_size_bytes, ("l0",)),), (KVCacheGroupSpec(("l0",), SPEC),))
    return config, RdmaConnector(config, KVConnectorRole.SCHEDULER, cache)


def finish(s, rid, blocks):
    request = Request(rid, list(range(1, len(blocks) * BS + 1)), {"do_remote_decode": True})
    request.num_computed_tokens = len(blocks) * BS
    s.get_num_new_matched_tokens(request, 0)
    s.update_state_after_alloc(request, KVCacheBlocks.of(blocks), 0)
    return parse_kv_transfer_params(s.request_finished(request, blocks)[1])


def handshakes(registration):
    return {0: RdmaHandshakeMetadata("P", "127.0.0.1", 5000, 0, "h", registration)}


def test_a_lease_issued_before_a_sleep_and_shipped_after_it_is_never_held():
    config, s = scheduler()
    s.set_xfer_handshake_metadata(handshakes(1))
    producer = RdmaProducer("P", RdmaSettings.from_config(config), None)
    meta = s.build_connector_meta(SchedulerOutput())
    producer.on_step(meta.lease_epoch, meta.lease_key, meta.sends)
    shipped = finish(s, "shipped", [1, 2])
    meta = s.build_connector_meta(SchedulerOutput())
    producer.on_step(meta.lease_epoch, meta.lease_key, meta.sends)
    issued = finish(s, "issued", [3, 4])  # issued, then the engine sleeps before the next step
    assert shipped.remote_registration == issued.remote_registration == 1
    # The engine sleeps and wakes: the workers register again (registration 2).
    s.set_xfer_handshake_metadata(handshakes(2))
    meta = s.build_connector_meta(SchedulerOutput())
    assert meta.lease_epoch != shipped.remote_lease_epoch
    producer.on_step(meta.lease_epoch, meta.lease_key, meta.sends, meta.reclaims)
    assert producer.take_done() == {"shipped", "issued"}  # both blocks sets go back to the engine
    assert len(producer.leases) == 0
    for params in (shipped, issued):
        call = [LeaseCall(params.lease, b"c" * 16)]
        assert producer.leases.confirm(call, release=True) == [LeaseStatus.GONE]
        assert producer.leases.renew(call) == [LeaseStatus.GONE]
    after = finish(s, "after", [5, 6])
    assert after.remote_registration == 2 and after.remote_lease_epoch == meta.lease_epoch
    meta = s.build_connector_meta(SchedulerOutput())
    producer.on_step(meta.lease_epoch, meta.lease_key, meta.sends)
    assert producer.leases.confirm([LeaseCall(after.lease, b"c" * 16)], release=True) == [LeaseStatus.HELD]


def test_the_same_registration_again_keeps_the_epoch():
    _, s = scheduler()
    s.set_xfer_handshake_metadata(handshakes(1))
    epoch = s.build_connector_meta(SchedulerOutput()).lease_epoch
    s.set_xfer_handshake_metadata(handshakes(1))
    assert s.build_connector_meta(SchedulerOutput()).lease_epoch == epoch


def test_params_name_their_registration_and_the_binding_covers_it():
    _, s = scheduler()
    s.set_xfer_handshake_metadata(handshakes(3))
    params = finish(s, "r", [1, 2])
    assert params.to_dict()["remote_registration"] == 3
    lowered = parse_kv_transfer_params({**params.to_dict(), "remote_registration": 2})
    assert lowered.lease.binding != params.lease.binding  # editing it is a forgery (FORGED)
