"""The consumer's calls to producer addresses not answering ("strangers",
``consumer.clients``) under a flood on more hosts than ``PARKED_MAX`` /
``PARKED_PER_HOST`` (4): a client of the decode server naming fresh ports
of five or more hosts that accept and never answer (``kv_transfer_params``
remote_host / remote_port) filled ``PARKED_MAX``, and from then on the
first call to every new producer was "not called" at once: its loads
recomputed for as long as the flood lasted (a denial of remote prefill
for every new producer; docs/reliability.md named it as left).

Now, at the bound, a call whose host holds fewer parked calls than the
host holding the most sheds that host's oldest parked call (which fails at
once, saying why), and the next parked call to start is taken from the
host holding the fewest: a new producer's first call is made when the
next stranger's place frees. Asserted on order and outcomes, not time."""

from __future__ import annotations

import socket
import threading

import pytest
from rdma_testutil import wait_until
from test_connector_fake import Pair
from test_pool_isolation import Handler, lease
from test_pool_strangers import THREADS, Held

from fakes import FakeFabric
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import PARKED_MAX, PARKED_PER_HOST, ClientPool, strangers
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.errors import PeerError

pytestmark = pytest.mark.timeout(120)

STALL_S = 60.0
"""Every timeout of the calls to the flood's ports: they outlive the test."""
FLOOD_HOSTS = [f"127.0.0.{i}" for i in range(2, 2 + PARKED_MAX // PARKED_PER_HOST + 2)]
"""Loopback hosts (any 127.x is this machine) with ports that accept and never answer: two more than fill the bound."""


class Tarpits:
    """``per_host`` listening ports on each of ``hosts`` that accept (the
    kernel completes the connect) and never answer."""

    def __init__(self, hosts: list[str], per_host: int) -> None:
        self.socks: dict[tuple[str, int], socket.socket] = {}
        for host in hosts:
            for _ in range(per_host):
                sock = socket.create_server((host, 0), backlog=8)
                self.socks[host, sock.getsockname()[1]] = sock

    def close(self, address: tuple[str, int] | None = None) -> None:
        """Close one (the connects it held are reset: the calls blocked on it end), or all."""
        for key in [address] if address else list(self.socks):
            self.socks.pop(key).close()


def test_a_new_producers_first_call_is_made_during_a_flood_on_more_hosts_than_the_bound():
    """Before: the healthy producer's first call failed at once ("not
    called: 64 calls to producer addresses that have not answered wait ...")
    while the flood's calls to six hosts' fresh ports filled the bound."""
    pool = ClientPool(lambda h, p: SideChannelClient(h, p, connect_timeout_s=STALL_S, rpc_timeout_s=STALL_S,
                                                     retries=1), threads=THREADS)
    tarpits = Tarpits(FLOOD_HOSTS, PARKED_PER_HOST)
    healthy = SideChannelServer(Handler(), "127.0.0.1", 0)
    started: list[tuple[str, int]] = []
    failed: dict[tuple[str, int], str] = {}
    lock = threading.Lock()
    done = threading.Event()

    def release(host: str, port: int) -> None:  # a load's call to the producer it names
        with lock:
            started.append((host, port))
        try:
            pool.get(host, port).lease_call(wire.Release(wire.PROTOCOL_VERSION, [lease(1)]))
        except PeerError as exc:
            with lock:
                failed[host, port] = str(exc)
        if port == healthy.port:
            done.set()

    try:
        flood = list(tarpits.socks)  # host by host: the first two ports of the first host take the places
        for address in flood:
            assert pool.submit(release, *address, to=address)
        assert pool._calls.nparked == PARKED_MAX  # the rest of the flood fails at once, each on a thread
        wait_until(lambda: len(failed) == len(flood) - strangers(THREADS) - PARKED_MAX, what="the calls not made")
        wait_until(lambda: len(started) - len(failed) == strangers(THREADS), what="the strangers' places held")
        assert pool.submit(release, "127.0.0.1", healthy.port, to=("127.0.0.1", healthy.port))  # a new producer
        assert pool._calls.nparked == PARKED_MAX  # bounded all the same
        wait_until(lambda: len(failed) == len(flood) + 1 - strangers(THREADS) - PARKED_MAX, what="one more")
        assert ("127.0.0.1", healthy.port) not in failed, failed[("127.0.0.1", healthy.port)]
        assert all("not called" in why for why in failed.values())
        assert all(len(pool._calls.parked[host]) < PARKED_PER_HOST for host in FLOOD_HOSTS)  # shed from the most
        first_after = len(started)
        tarpits.close(flood[0])  # one stranger's attempt ends: its place frees
        assert done.wait(30), "a new producer's first call was not made when a stranger's place freed"
        assert ("127.0.0.1", healthy.port) not in failed, failed[("127.0.0.1", healthy.port)]
        assert started[first_after] == ("127.0.0.1", healthy.port)  # the first call to start in the place
    finally:
        tarpits.close()
        pool.close()
        healthy.close()


def test_a_new_producers_first_load_is_read_during_a_flood_on_more_hosts_than_the_bound():
    """End to end: the decode's first load from a producer, while calls to
    six other hosts' strangers fill the bound on both sets of threads.
    Before: its handshake was not called and the load recomputed."""
    pair = Pair(FakeFabric())
    held = Held()
    not_made: list[str] = []

    def flood(host: str, port: int) -> None:  # a call to a port with nothing behind it (refused, once made)
        try:
            pool.get(host, port).lease_call(wire.Release(wire.PROTOCOL_VERSION, [lease(1)]))
        except PeerError as exc:
            if "not called" in str(exc):
                not_made.append(host)

    try:
        prompt = list(range(1, 30))
        params = pair.prefill({"a": prompt})
        assert params["a"]["remote_host"] not in FLOOD_HOSTS
        pool = pair.D.worker.worker._pool
        for submit in (pool.submit, pool.submit_renewal):
            for port in range(strangers(THREADS)):
                assert submit(held.call, ("held", port), to=(FLOOD_HOSTS[0], 9000 + port))
            for host in FLOOD_HOSTS:
                for port in range(PARKED_PER_HOST):
                    assert submit(flood, host, 7000 + port, to=(host, 7000 + port))
        wait_until(lambda: len(held.started) == 2 * strangers(THREADS), what="the strangers' places held")
        assert pool._calls.nparked == pool._renewals.nparked == PARKED_MAX
        pair.decode({"a": prompt}, params, wait=False)
        producer = params["a"]["remote_host"]
        results = pair.D.results

        def ended() -> bool:
            return results["a"].status.value in ("finished", "failed", "aborted")

        wait_until(lambda: producer in pool._calls.parked or ended(), step=pair.pump,
                   what="the handshake parked, or the request ended")
        assert not ended(), f"the new producer's first load was not made: load_failed={results['a'].load_failed}"
        held.release.set()  # the strangers' places free: the producer's calls go first
        wait_until(ended, step=pair.pump, timeout_s=60, what="the decode")
        assert not results["a"].load_failed and results["a"].external_tokens
        assert not_made and set(not_made) <= set(FLOOD_HOSTS)  # the flood's calls past the bound, at once
        wait_until(lambda: not (pool._calls.nparked or pool._calls.strangers or pool._renewals.nparked
                                or pool._renewals.strangers), timeout_s=60, what="the parked calls")
        pair.settle()
    finally:
        held.release.set()
        pair.close()
