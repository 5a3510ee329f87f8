"""A remote agent as seen locally: one endpoint, its unpacked remote keys and
the table of its regions used to check remote descriptors.

Endpoints use ``UCP_ERR_HANDLING_MODE_PEER``: when the peer dies UCX calls
the shim's error callback (which records the status in ``ep_state``) and
fails the outstanding operations, so nothing waits on a dead peer. The
agent then force-closes the endpoint. Teardown order: remote keys, then the
endpoint.

May import: rdma_kv.errors, rdma_kv.transport._lib, .memory, .metadata.
"""

from __future__ import annotations

import logging
from typing import Any

from rdma_kv.errors import PeerError
from rdma_kv.transport._lib import check_status, load
from rdma_kv.transport.memory import RegionTable
from rdma_kv.transport.metadata import AgentMetadata

# How long closing an endpoint progresses its worker for the close to
# complete: milliseconds with a live peer, which must read what the endpoint
# still has to send (a target's answers to its reads, for one). Bounded by
# time: a count of progress calls (200,000, about 0.3 s of spinning) ran out
# while a peer given no CPU on a loaded host read nothing, and the worker
# was then destroyed with that still queued, which UCX 1.22 purges unsafely
# (a leak or a segfault: docs/reliability.md, "Reviews of flaky tests").
CLOSE_WAIT_S = 2.0
# How long closing an endpoint waits for its outstanding flushes (Peer.close):
# microseconds unless the peer hangs (a dead one fails them at once).
CLOSE_FLUSH_WAIT_S = 0.5
_log = logging.getLogger(__name__)


