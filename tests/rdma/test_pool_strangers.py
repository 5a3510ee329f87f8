"""The consumer's calls to producer addresses not answering ("strangers",
``consumer.clients``), past the cap of ``strangers(rpc_threads)`` at once:

- calls parked for a stranger's place were one queue without a bound: a
  client of the decode server naming fresh ports of a host that accepts
  and never answers (``kv_transfer_params`` remote_host / remote_port),
  faster than the capped places drain, delayed the first handshake with
  a new producer behind all of them. Parked calls now wait per host, taken
  in turn, at most ``PARKED_PER_HOST`` per host and ``PARKED_MAX`` in all;
  a stranger call past that is not made: it fails at once, saying why, and
  its load recomputes (at the bound in all, since 2026-11-30, the oldest
  parked call of the host holding the most, unless the call's host holds
  as many: ``test_pool_many_hosts.py``).
- the ranks of a producer engine that just stopped answered before, so
  their first calls were not capped: a stopped TP-4 engine held the four
  threads for one call's attempts each. A peer that answered before and
  whose attempt fails at it (a timeout, a refused connection) now takes a
  stranger's place to be tried again, or is not tried again.

Found by the reviews of push, sleep, leases and the router surface
(docs/reliability.md). Asserted on order and counts, not time."""

from __future__ import annotations

import socket
import threading

import pytest
from rdma_testutil import wait_until
from test_connector_fake import Pair
from test_pool_isolation import Gate, Handler, Tarpit, lease

from fakes import FakeFabric
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import PARKED_MAX, PARKED_PER_HOST, ClientPool, strangers
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import CallGuard, SideChannelClient, guarded
from rdma_kv.errors import PeerError

pytestmark = pytest.mark.timeout(120)

THREADS = 4  # the worker's default rpc_threads
TARPIT_HOST = "10.6.6.6"


class Held:
    """Calls that block until released, and which of them started."""

    def __init__(self) -> None:
        self.started: list[object] = []
        self.release = threading.Event()
        self._lock = threading.Lock()

    def call(self, name: object) -> None:
        with self._lock:
            self.started.append(name)
        self.release.wait(60)


def hold_the_strangers_places(pool: ClientPool, held: Held, host: str = TARPIT_HOST) -> None:
    for port in range(strangers(THREADS)):
        assert pool.submit(held.call, ("held", port), to=(host, 9000 + port))
    wait_until(lambda: len(held.started) == strangers(THREADS), what="the strangers' places held")


def test_the_first_call_to_a_new_producer_is_not_behind_a_host_of_ports_that_never_answer():
    """Before: the new producer's handshake started after every call parked
    before it (here 12 to ports of one host that never answer, each holding
    a capped place for its attempts once started)."""
    pool = ClientPool(lambda h, p: Gate(answering=False), threads=THREADS)
    first, tarpits = Held(), Held()
    try:
        hold_the_strangers_places(pool, first)
        for port in range(12):  # fresh ports a client named, faster than the places drain
            assert pool.submit(tarpits.call, port, to=(TARPIT_HOST, 7000 + port))
        handshake = threading.Event()
        assert pool.submit(handshake.set, to=("10.0.0.1", 5600))  # a new producer: a stranger too
        first.release.set()  # the two places free
        assert handshake.wait(30), "a new producer's first call waited behind every call to the tarpit host"
        # One call of that host, the new producer's, that host's again: the places are full once more.
        wait_until(lambda: len(tarpits.started) == 2, what="the tarpit host's turns")
        assert sorted(tarpits.started) == [0, 1] and pool._calls.nparked == 10
    finally:
        first.release.set()
        tarpits.release.set()
        pool.close()


