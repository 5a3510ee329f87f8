"""Explicit transfers: ``read`` / ``write`` / ``flush`` of descriptor lists
that were not prepared.

The same one C call as a prepared request (``rk_submit``, through the
in-flight table's one submit path), on the peer's *explicit route*
(route.py: both sides' region tables, kept on the peer): the shim locates
every descriptor in its side's regions, checks that paired lengths match,
then posts as it does a prepared request -- merged, striped over the lanes
when large enough, spread over them when not. A flush is a request of no
descriptors with an endpoint flush on every worker. Anything the shim
refuses goes to the checked path, which raises the precise error (the
vectorised checks of ``RegionTable.locate``) or rebuilds the route.

``Posting`` reads the peer table and the registry, and submits under the
agent's lock.

May import: numpy, rdma_kv.errors and the transport's lower modules
(descriptors, inflight, prepared, route, transfer); never agent.py.
"""

from __future__ import annotations

import numpy as np

from rdma_kv.errors import ClosedError, DescriptorError, PeerError
from rdma_kv.transport._lib import load
from rdma_kv.transport.descriptors import DescList
from rdma_kv.transport.inflight import LIST, OP_FLUSH, SUBMIT_BAD_PAIR, SUBMIT_PEER_FAILED, SUBMIT_STALE
from rdma_kv.transport.prepared import RequestParts
from rdma_kv.transport.route import Route
from rdma_kv.transport.transfer import Transfer, XferOp

_EMPTY = DescList(np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64))


class Posting:
    """Explicit transfers of one agent."""

    def __init__(self, parts: RequestParts) -> None:
        self._from_buffer = load()[0].from_buffer
        self._name, self._lock, self._registry, self._peers = parts.name, parts.lock, parts.registry, parts.peers
        self._routes, self._inflight, self._usable = parts.routes, parts.inflight, parts.usable

    def transfer(self, op: XferOp, code: int, peer: str, local: DescList, remote: DescList,
                 notify: bytes | None, timeout_s: float | None) -> Transfer:
        """``remote``'s descriptors of ``peer`` to or from ``local``'s (FLUSH:
        none); ``code`` is ``op``'s OP_*."""
        if not isinstance(local, DescList) or not isinstance(remote, DescList):
            bad = local if not isinstance(local, DescList) else remote
            raise TypeError(f"read()/write() take DescList local and remote descriptors, got "
                            f"{type(bad).__name__}: make one with DescList(addrs, lengths)")
        n = len(local)
        if n != len(remote):
            raise DescriptorError(f"local and remote lists must pair up: {n} vs {len(remote)} descriptors")
        fb, lock, inflight = self._from_buffer, self._lock, self._inflight
        lock.acquire()
        try:
            p = self._peers.get(peer) if not inflight.closed else None
            route = p.list_route if p is not None else None
            for _ in range(2):  # a stale route is rebuilt once
                if route is None or route.builder is not self._routes:
                    route = self._route(peer)
                x = inflight.submit(route, op, code, n, fb(local.addrs), fb(remote.addrs), fb(local.lengths),
                                    fb(remote.lengths), LIST, notify, timeout_s)
                if isinstance(x, Transfer):
                    return x
                if x != SUBMIT_STALE:
                    self._refused(x, peer, local, remote)
                route = None
            raise AssertionError("rk_submit found a route built just now stale")
        finally:
            due = inflight.take_due()  # what the post settled: its callbacks run without the lock
            lock.release()
            if due:
                inflight.run_callbacks(due)

    def flush(self, peer: str, timeout_s: float | None, notify: bytes | None = None) -> Transfer:
        """A transfer that completes once every earlier operation to ``peer``
        has completed remotely, on every worker; with ``notify``, the peer
        receives it after that (a seal: push mode's layer-wise writes)."""
        return self.transfer(XferOp.FLUSH, OP_FLUSH, peer, _EMPTY, _EMPTY, notify, timeout_s)

    def _route(self, peer: str) -> Route:
        """A current explicit route to ``peer``, after the peer's checks."""
        if self._inflight.closed:
            raise ClosedError(f"agent {self._name!r} is closed")
        p = self._usable(peer)
        route = p.list_route = self._routes.explicit(p)
        return route

    def _refused(self, code: int, peer: str, local: DescList, remote: DescList) -> None:
        """Raise what the shim's refusal ``code`` means, precisely."""
        if code == SUBMIT_PEER_FAILED:
            self._usable(peer)  # raises, naming why
            raise PeerError(f"peer {peer!r} failed; re-import its metadata with add_peer() once it is back")
        if code == SUBMIT_BAD_PAIR:
            if not np.array_equal(local.lengths, remote.lengths):
                raise DescriptorError(f"local and remote lists must pair up: {len(local)} vs {len(remote)} "
                                      "descriptors; their lengths differ")
            self._registry.table.locate(local.addrs, local.lengths, "local descriptors")
            self._peers.get(peer).table.locate(remote.addrs, remote.lengths, f"remote descriptors for {peer!r}")
            raise DescriptorError(f"descriptor {self._inflight.bad_pair} of {len(local)} failed its check")
        raise AssertionError(f"rk_submit refused a route built just now (code {code})")
