"""One request's ``kv_transfer_params`` must not make a consumer rank call
a thousand ports. ``tp_size`` in the params is the client's word (1 to
1024 parse): the consumer plans the producer ranks from it before any
handshake checks it. With a model whose KV heads ``tp_size`` shares out
(1024 of 2 heads), consumer rank 0 reads two producer ranks and used to
release the other 1,022 at once, "release-only", one RELEASE call per
``remote_port + rank`` of a host the client chose, on the RPC threads its
handshakes and CONFIRMs share (found by an adversarial review: ~6 s each
against an address that drops packets). The ranks only released are
released once a handshake confirmed the TP size
(``lease_rpc.LeaseCalls.targets``); a lease with no rank plan releases at
most ``MAX_UNPLANNED_RANKS``."""

from __future__ import annotations

import pytest
from leaseutil import ref
from test_connector_fake import Pair

from rdma_kv.connector.rdma.consumer import lease_rpc
from rdma_kv.connector.rdma.consumer.lease_rpc import LeaseCalls
from rdma_kv.connector.rdma.consumer.records import LoadBook
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.topology import plan_ranks
from rdma_kv.connector.types import EngineId
from rdma_kv.errors import ConfigError
from fakes import FakeFabric

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """Wraps a pool's submit: the producer ranks each submitted lease call (``LeaseCalls._call``) goes to."""

    def __init__(self, pool, monkeypatch):
        self.calls: list[tuple[str, int]] = []
        for name in ("submit", "submit_renewal"):
            monkeypatch.setattr(pool, name, self._wrap(getattr(pool, name)))

    def _wrap(self, submit):
        def record(fn, *args, **kw):
            if getattr(fn, "__func__", None) is LeaseCalls._call:
                kind, _, rank, _ = args
                self.calls.append((kind.__name__, rank))
            return submit(fn, *args, **kw)
        return record


def test_a_client_chosen_tp_size_costs_no_more_lease_calls_than_the_ranks_read(monkeypatch):
    pair = Pair(FakeFabric())
    try:
        prompt = list(range(1, 30))
        params = pair.prefill({"a": prompt})["a"]
        recorder = Recorder(pair.D.worker.worker._pool, monkeypatch)
        pair.decode({"a": prompt}, {"a": {**params, "tp_size": 1024}})  # accepted as is: 1024 % 2 heads == 0
        assert pair.D.results["a"].load_failed  # its handshake found rank 0 of 1: recomputed
        read = {r.rank for r in plan_ranks(0, 1, 1024, 2).reads}
        assert read == {0, 512}
        ranks = {rank for _, rank in recorder.calls}
        assert ranks <= read, (f"one params set made this consumer rank submit {len(recorder.calls)} lease "
                               f"calls to {len(ranks)} producer ranks")
    finally:
        pair.close()


def calls(plan, confirmed):
    return LeaseCalls(RdmaSettings("127.0.0.1", "127.0.0.1", 0), plan, None, LoadBook(), lambda ld, why: None,
                      lambda address, ranks: confirmed)


def test_ranks_only_released_are_called_once_a_handshake_confirmed_the_tp_size():
    """Producer TP 4 of 2 KV heads, consumer TP 1: ranks 0 and 2 are read, 1 and 3 only released."""
    address = PeerAddress(EngineId("P"), "127.0.0.1", 5000, 4)
    lease = RemoteLease(address, ref(1), b"C" * 16)
    plan = lambda addr: plan_ranks(0, 1, addr.tp_size, 2)  # noqa: E731
    assert [p for p, _ in calls(plan, False).targets(lease)] == [0, 2]
    assert [p for p, _ in calls(plan, True).targets(lease)] == [0, 1, 2, 3]
    assert [p for p, _ in calls(plan, False).release_only(lease, plan(address))] == [1, 3]


def test_a_lease_with_no_rank_plan_releases_a_bounded_number_of_ranks():
    """TP sizes that cannot share the model's heads (no plan, no handshake
    can confirm): the ranks this consumer rank releases are capped."""
    def no_plan(address):
        raise ConfigError("cannot share")

    small = RemoteLease(PeerAddress(EngineId("P"), "127.0.0.1", 5000, 3), ref(1), b"C" * 16)
    assert [p for p, _ in calls(no_plan, False).targets(small)] == [0, 1, 2]  # every rank, as before
    huge = RemoteLease(PeerAddress(EngineId("P"), "127.0.0.1", 5000, 1000), ref(1), b"C" * 16)
    assert [p for p, _ in calls(no_plan, False).targets(huge)] == list(range(lease_rpc.MAX_UNPLANNED_RANKS))
