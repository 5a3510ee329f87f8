"""The RDMA connector's scheduler, consumer side: its record of a request
with remote-prefill params (``Remote``) from admission until it finishes,
its stage (``RemoteStage``), the push-mode decode whose prefill runs at
the same time (``Concurrent``: no lease, a router's transfer id), and which
request took each load's params (``LoadOwners``: vLLM's children of a
request with ``n > 1`` all carry its params). Producer side, the lease the
first finished child of such a request was granted, which its siblings
hand over too (``SiblingGrants``).

Imports the standard library and the connector's ``types``, ``rdma.meta``,
``rdma.params`` and ``rdma.wire``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
import secrets
from collections.abc import Callable, Hashable

from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.params import LeaseRef, RemotePrefillParams
from rdma_kv.connector.rdma.wire import CLAIM_BYTES
from rdma_kv.connector.types import RequestId

__all__ = ["Concurrent", "LoadOwners", "Remote", "RemoteStage", "SiblingGrants"]

FINISHED_CHILDREN_KEPT = 4096
"""Loads of finished child requests remembered for their siblings (``LoadOwners``)."""
SIBLING_GRANTS_KEPT = 4096
"""Leases of first finished children remembered for their siblings (``SiblingGrants``)."""
_CHILD_ID = re.compile(r"[0-9]+_(.+)", re.DOTALL)
"""vLLM's id of a child of a request with ``n > 1``: ``<index>_<parent id>``."""


class RemoteStage(enum.Enum):
    """Where a consumer request with remote-prefill params is:
    WAITING -> PENDING -> SHIPPED -> LOADED, or RELEASED from WAITING or PENDING."""

    WAITING = "waiting"  # waits for admission (its lease renewed by the workers)
    PENDING = "pending"  # blocks allocated, its load queued for the next step's metadata
    SHIPPED = "shipped"  # its load handed to the workers
    LOADED = "loaded"  # the workers reported it in done_recving
    RELEASED = "released"  # nothing to load (full hit, bad params, abort): its lease released


@dataclasses.dataclass
class Concurrent:
    """Push mode, concurrent dispatch: a decode whose prefill runs at the
    same time (no lease: the producer pushes under ``transfer_id``)."""

    transfer_id: str
    peer: PeerAddress


@dataclasses.dataclass
class Remote:
    """A consumer request with remote-prefill params, until it finishes."""

    params: RemotePrefillParams | Concurrent
    num_computed: int = 0
    count: int = 0
    stage: RemoteStage = RemoteStage.WAITING
    claim: bytes = dataclasses.field(default_factory=lambda: secrets.token_bytes(CLAIM_BYTES), repr=False)
    """This request's claim on the producer's lease: the same in every lease
    call made for it, so the producer can tell this request from another
    load of the same params (``leases``)."""
    renewed_at: float | None = None
    """When its lease was last renewed while waiting (None: not yet; the first
    renewal, which also claims the lease, goes out with the next step)."""

    @property
    def concurrent(self) -> Concurrent | None:
        return self.params if isinstance(self.params, Concurrent) else None

    @property
    def lease(self) -> RemoteLease | None:
        """The lease to renew or release; None for a concurrent push (none exists)."""
        if isinstance(self.params, Concurrent):
            return None
        return RemoteLease(PeerAddress.of(self.params), self.params.lease, self.claim)


LoadKey = tuple[PeerAddress, LeaseRef | str]
"""What one load's params name: the producer and the lease (pull), or the
producer and the ``transfer_id`` it pushes under (push, concurrent
dispatch). Requests whose params name the same load share one."""


def load_key(params: RemotePrefillParams | Concurrent) -> LoadKey:
    if isinstance(params, Concurrent):
        return params.peer, params.transfer_id
    return PeerAddress.of(params), params.lease


def parent_id(rid: str) -> str | None:
    match = _CHILD_ID.fullmatch(rid)
    return match.group(1) if match else None


