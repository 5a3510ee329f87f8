"""The consumer's peers: side-channel clients, handshakes, failed peers.

Owns :class:`PeerHandshakes`, the part of :class:`~rdma_kv.connector.rdma.worker.RdmaWorker`
that turns a producer address into a ready peer (HANDSHAKE over the side
channel, the producer's agent metadata imported, its slot table prepared)
and forgets it when it fails. Methods run on RPC threads (``_handshake``)
or with the worker's lock held where they say so; ``RdmaWorker`` inherits
them and owns every attribute declared below.

Imports the standard library and the connector's ``rdma.*`` modules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.clients import ClientPool
from rdma_kv.connector.rdma.loads import PEER_RETRY_S
from rdma_kv.connector.rdma.loads import LoadState as _Load
from rdma_kv.connector.rdma.loads import PeerState as _Peer
from rdma_kv.connector.rdma.meta import PeerAddress
from rdma_kv.connector.rdma.planning import SlotTable
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sidechannel import SideChannelClient
from rdma_kv.connector.rdma.stats import LoadStats
from rdma_kv.connector.rdma.transport_api import Transport
from rdma_kv.connector.types import EngineId
from rdma_kv.errors import HandshakeError

__all__ = ["PeerHandshakes"]

logger = logging.getLogger("rdma_kv.connector.rdma.worker")  # the worker's lines, one name for operators


class PeerHandshakes:
    _settings: RdmaSettings
    _secret: auth.Secret | None
    _lock: threading.RLock
    _clock: Callable[[], float]
    _engine_id: EngineId
    _transport: Transport | None
    _clients: ClientPool
    _peers: dict[tuple[str, str, int], _Peer]
    _loads: dict[Any, _Load]
    _stats: LoadStats

    def _require_compat(self) -> wire.CompatInfo: ...
    def _fail(self, load: _Load, reason: str, *, release: bool = True) -> None: ...
    def _post(self, load: _Load, peer: _Peer) -> None: ...

    def _client_key(self, address: PeerAddress) -> tuple[str, int]:
        """The side channel of this rank at ``address``: host, base port + rank."""
        return address.host, address.port + self._settings.tp_rank

    def _peer_key(self, address: PeerAddress) -> tuple[str, str, int]:
        return (address.engine_id, *self._client_key(address))

    def _client(self, address: PeerAddress) -> SideChannelClient:
        return self._clients.get(*self._client_key(address))

    def _make_client(self, host: str, port: int) -> SideChannelClient:
        s = self._settings
        return SideChannelClient(host, port, connect_timeout_s=s.connect_timeout_s,
                                 rpc_timeout_s=s.rpc_timeout_s, retries=s.rpc_retries, secret=self._secret)

    def _handshake(self, peer: _Peer) -> None:
        address, t0 = peer.address, time.perf_counter()
        name = None
        try:
            compat = self._require_compat()
            client = self._client(address)
            reply = client.handshake(wire.Handshake(
                wire.PROTOCOL_VERSION, self._engine_id, self._settings.tp_rank, compat))
            if reply.engine_id != address.engine_id:
                raise HandshakeError(
                    f"expected producer engine {address.engine_id!r} at {client.address}, found "
                    f"{reply.engine_id!r}; the request's kv_transfer_params point at another engine")
            if reply.compat != compat:
                diff = "; ".join(compat.mismatches(reply.compat, mine="consumer", theirs="producer"))
                raise HandshakeError(f"producer {reply.engine_id!r} has an incompatible KV cache: {diff}")
            slots = SlotTable(reply.geometry.to_geometry())
            assert self._transport is not None
            name = self._transport.add_peer(reply.agent_metadata)
            prep = self._transport.prep_remote(name, slots.descs)
        except Exception as exc:
            if name is not None:
                self._safe_remove_peer(name)
            host, port = self._client_key(address)
            reason = f"handshake with {host}:{port} failed: {exc}"
            logger.warning("producer %r: %s", address.engine_id, reason)
            with self._lock:
                peer.state, peer.error, peer.failed_at = "failed", reason, self._clock()
                waiting, peer.waiting = peer.waiting, []
                for load in waiting:
                    self._fail(load, reason)
            return
        with self._lock:
            peer.state, peer.name, peer.slots, peer.prep = "ready", name, slots, prep
            peer.handshake_s = time.perf_counter() - t0
            waiting, peer.waiting = peer.waiting, []
            self._stats.counters["handshakes"] += 1
        for load in waiting:
            load.stats["handshake_s"] = peer.handshake_s
            self._post(load, peer)

    def _safe_remove_peer(self, name: str) -> None:
        try:
            assert self._transport is not None
            self._transport.remove_peer(name)
        except Exception:
            pass

    def _peer_failed(self, peer: _Peer, reason: str) -> None:
        """Forget a peer whose reads failed: the next load re-handshakes (a
        restarted producer has a new agent). Called without the lock held."""
        with self._lock:
            key = self._peer_key(peer.address)
            if self._peers.get(key) is peer and peer.state == "ready":
                peer.state, peer.error, peer.failed_at = "failed", reason, self._clock()
            else:
                return
        if peer.name is not None:
            self._safe_remove_peer(peer.name)

    def _addresses_in_use(self) -> set[tuple[str, int]]:
        with self._lock:
            return ({self._client_key(p.address) for p in self._peers.values()}
                    | {self._client_key(ld.spec.peer) for ld in self._loads.values()})

    def _prune_failed_peers(self, now: float) -> None:
        """Forget peers that failed more than ``PEER_RETRY_S`` ago (a new load
        re-handshakes anyway), so producers that come and go (new engine
        ids on restart) do not accumulate. Called with the lock held."""
        for key, peer in list(self._peers.items()):
            if peer.state == "failed" and not peer.waiting and now - peer.failed_at > PEER_RETRY_S:
                del self._peers[key]
