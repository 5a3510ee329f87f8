"""Two processes (``spawn``) over the default transports and over TCP:
random bit-exact READ and WRITE, notifications once each, hundreds of
batches in flight, coalescing, and peers that die (SIGKILL) or hang
(SIGSTOP) mid-transfer.

How TCP is selected: the parent passes ``AgentConfig(ucx_options={"TLS":
"tcp"})`` and the child sets ``UCX_TLS=tcp`` in its environment before it
creates its Agent; either alone is enough (UCX only uses transports both
workers have). ``NET_DEVICES=lo`` keeps TCP on 127.0.0.1 (UCX otherwise
stripes RMA over eth0 as well). With the default transports the RMA goes
over CMA (``process_vm_readv``/``writev``) and notifications over TCP.

What a dead peer looks like (printed by the tests, run with ``-s``): after
SIGKILL UCX's endpoint error fires long before the 3 s deadline -- over CMA
the in-flight operations fail with "Input/output error", over TCP with
"Connection reset by remote peer" -- and new posts raise PeerError. A
SIGSTOPped peer's memory stays readable over CMA (one-sided, no peer CPU),
so there transfers complete; over TCP the peer's worker must serve the gets,
so they fail at the deadline with TransferTimeoutError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest

from rdma_kv.errors import PeerError, TransferError, TransferTimeoutError
from rdma_kv.transport import Agent, AgentConfig, DescList, XferState
from transport_child import Child
from transport_helpers import (
    LOOPBACK,
    TCP,
    apply_blocks,
    collect_notifications,
    contiguous_runs,
    pattern,
    random_blocks,
    teardown_problems,
)

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(90)]

# transport -> (parent's ucx_options, child's environment)
TRANSPORTS = {
    "default": (LOOPBACK, {"UCX_NET_DEVICES": "lo"}),
    "tcp": (TCP, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),
}
REMOTE_SIZES = [4 << 20, 1 << 20]  # two registered regions in the child
LOCAL_NBYTES = 4 << 20
CHILD_SEED = 1000
WAIT_S = 20.0


@dataclass
class Link:
    """The parent's agent connected to a child's; the child's regions hold
    ``pattern(CHILD_SEED + i)`` at the start of every test."""

    transport: str
    agent: Agent
    child: Child
    local: np.ndarray

    @property
    def peer(self) -> str:
        return self.child.name

    def local_descs(self, offsets, nbytes) -> DescList:
        return DescList.from_regions(self.local.ctypes.data, offsets, nbytes)

    def remote_descs(self, region: int, offsets, nbytes) -> DescList:
        return DescList.from_regions(self.child.addrs[region], offsets, nbytes)

    def remote_bytes(self, region: int) -> np.ndarray:
        return np.frombuffer(self.child.call("snapshot", region), dtype=np.uint8)


@pytest.fixture(scope="module", params=sorted(TRANSPORTS))
def shared_link(request):
    options, env = TRANSPORTS[request.param]
    child = Child(f"child-{request.param}", env, REMOTE_SIZES, CHILD_SEED)
    agent = None
    try:
        # One lane: these tests count the operations one worker posts.
        agent = Agent("parent", AgentConfig(ucx_options=options, lanes=1))
        local = np.zeros(LOCAL_NBYTES, dtype=np.uint8)
        agent.register(local)
        assert agent.add_peer(child.metadata) == child.name
        assert child.call("add_peer", agent.metadata()) == "parent"
        yield Link(request.param, agent, child, local)
    finally:
        child.close()
        problems = teardown_problems([agent] if agent is not None else [])
        assert not problems, f"agent teardown leaked: {problems}"


@pytest.fixture
def link(shared_link: Link) -> Link:
    """The shared link, reset: child regions re-filled, local buffer zeroed."""
    for i in range(len(REMOTE_SIZES)):
        shared_link.child.call("fill", i, CHILD_SEED + i)
    shared_link.local[:] = 0
    shared_link.agent.get_notifications()  # drop leftovers of an earlier test
    yield shared_link
    assert shared_link.agent.inflight == 0


def expected_remote() -> list[np.ndarray]:
    return [pattern(CHILD_SEED + i, n) for i, n in enumerate(REMOTE_SIZES)]


# -- data ----------------------------------------------------------------------------------


def test_random_reads_are_bit_exact(link: Link, rng):
    remote = expected_remote()
    model = link.local.copy()
    for _ in range(30):
        region = int(rng.integers(len(REMOTE_SIZES)))
        block, loff, roff = random_blocks(rng, LOCAL_NBYTES, REMOTE_SIZES[region])
        xfer = link.agent.read(link.peer, link.local_descs(loff, block), link.remote_descs(region, roff, block))
        apply_blocks(model, remote[region], loff, roff, block)
        xfer.wait(WAIT_S)
        assert xfer.ops_posted == contiguous_runs(loff, roff, block) <= xfer.num_descs == len(loff)
        np.testing.assert_array_equal(link.local, model)


def test_random_writes_are_bit_exact(link: Link, rng):
    link.local[:] = rng.integers(0, 256, LOCAL_NBYTES, dtype=np.uint8)
    model = expected_remote()
    for _ in range(30):
        region = int(rng.integers(len(REMOTE_SIZES)))
        block, loff, roff = random_blocks(rng, LOCAL_NBYTES, REMOTE_SIZES[region])
        xfer = link.agent.write(link.peer, link.local_descs(loff, block), link.remote_descs(region, roff, block))
        apply_blocks(model[region], link.local, roff, loff, block)
        xfer.wait(WAIT_S)
        assert xfer.ops_posted == contiguous_runs(loff, roff, block)
    link.agent.flush(link.peer).wait(WAIT_S)
    for region in range(len(REMOTE_SIZES)):
        np.testing.assert_array_equal(link.remote_bytes(region), model[region])


def test_one_batch_across_both_remote_regions(link: Link, rng):
    block, n = 8192, 64
    roff = rng.permutation(REMOTE_SIZES[1] // block)[:n] * block
    region_of = np.arange(n) % 2
    remote = DescList(np.array([link.child.addrs[r] for r in region_of], dtype=np.uint64) + roff.astype(np.uint64),
                      block)
    loff = np.arange(n) * block
    link.agent.read(link.peer, link.local_descs(loff, block), remote).wait(WAIT_S)
    source = expected_remote()
    for lo, ro, r in zip(loff, roff, region_of):
        np.testing.assert_array_equal(link.local[lo:lo + block], source[r][ro:ro + block])

    link.local[: n * block] = rng.integers(0, 256, n * block, dtype=np.uint8)
    link.agent.write(link.peer, link.local_descs(loff, block), remote).wait(WAIT_S)
    # A write completes locally; the flush, once the child sees every byte (over
    # TCP its worker applies them: read at once, they were stale under load).
    link.agent.flush(link.peer).wait(WAIT_S)
    after = [link.remote_bytes(r) for r in range(2)]
    for lo, ro, r in zip(loff, roff, region_of):
        np.testing.assert_array_equal(after[r][ro:ro + block], link.local[lo:lo + block])


def test_coalescing_moves_the_same_bytes_with_fewer_ops(link: Link):
    block, n = 4096, 512
    offsets = np.arange(n) * block
    source = expected_remote()[0][: n * block]
    merged = link.agent.read(link.peer, link.local_descs(offsets, block), link.remote_descs(0, offsets, block))
    merged.wait(WAIT_S)
    np.testing.assert_array_equal(link.local[: n * block], source)
    link.local[:] = 0
    backwards = offsets[::-1]  # same blocks, never contiguous in posting order
    single = link.agent.read(link.peer, link.local_descs(backwards, block), link.remote_descs(0, backwards, block))
    single.wait(WAIT_S)
    np.testing.assert_array_equal(link.local[: n * block], source)
    assert (merged.num_descs, merged.ops_posted) == (n, 1)
    assert (single.num_descs, single.ops_posted) == (n, n)

    # The prepared-list path merges the same way: contiguous block ids -> one op per run.
    lp = link.agent.prep_local(link.local_descs(offsets, block))
    rp = link.agent.prep_remote(link.peer, link.remote_descs(0, offsets, block))
    ids = np.r_[10:50, 100:101, 200:264]
    assert link.agent.read_prepared(lp, ids, rp, ids).wait(WAIT_S).ops_posted == 3


# -- notifications and concurrency ---------------------------------------------------------


def test_notifications_arrive_once_each_both_ways(link: Link):
    agent = link.agent
    payloads = [f"r{i}".encode() for i in range(100)] + [f"w{i}".encode() for i in range(100)] + [b""]
    xfers = []
    for i, payload in enumerate(payloads):
        post = agent.write if payload.startswith(b"w") else agent.read
        xfers.append(post(link.peer, link.local_descs([i * 256], 256), link.remote_descs(0, [i * 256], 256),
                          notify=payload))
    for x in xfers:
        x.wait(WAIT_S)
    agent.read(link.peer, link.local_descs([0], 8), link.remote_descs(0, [0], 8), notify=b"end").wait(WAIT_S)
    got = link.child.call("notifications", payloads, b"end", WAIT_S)
    assert {peer for peer, _ in got} == {"parent"} and len(got) == len(payloads)

    # And from the child to us.
    back = [f"c{i}".encode() for i in range(50)]
    link.child.call("read_with_notifications", "parent", link.local.ctypes.data, 64, back + [b"end"])
    notes = collect_notifications(agent, back, b"end", WAIT_S)
    assert {n.peer for n in notes} == {link.peer}


def test_200_batches_in_flight_all_complete(link: Link, make_agent, rng):
    # A poll-mode agent without lanes makes no progress while it posts, so
    # every batch is outstanding at once (over TCP none can complete without
    # progress; a lane's pump would complete the batches spread to it).
    agent = make_agent("poller", progress="poll", lanes=1, ucx_options=TRANSPORTS[link.transport][0])
    local = np.zeros(LOCAL_NBYTES, dtype=np.uint8)
    agent.register(local)
    agent.add_peer(link.child.metadata)
    link.child.call("add_peer", agent.metadata())

    def descs(offsets):
        return DescList.from_regions(local.ctypes.data, offsets, block)

    block, per_batch, batches = 2048, 8, 200
    n = per_batch * batches
    local_slots = rng.permutation(LOCAL_NBYTES // block)[:n].reshape(batches, per_batch) * block
    remote_slots = rng.integers(0, REMOTE_SIZES[0] // block, (batches, per_batch)) * block
    source = expected_remote()[0]

    xfers = [agent.read(link.peer, descs(lo), link.remote_descs(0, ro, block))
             for lo, ro in zip(local_slots, remote_slots)]
    outstanding = agent.inflight
    print(f"{link.transport}: {outstanding} of {batches} READ batches in flight after posting")
    if link.transport == "tcp":
        assert outstanding == batches
    for x in xfers:
        x.wait(WAIT_S)
    assert all(x.state is XferState.DONE for x in xfers) and agent.inflight == 0
    for lrow, rrow in zip(local_slots, remote_slots):
        for lo, ro in zip(lrow, rrow):
            np.testing.assert_array_equal(local[lo:lo + block], source[ro:ro + block])

    # 200 WRITE batches, each with a notification, all posted before any wait.
    local[:] = rng.integers(0, 256, LOCAL_NBYTES, dtype=np.uint8)
    written = local.copy()
    dest = (rng.permutation(REMOTE_SIZES[0] // block)[:n] * block).reshape(batches, per_batch)
    payloads = [f"batch-{i}".encode() for i in range(batches)]
    xfers = [agent.write(link.peer, descs(lo), link.remote_descs(0, do, block), notify=p)
             for lo, do, p in zip(local_slots, dest, payloads)]
    outstanding = agent.inflight
    print(f"{link.transport}: {outstanding} of {batches} WRITE batches in flight after posting")
    if link.transport == "tcp":
        assert outstanding == batches
    for x in xfers:
        x.wait(WAIT_S)
    agent.read(link.peer, descs([0]), link.remote_descs(0, [0], block), notify=b"end").wait(WAIT_S)
    got = link.child.call("notifications", payloads, b"end", WAIT_S)
    assert {peer for peer, _ in got} == {"poller"}
    remote = link.remote_bytes(0)
    for lrow, drow in zip(local_slots, dest):
        for lo, do in zip(lrow, drow):
            np.testing.assert_array_equal(remote[do:do + block], written[lo:lo + block])


# -- peers that die or hang ----------------------------------------------------------------------


def start_victim(make_agent, transport: str, timeout_s: float, nbytes: int):
    options, env = TRANSPORTS[transport]
    child = Child(f"victim-{transport}", env, [nbytes], CHILD_SEED)
    reader = make_agent("reader", ucx_options=options, transfer_timeout_s=timeout_s)
    local = np.zeros(nbytes, dtype=np.uint8)
    reader.register(local)
    reader.add_peer(child.metadata)
    child.call("add_peer", reader.metadata())
    return child, reader, local


def settle(xfers: list) -> list:
    """Wait for every transfer (bounded); the errors of those that failed."""
    errors = []
    for x in xfers:
        try:
            x.wait(WAIT_S)
        except TransferError as exc:
            errors.append(exc)
    assert all(x.state is not XferState.IN_PROGRESS for x in xfers)
    return errors


def check_still_usable(make_agent, reader: Agent, transport: str) -> None:
    """The reader still serves other peers after one died."""
    other = make_agent("bystander", ucx_options=TRANSPORTS[transport][0])
    src = pattern(7, 1 << 16)
    other.register(src)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    region = reader.register(dst)
    reader.add_peer(other.metadata())
    reader.read("bystander", DescList([dst.ctypes.data], 1 << 16), DescList([src.ctypes.data], 1 << 16),
                timeout_s=WAIT_S).wait(WAIT_S)  # a new wire-up: not under the reader's short deadline
    np.testing.assert_array_equal(dst, src)
    reader.deregister(region)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_peer_killed_mid_transfer_fails_its_transfers_without_hanging(make_agent, transport):
    nbytes, block = 32 << 20, 64 << 10
    child, reader, local = start_victim(make_agent, transport, timeout_s=3.0, nbytes=nbytes)
    try:
        n = nbytes // block
        order = np.random.default_rng(3).permutation(n)
        L = DescList.from_regions(local.ctypes.data, np.arange(n) * block, block)
        R = DescList.from_regions(child.addrs[0], order * block, block)
        reader.read(child.name, L, R, timeout_s=WAIT_S).wait(WAIT_S)  # wired up and working (not under 3 s)

        xfers = [reader.read(child.name, L, R) for _ in range(16)]
        in_flight = [x for x in xfers if x.state is XferState.IN_PROGRESS]
        t_kill = time.monotonic()
        child.kill()
        try:  # posted after the peer is gone
            late = reader.read(child.name, L, R)
        except PeerError as exc:
            late, late_error = None, exc
        errors = settle(xfers + ([late] if late else []))
        settled_s = time.monotonic() - t_kill
        if late is not None:
            assert late.state is XferState.FAILED, "a read from a dead peer succeeded"
            late_error = late.error

        failed = [x for x in in_flight if x.state is XferState.FAILED]
        print(f"\n{transport}: SIGKILL with {len(in_flight)}/16 transfers in flight: {len(failed)} failed, "
              f"settled {settled_s:.3f} s after the kill (deadline 3 s); errors: "
              f"{sorted({(type(e).__name__, e.status) for e in errors})}; post after death: "
              f"{type(late_error).__name__}: {late_error}")
        if in_flight:
            assert failed, "no transfer in flight at the kill failed"
        for e in errors:
            assert child.name in str(e)
        assert reader.inflight == 0
        with pytest.raises(PeerError, match=f"peer '{child.name}' failed"):
            reader.read(child.name, L, R)

        check_still_usable(make_agent, reader, transport)
        reader.remove_peer(child.name)
        reader.close()  # clean, bounded close with a dead peer behind it
    finally:
        child.terminate()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_stopped_peer_hits_the_deadline_over_tcp(make_agent, transport):
    nbytes, block = 4 << 20, 64 << 10
    child, reader, local = start_victim(make_agent, transport, timeout_s=2.0, nbytes=nbytes)
    try:
        n = nbytes // block
        L = DescList.from_regions(local.ctypes.data, np.arange(n) * block, block)
        R = DescList.from_regions(child.addrs[0], np.arange(n)[::-1] * block, block)
        reader.read(child.name, L, R, timeout_s=WAIT_S).wait(WAIT_S)  # wired up (not under 2 s)

        child.stop()
        t_stop = time.monotonic()
        xfers = [reader.read(child.name, L, R) for _ in range(4)]
        errors = settle(xfers)
        print(f"\n{transport}: SIGSTOPped peer: {[x.state.value for x in xfers]} after "
              f"{time.monotonic() - t_stop:.3f} s; errors {sorted({(type(e).__name__, e.status) for e in errors})}")
        if transport == "tcp":
            # The gets need the peer's worker: nothing completes, the deadline fails them.
            assert len(errors) == len(xfers)
            assert any(isinstance(e, TransferTimeoutError) for e in errors)
            with pytest.raises(PeerError, match="within its deadline"):
                reader.read(child.name, L, R)
        else:
            # CMA reads a stopped process's memory without its help: either outcome
            # is correct as long as it is bounded (and bit-exact when it completes).
            if not errors:
                expect = pattern(CHILD_SEED, nbytes).reshape(n, block)[::-1].reshape(-1)
                np.testing.assert_array_equal(local, expect)
        check_still_usable(make_agent, reader, transport)
    finally:
        child.terminate()
