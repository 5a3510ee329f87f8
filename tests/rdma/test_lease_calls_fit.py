"""Lease calls fit what a producer accepts: at most
``wire.MAX_LEASES_PER_MESSAGE`` leases and ``wire.MAX_REQUEST_BYTES`` a call.

A producer refuses a call over either limit whole (an ``ErrorReply``, which
the client raises as ``MetadataError``). CONFIRM was never cut: past 4,096
queued leases (one CONFIRM per producer rank in flight, the rest queued
behind it) every load of the batch failed, although every lease was HELD.
RENEW, RELEASE and PIN were cut by count only: 4,096 leases of 190-character
request ids already pass the byte limit (an id may be 1,024 characters).
Found by an adversarial review."""

from __future__ import annotations

import random

import pytest

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.confirms import Confirmations
from rdma_kv.connector.rdma.consumer.lease_rpc import LeaseCalls, call_lease_rpc
from rdma_kv.connector.rdma.consumer.peers import PeerState
from rdma_kv.connector.rdma.consumer.records import LoadBook, LoadState, Source, SourceStage
from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress
from rdma_kv.connector.rdma.params import LeaseRef
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.topology import Read
from rdma_kv.errors import MetadataError, PeerError, PeerTimeout

PEER = PeerAddress("P", "127.0.0.1", 5000, 1)
WIDE = "\U0001f600"  # four bytes in UTF-8: one character of the 1,024 an id may have


def lease(rid: str, k: int = 1) -> wire.LeaseWire:
    return wire.LeaseWire(2**64 - 1, 2**64 - k, rid, b"t" * 16, b"b" * 16, b"c" * 16, wire.MAX_READER,
                          wire.MAX_READERS)


def calls_of(leases, kind):
    chunks = list(wire.lease_chunks(leases, lambda item: item.request_id))
    return chunks, [wire.encode(kind(wire.PROTOCOL_VERSION, chunk)) for chunk in chunks]


@pytest.mark.parametrize("kind", [wire.Confirm, wire.Renew, wire.Release])
def test_every_call_is_one_the_producer_accepts_and_nothing_is_lost(kind):
    rng = random.Random(7)
    cases = [
        [lease("r") for _ in range(wire.MAX_LEASES_PER_MESSAGE + 1)],
        [lease("x" * 190) for _ in range(wire.MAX_LEASES_PER_MESSAGE)],
        [lease(WIDE * 1024) for _ in range(600)],
        [lease(rng.choice(["a", WIDE]) * rng.randint(1, 1024), k + 1) for k in range(3000)],
    ]
    for leases in cases:
        chunks, bodies = calls_of(leases, kind)
        assert [item for chunk in chunks for item in chunk] == leases  # in order, none lost or doubled
        for chunk, body in zip(chunks, bodies):
            assert len(body) <= wire.MAX_REQUEST_BYTES
            assert wire.decode_request(body).leases == chunk  # the producer's own schema check
    assert [len(c) for c in calls_of(cases[0], kind)[0]] == [wire.MAX_LEASES_PER_MESSAGE, 1]
    # Cut by count only (as before), the 190-character ids were one call, over the byte limit:
    assert len(wire.encode(kind(wire.PROTOCOL_VERSION, cases[1]))) > wire.MAX_REQUEST_BYTES
    assert len(calls_of(cases[1], kind)[0]) == 2


class Producer:
    """A client doing to a call what the producer's side channel does: a
    frame over ``MAX_REQUEST_BYTES`` or one its schema refuses is an
    ``ErrorReply`` (``MetadataError`` at the client); else every lease is
    HELD. ``fail_call``: that call (0-based) fails as a dead producer's."""

    def __init__(self, fail_call=None):
        self.sizes, self.fail_call, self.refused = [], fail_call, 0

    def lease_call(self, request, urgent=False):
        body = wire.encode(request)
        self.sizes.append(len(request.leases))
        if len(self.sizes) - 1 == self.fail_call:
            raise PeerError("side channel 127.0.0.1:5000 unreachable (test)")
        if len(body) > wire.MAX_REQUEST_BYTES or len(request.leases) > wire.MAX_LEASES_PER_MESSAGE:
            self.refused += 1
            raise MetadataError("refused: over the producer's limits")
        return wire.LeaseReply([wire.LeaseStatus.HELD] * len(request.leases), 10.0)


class Pool:
    def __init__(self, client):
        self.jobs, self.client = [], client

    def submit(self, fn, *args, to=None):
        self.jobs.append((fn, args))
        return True

    submit_renewal = submit

    def get(self, host, port):
        return self.client


def confirm_queued(n, rid, client):
    """Queue ``n`` loads' sources for one producer rank and run the CONFIRM
    job: (confirmed loads, failed loads with why)."""
    book, pool = LoadBook(), Pool(client)
    failed, confirmed, gone = [], [], []

    def fail(load, why):
        failed.append((load.spec.request_id, why))

    class Directory:
        def failed(self, peer, reason):
            gone.append(reason)

    leases = LeaseCalls(RdmaSettings("127.0.0.1", "127.0.0.1", 0), None, pool, book, fail)
    confirms = Confirmations(book.lock, pool, Directory(), leases, fail,
                             lambda load, now: confirmed.append(load.spec.request_id), lambda key: False,
                             book.counters)
    peer = PeerState(PEER, 0)
    with book.lock:
        for i in range(n):
            ref = LeaseRef(1, i + 1, rid(i), b"t" * 16, b"b" * 16)
            spec = LoadSpec(f"d{i}", ((i,),), ((i,),), PEER, ref, 10.0, b"c" * 16)
            load = LoadState(spec, 1e9, 0.0)
            load.sources = [Source(Read(0, 0, 0, 1), 1, stage=SourceStage.CONFIRMING)]
            book.loads[spec.request_id] = load
            confirms.queue(peer, load, load.sources[0])
    (job, args), = pool.jobs  # one job per producer rank, however many are queued
    job(*args)
    return confirmed, failed, gone