class LoadOwners:
    """Which request took each load's params first. vLLM gives every child
    of a request with ``n > 1`` the parent's ``kv_transfer_params``: one
    lease (or push ``transfer_id``), several requests; only the first can
    load under it (the producer refuses another claim, CLAIMED, or another
    registration, REFUSED). The others wait while it loads and are then
    computed locally (``RdmaScheduler.get_num_new_matched_tokens``).

    A finished child's load is remembered with its parent id (the last
    ``FINISHED_CHILDREN_KEPT``): vLLM may ask about a sibling only after it
    finished (``max_num_seqs``), when the lease is already released."""

    def __init__(self) -> None:
        self._owners: dict[LoadKey, RequestId] = {}
        self._finished: collections.OrderedDict[LoadKey, str] = collections.OrderedDict()

    def owner(self, key: LoadKey) -> RequestId | None:
        return self._owners.get(key)

    def take(self, key: LoadKey, rid: RequestId) -> None:
        self._owners[key] = rid

    def sibling_finished(self, key: LoadKey, rid: str) -> bool:
        """Whether a sibling of child ``rid`` took this load and finished."""
        parent = parent_id(rid)
        return parent is not None and self._finished.get(key) == parent

    def taken(self, key: LoadKey, rid: str) -> bool:
        """Whether the load is another request's here (live, or a finished sibling's)."""
        return key in self._owners or self.sibling_finished(key, rid)

    def finished(self, key: LoadKey, rid: RequestId) -> None:
        """``rid`` finished: if it owned the load, it is nobody's now (a
        child's is remembered for its siblings)."""
        if self._owners.get(key) != rid:
            return
        del self._owners[key]
        parent = parent_id(rid)
        if parent is not None:
            self._finished[key] = parent
            if len(self._finished) > FINISHED_CHILDREN_KEPT:
                self._finished.popitem(last=False)


SiblingKey = tuple[str, int, bytes, tuple[Hashable, ...]]
"""A parent request id, its prompt's token count and digest, and the
request's ``extra_keys`` (what else decides its KV)."""


class SiblingGrants:
    """Producer side: the lease granted to the first finished child of each
    request with ``n > 1``. vLLM prefills every child (the same prompt, the
    same LoRA, salt and media: the same KV) and hands a client one child's
    ``kv_transfer_params`` only, the last to finish's; a lease granted to
    each child pinned the others' blocks, which their prefix-cache shares
    with the handed-over one, for ``lease_ttl_s`` after the decode had read
    and released its own. A later sibling hands over the first child's
    params instead, and its blocks are freed at once: whichever child's
    params reach the client, they name one lease.

    Keyed by the parent id (vLLM's child ids are ``<index>_<parent id>``, the
    parent's with its random suffix), the prompt's length and digest and
    the request's ``extra_keys``: a request whose id only looks like a
    sibling's (an engine that does not randomize ids) gets the lease only
    for the very same KV. Live while its child's lease is held (``live``:
    that lease, its generation, not whatever lease the child's id holds
    now; an engine that reuses ids grants one id several). Forgotten when
    that lease ends (``ended``): the params hold every block id of the
    prompt, and the siblings that may still come find no lease in it."""

    def __init__(self) -> None:
        self._grants: collections.OrderedDict[SiblingKey, tuple[RequestId, RemotePrefillParams]] = (
            collections.OrderedDict())
        self._keys: dict[RequestId, SiblingKey] = {}
        """The key of each child's grant, for ``ended``."""

    def __len__(self) -> int:
        return len(self._grants)

    @staticmethod
    def key(rid: str, num_tokens: int, digest: bytes, extra_keys: tuple[Hashable, ...]) -> SiblingKey | None:
        """The key of child ``rid`` (None for a request that is no child)."""
        parent = parent_id(rid)
        return None if parent is None else (parent, num_tokens, digest, extra_keys)

    def of(self, key: SiblingKey, live: Callable[[RequestId, int], bool]) -> RemotePrefillParams | None:
        """The params of a sibling's lease still ``live(child id, lease generation)``
        (a lease that ended is forgotten)."""
        grant = self._grants.get(key)
        if grant is None:
            return None
        if not live(grant[0], grant[1].remote_lease_generation):
            self._forget(key)
            return None
        return grant[1]

    def granted(self, key: SiblingKey, rid: RequestId, params: RemotePrefillParams) -> None:
        self.ended(rid)  # (an earlier lease of a reused id: its own no more)
        self._forget(key)
        self._grants[key] = (rid, params)
        self._keys[rid] = key
        if len(self._grants) > SIBLING_GRANTS_KEPT:
            self._forget(next(iter(self._grants)))

    def ended(self, rid: RequestId) -> None:
        """The lease granted to child ``rid`` ended (read and released, expired, reclaimed)."""
        key = self._keys.pop(rid, None)
        if key is not None:
            grant = self._grants.get(key)
            if grant is not None and grant[0] == rid:
                del self._grants[key]

    def _forget(self, key: SiblingKey) -> None:
        grant = self._grants.pop(key, None)
        if grant is not None and self._keys.get(grant[0]) == key:
            del self._keys[grant[0]]