class Peer:
    """``md``'s agent on one local ``worker``: an endpoint and its remote
    keys, and with ``express`` a second endpoint with keys of its own (the
    route's express endpoint: small requests, so that they do not queue
    behind a large one's operations on the first). Both report errors to
    the one ``ep_state`` and are closed together."""

    def __init__(self, worker: Any, md: AgentMetadata, generation: int, ctx: Any = None,
                 express: bool = False, paired: bool = False) -> None:
        ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        self._worker = worker
        self.name = md.name
        self.generation = generation
        self.paired = paired  # the agent's own worker only: no lane has an endpoint to it (Agent.add_peer)
        self.ordinal = 0  # its first endpoint's number among the worker's to the peer's worker (Worker.count_endpoint)
        self.worker_address = md.worker_address
        self.ucx_version = md.ucx_version
        self.failure: str | None = None
        self.paths: Any = None  # the peer on every worker, as C arrays (lanes.Paths), made with its first route
        self.list_route: Any = None  # the route of explicit descriptors to it (posting.py)
        self.ep_state = ffi.new("rk_ep_state_t *")
        if ctx is not None:  # the error callback counts ep_errors there (wakes a pump's owner)
            self.ep_state.ctx = ctx
        self._addr_buf = ffi.from_buffer(md.worker_address)
        self._eps: list[Any] = []  # (ucp_ep_h, ucp_rkey_h[], keys unpacked): the first, then the express one
        try:
            for _ in range(2 if express else 1):
                self._connect(md)
        except BaseException:
            self.close(force=True)
            raise
        self.ep: Any = self._eps[0][0]
        self.rkeys: Any = self._eps[0][1]
        self.xep: Any = self._eps[1][0] if express else ffi.NULL
        self.xrkeys: Any = self._eps[1][1] if express else ffi.NULL
        self.table = RegionTable([(r.base, r.nbytes) for r in md.regions], f"peer {md.name!r}")
        self.kinds = [r.kind for r in md.regions]

    def _connect(self, md: AgentMetadata) -> None:
        """One more endpoint to the peer, with its remote keys unpacked."""
        ffi, lib = self._ffi, self._lib
        params = ffi.new("ucp_ep_params_t *")
        params.field_mask = (
            lib.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | lib.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | lib.UCP_EP_PARAM_FIELD_ERR_HANDLER
        )
        params.address = ffi.cast("const ucp_address_t *", self._addr_buf)
        params.err_mode = lib.UCP_ERR_HANDLING_MODE_PEER
        params.err_handler.cb = lib.rk_ep_error_cb
        params.err_handler.arg = self.ep_state
        ep = ffi.new("ucp_ep_h *")
        status = lib.ucp_ep_create(self._worker.handle, params, ep)
        if status != lib.UCS_OK:
            self._worker.lose_count(md.worker_address)  # (it may have taken a sequence number)
        check_status(status, f"ucp_ep_create to {md.name!r}")
        entry = [ep[0], ffi.new("ucp_rkey_h[]", max(1, len(md.regions))), 0]
        self._eps.append(entry)
        n = self._worker.count_endpoint(md.worker_address)
        if len(self._eps) == 1:
            self.ordinal = n
        for i, region in enumerate(md.regions):
            status = lib.ucp_ep_rkey_unpack(entry[0], region.rkey, entry[1] + i)
            if status != lib.UCS_OK:
                raise PeerError(
                    f"cannot unpack remote key {i} of peer {md.name!r} "
                    f"({region.kind.value} region [{region.base:#x}, +{region.nbytes})): "
                    f"UCS status {status}; both sides must run compatible UCX builds "
                    f"(peer {md.ucx_version})"
                )
            entry[2] += 1

    @property
    def express(self) -> bool:
        """It has an express endpoint (open)."""
        return len(self._eps) == 2

    @property
    def inflight(self) -> int:
        """Transfers in flight with this peer (counted by the shim)."""
        return int(self.ep_state.inflight)

    @property
    def healthy(self) -> bool:
        return self.ep is not None and self.failure is None and not self.ep_state.failed

    def close(self, force: bool) -> None:
        """Tear down, bounded. Graceful (nothing in flight): remote keys, then
        a flushing close of the endpoint. Forced (operations may be in
        flight): the endpoint first, which cancels them, then the keys they
        referenced. The express endpoint likewise, after the first."""
        if self in self._worker.left_open:  # closed already; reap_left_open ends it
            return
        if self._eps:
            # No notification goes out from here (a lane's pump may complete
            # a transfer's last part after the close, and its notification
            # would be sent on a freed endpoint), nor is one being sent.
            self._lib.rk_ep_quiesce(self.ep_state)
        force = force or bool(self.ep_state.failed)
        if self._eps:
            # Nor is a flush of it outstanding: UCX (1.22) resumes a flush from
            # the worker's progress queue through a pointer to its endpoint,
            # which a forced close frees without removing it (a segfault in
            # ucp_ep_flush_progress on the next progress call). A flush
            # completes once the endpoint's operations do, or fail (a failed
            # peer's), so this waits microseconds unless the peer is hung.
            left = self._lib.rk_ep_wait_flushes(self._worker.handle, self.ep_state, int(CLOSE_FLUSH_WAIT_S * 1e9))
            if left > 0:  # a hung peer: closing would crash UCX later, leaving it open costs an endpoint
                _log.warning("peer %r: %d flush(es) of its endpoint still outstanding after %.1f s (the peer "
                             "hangs?); the endpoint is left open until they end (the peer answers, or UCX "
                             "gives it up and fails them), then closed", self.name, left, CLOSE_FLUSH_WAIT_S)
                self._worker.left_open.append(self)
                self.ep = None  # closed to the agent; its endpoints wait in _eps for reap_left_open
                return
        self._teardown(force)

    def _teardown(self, force: bool) -> None:
        for entry in self._eps:
            if force:
                self._close_ep(entry, force=True)
                self._destroy_rkeys(entry)
            else:
                self._destroy_rkeys(entry)
                self._close_ep(entry, force=False)
        self._eps.clear()
        self.ep = None

    def _destroy_rkeys(self, entry: list[Any]) -> None:
        for i in range(entry[2]):
            self._lib.ucp_rkey_destroy(entry[1][i])
        entry[2] = 0

    def _close_ep(self, entry: list[Any], force: bool) -> None:
        if entry[0] is None:
            return
        lib = self._lib
        param = self._ffi.new("ucp_request_param_t *")
        if force:
            param.op_attr_mask = lib.UCP_OP_ATTR_FIELD_FLAGS
            param.flags = lib.UCP_EP_CLOSE_FLAG_FORCE
        req = lib.ucp_ep_close_nbx(entry[0], param)
        if lib.rk_wait_request(self._worker.handle, req, int(CLOSE_WAIT_S * 1e9)) == lib.UCS_INPROGRESS:
            # UCX finishes the close later (or with the worker). What the
            # endpoint still has queued, Worker.close drains before the
            # destroy (bounded too): UCX 1.22 purges it unsafely (a target's
            # answers to a peer's reads: a leak or a crash).
            _log.warning("peer %r: closing its endpoint did not complete within %.1f s (the peer does not "
                         "read?)", self.name, CLOSE_WAIT_S)
        entry[0] = None


def pad_endpoints(worker: Any, md: AgentMetadata, count: int) -> None:
    """Make ``count`` endpoints to ``md``'s worker and force-close each: what
    brings ``worker``'s count of endpoints to it up to the peer's, so that the
    next one made pairs with the peer's of the same number (Agent.add_peer's
    ``ordinal``). One made where the peer's was closed pairs with that one's
    remains, or with none; closed at once, it carries nothing."""
    for _ in range(count):
        Peer(worker, md, 0).close(force=True)


def reap_left_open(worker: Any) -> int:
    """Close the endpoints a peer's close left open on ``worker`` (flushes of
    them were outstanding) whose flushes have all ended since: the peer
    answered, or UCX gave it up and failed them (its keepalive, an error
    the agent's look counts). Forced: what was in flight with a peer that
    hung is cancelled, and UCX hands back the transfers the agent failed
    (they stop counting against ``deregister``). Returns how many peers'
    endpoints it closed; the rest wait for a later call. Caller holds the
    agent's lock."""
    closed = 0
    for peer in list(worker.left_open):
        if int(peer.ep_state.flushing) == 0:
            worker.left_open.remove(peer)
            peer._teardown(force=True)
            _log.info("peer %r: the endpoint left open while flushes of it were outstanding is closed", peer.name)
            closed += 1
    return closed