def test_a_queue_longer_than_one_call_is_confirmed_in_several():
    client = Producer()
    confirmed, failed, _ = confirm_queued(wire.MAX_LEASES_PER_MESSAGE + 1, lambda i: f"req-{i}", client)
    assert failed == [] and len(confirmed) == wire.MAX_LEASES_PER_MESSAGE + 1
    assert client.sizes == [wire.MAX_LEASES_PER_MESSAGE, 1]
    client = Producer()
    confirmed, failed, _ = confirm_queued(2000, lambda i: f"{i:04d}" + "x" * 1020, client)
    assert failed == [] and len(confirmed) == 2000 and len(client.sizes) > 1


def test_a_failed_call_fails_only_the_loads_it_carried():
    client = Producer(fail_call=1)
    n = 2 * wire.MAX_LEASES_PER_MESSAGE + 10
    confirmed, failed, gone = confirm_queued(n, lambda i: f"req-{i}", client)
    assert client.sizes == [wire.MAX_LEASES_PER_MESSAGE, wire.MAX_LEASES_PER_MESSAGE, 10]
    assert len(confirmed) == wire.MAX_LEASES_PER_MESSAGE + 10
    assert sorted(rid for rid, _ in failed) == sorted(f"d{i}" for i in range(wire.MAX_LEASES_PER_MESSAGE,
                                                                           2 * wire.MAX_LEASES_PER_MESSAGE))
    assert all("could not confirm the lease" in why for _, why in failed)
    assert len(gone) == 1  # the producer is failed in the directory (no read from it can still land)


def test_a_release_that_times_out_does_not_find_the_producer_gone():
    """A RELEASE the producer did not answer (``PeerTimeout``: stalled, as
    a process on a loaded host is for seconds) leaves it in the peer
    directory; one whose connection was refused finds it gone. Before, any
    ``PeerError`` failed it: its endpoint and keys dropped, and the next
    load's handshake met the producer still not answering."""

    class Failing:
        def __init__(self, exc):
            self.exc = exc

        def lease_call(self, request, urgent=False):
            raise self.exc

    ref = LeaseRef(1, 1, "r", b"t" * 16, b"b" * 16)
    leases = [LoadSpec("d", ((0,),), ((0,),), PEER, ref, 10.0, b"c" * 16).remote_lease]
    for exc, found_gone in ((PeerTimeout("side channel 127.0.0.1:5000 unreachable after 2 attempts: timed out"),
                             False),
                            (PeerError("side channel 127.0.0.1:5000 unreachable after 2 attempts: refused"), True)):
        gone = []
        assert call_lease_rpc(Failing(exc), wire.Release, PEER, leases, gone=gone.append) is None
        assert bool(gone) is found_gone, (exc, gone)


def test_a_real_producer_takes_each_call(fabric):
    """The producer's side channel (a harness engine over the fake fabric)
    answers every call ``lease_chunks`` makes of 4,097 leases with 1,024-
    character ids (each lease is answered, though none was granted), and
    refuses the one call that carried them all before."""
    from rdma_kv.connector import KVTransferConfig
    from rdma_kv.connector.rdma.sideclient import SideChannelClient
    from rdma_kv.harness.engine import Engine, ModelShape

    shape = ModelShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=64)
    cfg = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_producer", engine_id="P", kv_port=0,
                           kv_connector_extra_config={})
    producer = Engine(cfg, shape, connector_kwargs={"transport_factory": fabric.factory})
    client = SideChannelClient("127.0.0.1", producer.worker.worker.side_channel_port, retries=0)
    try:
        leases = [lease(f"{k:05d}" + "y" * 1019, k + 1) for k in range(wire.MAX_LEASES_PER_MESSAGE + 1)]
        answered = 0
        for chunk in wire.lease_chunks(leases, lambda item: item.request_id):
            reply = client.lease_call(wire.Confirm(wire.PROTOCOL_VERSION, chunk))
            assert len(reply.statuses) == len(chunk)  # answered, each (PENDING: no such epoch here)
            answered += len(chunk)
        assert answered == len(leases)
        with pytest.raises((MetadataError, PeerError)):  # an ErrorReply, or the connection closed on it
            SideChannelClient("127.0.0.1", producer.worker.worker.side_channel_port, retries=0).lease_call(
                wire.Confirm(wire.PROTOCOL_VERSION, leases[:wire.MAX_LEASES_PER_MESSAGE]))
    finally:
        client.close()
        producer.shutdown()


@pytest.mark.parametrize("kind", ["renew", "release"])
def test_renewals_and_releases_are_cut_to_fit(kind):
    """RENEW and RELEASE of 3,000 loads of 1,024-character ids to one
    producer rank: every call the RPC threads make is accepted (cut by
    count only, the 4,096-lease calls of such ids were refused whole)."""
    from rdma_kv.connector.rdma.meta import RemoteLease

    client = Producer()
    pool = Pool(client)
    calls = LeaseCalls(RdmaSettings("127.0.0.1", "127.0.0.1", 0), None, pool, LoadBook(), lambda load, why: None)
    targets = [(0, RemoteLease(PEER, LeaseRef(1, k + 1, f"{k:05d}" + "z" * 1019, b"t" * 16, b"b" * 16),
                               b"c" * 16)) for k in range(3000)]
    getattr(calls, kind)(targets)
    for job, args in pool.jobs:
        job(*args)
    assert client.refused == 0 and sum(client.sizes) == 3000 and len(client.sizes) > 1
