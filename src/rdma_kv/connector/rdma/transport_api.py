"""What the RDMA connector needs from a transport, as a ``typing.Protocol``.

Owns :class:`Transport` and :class:`TransferHandle`: the exact surface the
worker uses. ``rdma_kv.transport.Agent`` satisfies them structurally (the
tests check it), and the unit tests' fake transport implements them in one
process with ``memmove``. Nothing here imports UCX.

Also the connector's one door to the transport package at import time:
it re-exports :class:`DescList` (plain numpy; the slot tables in
``slots`` are built from it) and :class:`ChainedRead` (the held words'
read, chained behind a source's reads). ``tests/test_layering.py`` keeps every
other connector module off ``rdma_kv.transport`` (``connector.agent_transport``
builds the real ``Agent``, lazily).

Imports the standard library and ``rdma_kv.transport.descriptors``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rdma_kv.transport.descriptors import ChainedRead, DescList, PreparedList

__all__ = ["ChainedRead", "DescList", "PreparedList", "TransferHandle", "Transport", "TransportFactory"]


@runtime_checkable
class TransferHandle(Protocol):
    """One posted batch of reads."""

    @property
    def error(self) -> BaseException | None:
        """The failure once the transfer failed; None while running or after success."""
    @property
    def chained(self) -> bool | None:
        """With a chained read: True once it was posted (the reads landed), False if not; else None."""
    @property
    def abandoned(self) -> bool:
        """Failed before the transport completed it: its reads, a chained read's too, may still land."""
    @property
    def ops_posted(self) -> int: ...

    @property
    def num_descs(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def post_s(self) -> float: ...

    @property
    def started(self) -> float:
        """``time.perf_counter()`` at the post call."""

    @property
    def elapsed_s(self) -> float:
        """From ``started`` to completion (to now while running)."""

    def done(self) -> bool: ...

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until completion (done callbacks may run on this thread); raise
        the failure, or ``TimeoutError`` once ``timeout_s`` passed (it goes on)."""

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once on completion or failure (from any thread), or now."""


@runtime_checkable
class Transport(Protocol):
    """One process's transfer engine (``rdma_kv.transport.Agent``)."""

    def register(self, obj: Any, *, memory_type: str | None = None) -> Any:
        """Register an allocation: a tensor, array or ``(address, nbytes)``.
        ``memory_type`` ("host", "cuda") is what the allocation is; the
        transport refuses memory its UCX would map as another type."""

    def metadata(self) -> bytes:
        """What a peer passes to ``add_peer`` (after every ``register``)."""

    def add_peer(self, blob: bytes, *, name: str | None = None, paired: bool = False,
                 ordinal: int | None = None) -> str:
        """Import a peer's metadata under ``name`` (else the metadata's own);
        returns the name (replacing an older incarnation of that name).
        ``paired``: one endpoint, on the transport's own worker, that every
        transfer with the peer takes (what a peer's fence of this one needs);
        ``ordinal``: made the peer's ``ordinal(...)``-th to it, endpoints
        missing made and closed first (PeerError, nothing imported, when
        this transport made as many already)."""

    def ordinal(self, name: str) -> int:
        """The number of ``name``'s endpoint among those this transport's own
        worker made to that peer's worker (1 for the first)."""

    def remove_peer(self, name: str, *, fence: bool = False) -> bool:
        """Close the endpoints to ``name``; ``fence``: forced, so that no
        write of the peer's lands here after this returns True."""

    def prep_local(self, descs: DescList) -> PreparedList:
        """Check local descriptors once; reads then address them by index."""

    def prep_remote(self, peer: str, descs: DescList) -> PreparedList: ...

    def read_prepared(
        self,
        local: PreparedList,
        local_index: Any,
        remote: PreparedList,
        remote_index: Any,
        *,
        notify: bytes | None = None,
        timeout_s: float | None = None,
        then: ChainedRead | None = None,
    ) -> TransferHandle:
        """Read ``remote[remote_index]`` into ``local[local_index]``; descriptors
        contiguous on both sides are merged into one operation. Fails (never
        hangs) within ``timeout_s`` when the peer dies. ``then``: a read of
        the same peer posted once this one landed, which it includes."""

    def write_prepared(
        self,
        local: PreparedList,
        local_index: Any,
        remote: PreparedList,
        remote_index: Any,
        *,
        notify: bytes | None = None,
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Write ``local[local_index]`` into ``remote[remote_index]`` (push
        mode); with ``notify``, the peer receives it only after every write
        is remotely complete (the transport flushes first)."""

    def flush(self, peer: str, *, notify: bytes | None = None, timeout_s: float | None = None) -> TransferHandle:
        """Completes once every earlier operation to ``peer`` completed
        remotely; with ``notify``, the peer receives it only then."""

    def get_notifications(self) -> list[Any]:
        """Notifications received since the last call (``.payload``: bytes)."""

    def settle(self) -> None:
        """Settle, on the caller's thread, the transfers that have completed
        (their done callbacks run here); cheap when none did, nothing once closed."""

    def progress_report(self) -> str:
        """What the transport's progress threads are doing, for a log line
        (a load that waited out its bound says whether this side ran)."""

    def close(self) -> None: ...

    def wedged(self) -> bool:
        """After :meth:`close`: it had to leave its memory registered (a
        thread stuck in UCX), so a transfer could still write into it."""


TransportFactory = Callable[[str, Any], Transport]
"""``factory(agent_name, settings) -> Transport``."""