def test_stranger_calls_past_the_bound_are_not_made_and_fail_at_once_saying_why():
    """Beyond ``PARKED_PER_HOST`` calls parked for one host, or ``PARKED_MAX``
    in all, a call to a stranger fails at once (its load recomputes) instead
    of waiting behind them; calls to producers that answer are not touched."""
    clients: dict[tuple[str, int], SideChannelClient] = {}

    def make(host: str, port: int) -> SideChannelClient:
        return clients.setdefault((host, port), SideChannelClient(host, port, connect_timeout_s=30.0,
                                                                  rpc_timeout_s=30.0))

    pool = ClientPool(make, threads=THREADS)
    held, parked = Held(), Held()
    failed: dict[tuple[str, int], Exception] = {}
    done = threading.Event()

    def release(host: str, port: int) -> None:  # a load's RELEASE (or handshake): a call to the client
        try:
            pool.get(host, port).lease_call(wire.Release(wire.PROTOCOL_VERSION, [lease(1)]))
        except PeerError as exc:
            failed[host, port] = exc
        done.set()

    shed: dict[tuple[str, int], str] = {}

    def parked_call(host: str, port: int) -> None:  # a load's call, parked: made only if the pool sheds it
        try:
            pool.get(host, port).lease_call(wire.Release(wire.PROTOCOL_VERSION, [lease(1)]))
        except PeerError as exc:
            shed[host, port] = str(exc)

    try:
        hold_the_strangers_places(pool, held)
        for port in range(PARKED_PER_HOST):
            assert pool.submit(parked_call, TARPIT_HOST, 7000 + port, to=(TARPIT_HOST, 7000 + port))
        assert pool._calls.nparked == PARKED_PER_HOST
        assert pool.submit(release, TARPIT_HOST, 7999, to=(TARPIT_HOST, 7999))
        assert done.wait(30), "a stranger call past the host's bound waited"
        assert "not called" in str(failed[TARPIT_HOST, 7999]) and "host 10.6.6.6" in str(failed[TARPIT_HOST, 7999])
        assert pool._calls.nparked == PARKED_PER_HOST  # what was parked stays parked: nothing accepted is lost

        # At the bound in all (changed, test_pool_many_hosts.py: before, the call to a host with nothing parked
        # was not made, and under a flood on more hosts than PARKED_MAX / PARKED_PER_HOST no new producer's
        # was): the oldest parked call of the host holding the most (the first in turn) is not made instead.
        hosts = [f"10.7.0.{i}" for i in range((PARKED_MAX - PARKED_PER_HOST) // PARKED_PER_HOST)]
        for host in hosts:
            for port in range(PARKED_PER_HOST):
                assert pool.submit(parked_call, host, 7000 + port, to=(host, 7000 + port))
        assert pool._calls.nparked == PARKED_MAX
        done.clear()
        assert pool.submit(release, "10.8.0.1", 5600, to=("10.8.0.1", 5600))  # a host with nothing parked
        wait_until(lambda: shed, what="a parked call not made")
        assert list(shed) == [(TARPIT_HOST, 7000)] and not done.is_set()
        message = shed[TARPIT_HOST, 7000]
        assert f"{PARKED_MAX} calls to producer addresses that have not answered" in message
        assert f"{PARKED_PER_HOST} of them to host {TARPIT_HOST}" in message
        assert "for a call to host 10.8.0.1" in message
        assert "kv_transfer_params" in message and "computed here instead" in message
        assert pool._calls.nparked == PARKED_MAX and len(pool._calls.parked["10.8.0.1"]) == 1
        # Calls to that host take the places of others' while it holds fewer than the host holding the most;
        # then they are not made.
        for port in range(5601, 5600 + PARKED_PER_HOST):
            parked_there = len(pool._calls.parked["10.8.0.1"])
            assert pool.submit(release, "10.8.0.1", port, to=("10.8.0.1", port))
            if len(pool._calls.parked["10.8.0.1"]) == parked_there:  # not parked: not made
                break
        assert done.wait(30), "a stranger call past the bound in all waited"
        assert list(failed) == [(TARPIT_HOST, 7999), ("10.8.0.1", port)]
        why = str(failed["10.8.0.1", port])
        assert parked_there < PARKED_PER_HOST and f"{parked_there} of them to host 10.8.0.1" in why
        assert parked_there == max(len(queue) for queue in pool._calls.parked.values())
        assert f"{PARKED_MAX} calls to producer addresses that have not answered" in why
        assert pool._calls.nparked == PARKED_MAX
        assert not parked.started and len(held.started) == strangers(THREADS)
    finally:
        pool.close()  # first: the calls parked are dropped, not made (to hosts that never answer a connect)
        held.release.set()
        parked.release.set()


def test_a_load_whose_handshake_is_not_made_recomputes_and_leaves_nothing_held():
    """End to end: a decode whose first handshake with its producer comes
    past the bound (its host's, the bound in all reached) recomputes (never hangs); its blocks and records are
    freed, and the producer's lease ends (released, or at its expiry when
    the RELEASE, a stranger call too, was not made either)."""
    pair = Pair(FakeFabric())
    held, parked = Held(), Held()
    try:
        prompt = list(range(1, 30))
        params = pair.prefill({"a": prompt})
        pool = pair.D.worker.worker._pool
        for submit in (pool.submit, pool.submit_renewal):  # (a RENEW answered would make the producer known)
            for port in range(strangers(THREADS)):
                assert submit(held.call, ("held", port), to=(TARPIT_HOST, 9000 + port))
            # (changed: the producer's host holds as many as any, so its handshake is not called, not parked:
            # a flood on other hosts no longer refuses it, test_pool_many_hosts.py)
            hosts = [params["a"]["remote_host"]] + [f"10.7.0.{i}" for i in range(PARKED_MAX // PARKED_PER_HOST - 1)]
            for host in hosts:
                for port in range(PARKED_PER_HOST):
                    assert submit(parked.call, (host, port), to=(host, 7000 + port))
        wait_until(lambda: len(held.started) == 2 * strangers(THREADS), what="the strangers' places held")
        assert pool._calls.nparked == pool._renewals.nparked == PARKED_MAX
        results = pair.decode({"a": prompt}, params)
        assert results["a"].status.value == "finished" and results["a"].load_failed  # recomputed
        held.release.set()
        parked.release.set()
        wait_until(lambda: not (pool._calls.nparked or pool._calls.strangers or pool._renewals.nparked
                                or pool._renewals.strangers), what="the parked calls")
        pair.P.worker.worker.leases.expire(now=float("inf"))  # (if its RELEASE was not made)
        pair.settle()
    finally:
        held.release.set()
        parked.release.set()
        pair.close()


def test_a_stopped_engine_whose_ranks_answered_before_holds_half_the_threads_after_one_attempt():
    """Four ranks of a producer engine that answered before, then stopped
    (each port accepts and never answers): before, each rank's first call
    held a thread for all its attempts, and a call to a healthy producer
    waited for one of them. Now, once the first attempts time out, at most
    ``strangers(THREADS)`` go on; the others fail at once, saying why."""
    clients: dict[tuple[str, int], SideChannelClient] = {}

    def make(host: str, port: int) -> SideChannelClient:
        return clients.setdefault((host, port), SideChannelClient(host, port, connect_timeout_s=30.0,
                                                                  rpc_timeout_s=1.0, retries=30))

    pool = ClientPool(make, threads=THREADS)
    ranks = [Tarpit() for _ in range(THREADS)]
    healthy = SideChannelServer(Handler(), "127.0.0.1", 0)
    outcomes: dict[int, str] = {}
    lock = threading.Lock()

    def renew(port: int) -> None:
        try:
            pool.get("127.0.0.1", port).lease_call(wire.Renew(wire.PROTOCOL_VERSION, [lease(port)]))
            outcome = "answered"
        except PeerError as exc:
            outcome = str(exc)
        with lock:
            outcomes[port] = outcome

    try:
        for rank in ranks:
            pool.get("127.0.0.1", rank.port).answering = True  # each rank answered before it stopped
        for rank in ranks:
            assert pool.submit(renew, rank.port, to=("127.0.0.1", rank.port))
        wait_until(lambda: len(outcomes) == THREADS - strangers(THREADS), timeout_s=60,
                   what="the calls not tried again")
        assert all("not tried again" in why and "rpc_threads / 2" in why for why in outcomes.values()), outcomes
        done = threading.Event()
        pool.get("127.0.0.1", healthy.port).answering = True
        assert pool.submit(lambda: pool.get("127.0.0.1", healthy.port).lease_call(
            wire.Confirm(wire.PROTOCOL_VERSION, [lease(9)], release=True)) and done.set(),
            to=("127.0.0.1", healthy.port))
        assert done.wait(30), "a call to a healthy producer waited behind a stopped engine's ranks"
        assert len(outcomes) == THREADS - strangers(THREADS)  # the two in strangers' places go on
        assert all(not c.answering for (h, p), c in clients.items() if p != healthy.port)
    finally:
        for rank in ranks:
            rank.close()
        pool.close()
        healthy.close()


def test_a_refused_connection_to_a_producer_that_answered_makes_it_a_stranger():
    """A producer that answered, then died (its port refuses): the client is
    no longer ``answering`` (the pool caps the next calls to it); before,
    only a timeout did that, so every rank of a dead engine stayed uncapped."""
    server = SideChannelServer(Handler(), "127.0.0.1", 0)
    client = SideChannelClient("127.0.0.1", server.port, connect_timeout_s=5.0, rpc_timeout_s=5.0, retries=1)
    try:
        assert client.lease_call(wire.Renew(wire.PROTOCOL_VERSION, [lease(0)])) and client.answering
        server.close()
        client.close()  # drop the kept connection: the next call connects, and is refused
        client = SideChannelClient("127.0.0.1", server.port, connect_timeout_s=5.0, rpc_timeout_s=5.0, retries=1)
        client.answering = True
        with pytest.raises(PeerError):
            client.lease_call(wire.Renew(wire.PROTOCOL_VERSION, [lease(0)]))
        assert not client.answering
    finally:
        client.close()
        server.close()


def test_a_kept_connection_the_producer_closed_is_opened_again_without_asking_for_a_strangers_place():
    """A producer closes a connection idle for ``idle_timeout_s``: the next
    call finds it closed and opens another. That is no failure of the
    producer: it is not asked to take a stranger's place (which, with none
    free, would fail a call to a healthy producer)."""
    server = SideChannelServer(Handler(), "127.0.0.1", 0, idle_timeout_s=0.2)
    client = SideChannelClient("127.0.0.1", server.port, connect_timeout_s=5.0, rpc_timeout_s=5.0, retries=2)
    asked: list[int] = []

    def no_place() -> str:
        asked.append(1)
        return "no stranger's place free (test)"

    try:
        assert client.lease_call(wire.Renew(wire.PROTOCOL_VERSION, [lease(0)])) and client.answering
        sock = client._first.sock
        assert sock is not None
        sock.settimeout(30)
        assert sock.recv(1, socket.MSG_PEEK) == b""  # the producer closed it, idle
        with guarded(CallGuard(("127.0.0.1", server.port), stopped_answering=no_place)):
            assert client.lease_call(wire.Renew(wire.PROTOCOL_VERSION, [lease(0)]))
        assert client.answering and not asked
    finally:
        client.close()
        server.close()
