"""The peer table of one agent: its peers' endpoints and remote keys on the
agent's own worker, and the agent metadata that creates them.

``export`` encodes this agent's metadata (name, UCX version, worker
address, regions with packed remote keys); ``decode`` checks a peer's.
``connect`` connects a peer, ``discard`` / ``pop`` take one out. A peer replaced or removed while transfers are still in
flight with it is *retired*: kept (failed, endpoint closed) until its last
transfer resolved, then its remote keys go. Every change to the set of
usable endpoints calls ``stale()`` (the agent's routes point at them).

The table does not fail transfers: failing a peer is the agent's (it also
closes the lanes' endpoints and settles the cancelled operations);
``mark_failed`` is the table's share of it. Not thread-safe on its own: the
agent calls it under its lock.

May import: rdma_kv.errors, rdma_kv.transport._lib, .metadata, .peer, .ucx.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from rdma_kv.errors import PeerError
from rdma_kv.transport import metadata as wire
from rdma_kv.transport._lib import status_name, ucx_version
from rdma_kv.transport.peer import Peer, pad_endpoints
from rdma_kv.transport.ucx import MAX_PAIRED_ENDPOINTS, Worker

# The agent's logger: operators filter the transport's lines by it.
log = logging.getLogger("rdma_kv.transport.agent")

# The most endpoints one import may make and close to catch up with the
# peer's count (PeerTable.pair): each is one of the peer's links this
# worker never imported (an introduction whose answer was lost).
MAX_PAD = 64


class PeerTable:
    """Peers of the agent ``name``, connected from ``worker``. ``ctx`` (the
    agent's ``rk_ctx_t *``) counts endpoint errors, which wakes its pump's
    owner; ``stale`` is called when an endpoint is added, failed or removed."""

    def __init__(self, name: str, worker: Worker, ctx: Any, stale: Callable[[], None], express: bool = False) -> None:
        self._name = name
        self._express = express  # each peer gets an express endpoint too (peer.py)
        self._worker = worker
        self._ctx = ctx
        self._stale = stale
        self._peers: dict[str, Peer] = {}
        self._retired: list[Peer] = []

    # ---------------------------------------------------------------- metadata

    def export(self, regions: list[wire.RegionInfo]) -> bytes:
        """This agent's metadata: what a peer passes to ``add_peer``."""
        return wire.encode(self._name, ucx_version(), self._worker.address, regions)

    def decode(self, blob: bytes, name: str | None = None) -> wire.AgentMetadata:
        """A peer's metadata, checked (MetadataError, PeerError), under
        ``name`` when given (the name the importer knows the peer by)."""
        md = wire.decode(blob)
        if md.name == self._name:
            raise PeerError(f"metadata names this agent itself ({self._name!r}); pass the peer's metadata")
        if name is None:
            return md
        if not name or name == self._name:
            raise PeerError(f"cannot import a peer as {name!r}: name it apart from this agent ({self._name!r})")
        return msgspec.structs.replace(md, name=name)

    # ------------------------------------------------------------------- peers

    def discard(self, name: str) -> Peer | None:
        """Take ``name`` out of the table if it is there (an earlier
        incarnation, about to be replaced): the caller fails it, then
        ``retire``s it, before it ``connect``s the new one -- UCX may hand
        the old endpoint's address to the new one."""
        peer = self._peers.pop(name, None)
        if peer is not None:
            self._stale()
        return peer

    def pair(self, md: wire.AgentMetadata, ordinal: int | None) -> int:
        """Before a ``paired`` import of ``md``: check that the endpoint it
        makes will be paired by UCX, and with ``ordinal`` make it that
        number among this worker's to ``md``'s worker (the one UCX pairs
        with the peer's ``ordinal``-th to this worker), making and
        force-closing the missing ones first, at most ``MAX_PAD`` per call
        (returns how many). PeerError, with nothing imported, when this
        worker made ``ordinal`` or more already (the peer's count is behind:
        a stale introduction), when more are missing than one call makes up
        (those it made count: introduce again), when UCX numbers no more
        endpoints between the two workers, or when a failed
        ``ucp_ep_create`` left the count unknown."""
        made = self._worker.endpoints_made(md.worker_address)
        if made < 0:
            raise PeerError(f"peer {md.name!r}: an endpoint to its worker failed to be made, and whether UCX "
                            "numbered it is not known, so no endpoint to it can be paired with the peer's; "
                            "restart either side (a new worker) to push between them again")
        target = made + 1 if ordinal is None else ordinal
        if target > MAX_PAIRED_ENDPOINTS:
            raise PeerError(f"peer {md.name!r}: this worker made {made} endpoints to its worker, and UCX pairs "
                            f"at most {MAX_PAIRED_ENDPOINTS} between two workers; restart either side (a new "
                            "worker) to push between them again")
        missing = target - 1 - made
        if missing < 0:
            raise PeerError(f"peer {md.name!r}: endpoint {ordinal} asked for, but this worker made {made} to it "
                            "already (an introduction older than the last one imported?); not imported")
        pad = min(missing, MAX_PAD)
        if pad:
            pad_endpoints(self._worker, md, pad)
            log.info("peer %s: %d endpoint(s) made and closed so that the next pairs with its endpoint %d",
                     md.name, pad, target)
        if pad < missing:
            raise PeerError(f"peer {md.name!r}: endpoint {ordinal} asked for, {missing} more than this worker "
                            f"had made to it; {pad} made up now, {missing - pad} left: introduce again; "
                            "not imported")
        return pad

    def connect(self, md: wire.AgentMetadata, generation: int, paired: bool = False) -> Peer:
        """Connect the peer ``md`` describes (its name must not be in the
        table); ``paired``: one endpoint, no express twin (``Agent.add_peer``)."""
        self._stale()
        peer = self._peers[md.name] = Peer(self._worker, md, generation, self._ctx,
                                           self._express and not paired, paired)
        return peer

    def pop(self, name: str) -> Peer:
        """Forget ``name`` (PeerError if unknown); the caller ``retire``s it."""
        peer = self.get(name)
        del self._peers[name]
        self._stale()
        return peer

    def retire(self, peer: Peer) -> None:
        """Close a peer no longer in the table: now, or once nothing is in
        flight with it (``close_idle_retired``)."""
        if peer.inflight == 0:
            peer.close(force=not peer.healthy)
        else:
            self._retired.append(peer)

    def close_idle_retired(self) -> None:
        if self._retired:
            for peer in [p for p in self._retired if p.inflight == 0]:
                self._retired.remove(peer)
                peer.close(force=True)

    def mark_failed(self, peer: Peer, reason: str) -> None:
        """Record why ``peer`` failed (the first reason stays) and force-close
        its endpoint, which makes UCX cancel its operations."""
        self._stale()
        if peer.failure is None:
            peer.failure = reason
            if peer.inflight:
                log.warning("peer %s failed with %d transfers in flight: %s", peer.name, peer.inflight, reason)
        if peer.ep is not None:
            peer.close(force=True)

    def failed_endpoints(self) -> list[Peer]:
        """Peers (retired ones too) whose endpoint UCX reported failed and
        which are not closed yet."""
        return [p for p in self.everyone() if p.ep is not None and p.ep_state.failed]

    def with_inflight(self) -> list[Peer]:
        return [p for p in self._peers.values() if p.inflight]

    def everyone(self) -> Iterator[Peer]:
        """Current and retired peers."""
        yield from list(self._peers.values())
        yield from list(self._retired)

    # ----------------------------------------------------------------- lookups

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, name: object) -> bool:
        return name in self._peers

    def __getitem__(self, name: str) -> Peer:
        return self._peers[name]

    def get(self, name: str) -> Peer:
        """The peer ``name``, or PeerError saying how to add it."""
        peer = self._peers.get(name)
        if peer is None:
            known = ", ".join(sorted(self._peers)) or "none"
            raise PeerError(f"unknown peer {name!r} (known peers: {known}); import its metadata with add_peer()")
        return peer

    def usable(self, name: str) -> Peer:
        """The peer ``name`` if its endpoint is healthy, else PeerError."""
        peer = self.get(name)
        if not peer.healthy:
            raise PeerError(
                f"peer {name!r} failed ({peer.failure or status_name(peer.ep_state.status)}); "
                "re-import its metadata with add_peer() once it is back"
            )
        return peer

    def close(self) -> None:
        """Close every endpoint (gracefully where healthy) and forget them."""
        for peer in self.everyone():
            peer.close(force=not peer.healthy)
        self._peers.clear()
        self._retired.clear()
