"""A lease read by several consumer ranks, end to end over the real side
channel (127.0.0.1): a harness producer engine (fake transport, real
scheduler, worker, lease table and side-channel server) holds one prefill's
blocks; two clients play decode ranks 0 and 1 of one consumer engine (one
claim, ``readers=2``), as with prefill TP=1 and decode TP=2. The blocks must
stay out of ``done_sending`` until both ranks released."""

from __future__ import annotations

import secrets

import pytest
from fakes import FakeFabric
from rdma_testutil import wait_until
from test_connector_fake import SHAPE, config

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.lease_rpc import call_lease_rpc
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.params import parse_kv_transfer_params
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.harness.engine import Engine

pytestmark = pytest.mark.timeout(60)

HELD, GONE, CLAIMED = wire.LeaseStatus.HELD, wire.LeaseStatus.GONE, wire.LeaseStatus.CLAIMED


class Producer:
    """A producer engine that remembers every request it reported in ``finished_sending``."""

    def __init__(self):
        self.engine = Engine(config("kv_producer", "P"), SHAPE,
                             connector_kwargs={"transport_factory": FakeFabric().factory})
        self.sent: set[str] = set()

    def step(self):
        self.sent |= set(self.engine.step().finished_sending)

    def prefill(self, rid, prompt):
        self.engine.add_request(rid, prompt, {"do_remote_decode": True})
        wait_until(lambda: rid in self.engine.results, step=self.step, what=f"the prefill of {rid}")
        leases = self.engine.worker.worker.leases
        wait_until(lambda: len(leases) == 1, step=self.step, what=f"the grant of {rid}'s lease")
        return parse_kv_transfer_params(self.engine.results[rid].kv_transfer_params)


@pytest.fixture
def producer():
    p = Producer()
    yield p
    p.engine.shutdown()


def confirm(client, lease, claim, reader, readers=2, release=True):
    message = wire.Confirm(wire.PROTOCOL_VERSION, [wire.LeaseWire.of(lease, claim, reader, readers)],
                           release=release)
    return client.lease_call(message).statuses[0]


@pytest.mark.parametrize("last", ["confirm", "release"])
def test_the_blocks_stay_held_until_both_ranks_released(producer, last):
    params = producer.prefill("a", list(range(1, 3 * SHAPE.block_size + 2)))
    held = list(producer.engine.held["a"])
    claim = secrets.token_bytes(wire.CLAIM_BYTES)  # the consumer engine's, shared by its ranks
    ranks = [SideChannelClient(params.remote_host, params.remote_port, rpc_timeout_s=5.0) for _ in range(3)]
    try:
        rank0, rank1, confused = ranks
        assert confirm(rank0, params.lease, claim, 0, release=False) == HELD  # claims it for 2 readers
        assert confirm(rank0, params.lease, claim, 0) == HELD  # rank 0 read, confirms and releases
        for _ in range(5):
            producer.step()
        assert "a" not in producer.sent and producer.engine.held.get("a") == held, (
            "rank 0's release handed back blocks rank 1 still reads")
        # A rank that disagrees on how many ranks read is refused and changes nothing.
        assert confirm(confused, params.lease, claim, 1, readers=1) == CLAIMED
        producer.step()
        assert "a" not in producer.sent
        assert confirm(rank1, params.lease, claim, 1, release=False) == HELD  # rank 1's read is still covered
        if last == "confirm":
            assert confirm(rank1, params.lease, claim, 1) == HELD
        else:  # the consumer's RELEASE path, through the RPC helper with the lease's reader fields
            peer = PeerAddress(params.remote_engine_id, params.remote_host, params.remote_port, params.tp_size)
            refused = call_lease_rpc(rank1, wire.Release, peer,
                                     [RemoteLease(peer, params.lease, claim, reader=1, readers=2)])
            assert refused == []
        wait_until(lambda: "a" in producer.sent, step=producer.step, what="a in done_sending")
        assert "a" not in producer.engine.held
        assert producer.engine.num_free_blocks() == SHAPE.num_blocks
        # Retries: rank 0's releasing CONFIRM is recognised; rank 1's too if it confirmed; others are GONE.
        assert confirm(rank0, params.lease, claim, 0) == HELD
        assert confirm(rank1, params.lease, claim, 1) == (HELD if last == "confirm" else GONE)
        assert confirm(confused, params.lease, claim, 2) == GONE
    finally:
        for client in ranks:
            client.close()
