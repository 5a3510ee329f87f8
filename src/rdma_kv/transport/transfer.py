"""Transfer handles: one posted batch of READ, WRITE or FLUSH operations.

A ``Transfer`` is the Python half of one slot of the agent's slab of C
batch records (``rk_batch_t``, csrc/shim.h): the slot is where UCX's
completion callbacks count, the handle is what the caller holds. State
moves IN_PROGRESS -> DONE | FAILED exactly once, under the agent's lock,
through ``_settle``, which only the agent's in-flight table calls
(inflight.py). A handle reaches progress only through its ``Owner``.

May import: rdma_kv.errors.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

from rdma_kv.errors import TransferError, TransferTimeoutError

Callback = Callable[["Transfer"], None]


class Owner(Protocol):
    """What a ``Transfer`` needs of the agent's progress (progress.py)."""

    @property
    def manual_progress(self) -> bool:
        """True when nothing but the caller progresses (polling mode)."""
        ...

    def poll(self) -> None:
        """Progress once unless a service thread does."""

    def progress_once(self, block_s: float) -> None:
        """Polling mode: progress, or sleep briefly (at most ``block_s``) when idle."""

    def block(self, xfer: Transfer, block_s: float) -> None:
        """Pumped mode: return once ``xfer`` settled or ``block_s`` passed."""

    def add_done_callback(self, xfer: Transfer, fn: Callback) -> bool:
        """Queue ``fn`` for ``xfer``'s settlement; False if it has settled already."""
        ...


class XferOp(enum.Enum):
    READ = "read"
    WRITE = "write"
    FLUSH = "flush"


class XferState(enum.Enum):
    IN_PROGRESS = "in-progress"
    DONE = "done"
    FAILED = "failed"


_IN_PROGRESS, _DONE, _FAILED = XferState.IN_PROGRESS, XferState.DONE, XferState.FAILED

WAIT_SLICE_S = 1.0
"""``wait()`` returns to Python at least this often (and settles there), however long it waits."""


class Transfer:
    """A batch in flight. Poll ``state`` / ``done()``, block on ``wait()``, or
    ``await`` it. After failure ``error`` holds the exception ``wait`` raises.

    ``started``, ``finished`` and ``settled`` are ``time.perf_counter()``
    seconds, read by the shim at the call (``started``) and as the last
    operation completed (``finished``: it published the batch, from
    whichever thread progressed it), and by the agent as it settled the
    transfer (``settled``: what a caller could first see; a transfer failed
    by the agent, on a deadline or a peer's failure, has both at that
    moment). ``elapsed_s`` is the transfer's own time, ``finished -
    started``; ``settled - finished`` is how long the completion waited for
    a thread to settle it. ``post_s`` is the C post loop's
    time; ``worker_ops`` the operations on each worker (own first) of a
    transfer striped over lanes, else None, and ``worker`` the worker that
    carried a transfer whole, else None."""

    # Made per request on the engine's hot path, often with caches cold: the
    # constructor stores seven references (the shim's record of the post as
    # it came, ``_rec``), every other field is a class default until it
    # changes, and what is derived is computed when asked for.
    state = XferState.IN_PROGRESS
    finished: float | None = None
    settled: float | None = None
    error: TransferError | None = None
    worker_ops: tuple[int, ...] | None = None
    chained: bool | None = None
    """With a chained read (``read_prepared(then=...)``): True once it was
    posted, the transfer's own reads all completed (a failure is then the
    chained read's); False if they did not (failed, cancelled or timed
    out first). None without one."""
    abandoned = False
    """Failed before the shim completed it (its deadline passed and UCX did
    not cancel it when the peer's endpoint closed, or the agent closed):
    UCX may still write its local buffers, a chained read's included, until
    it hands the slot back. False for every transfer the shim completed,
    failed ones included: nothing of those lands later."""
    _callbacks: list[Callback] | None = None
    _expired = False
    _then: Any = None  # a chained read's C record, arrays and route: alive until UCX hands the slot back

    def __init__(self, owner: Owner, slot: int, op: XferOp, peer: Any, num_descs: int, rec: list[int],
                 notify: bytes | None) -> None:
        self._owner = owner
        self._slot = slot
        self.op = op
        self._peer = peer  # the Peer incarnation it was posted to
        self.num_descs = num_descs
        self._rec = rec  # rk_submit's out[0:9]: id, bytes, ops, workers, worker, t0, post start, post end, ring
        self._notify = notify  # UCX reads it when the batch completes

    @property
    def id(self) -> int:
        return self._rec[0]

    @property
    def peer(self) -> str:
        name: str = self._peer.name
        return name

    @property
    def nbytes(self) -> int:
        return self._rec[1]

    @property
    def ops_posted(self) -> int:
        return self._rec[2]

    @property
    def worker(self) -> int | None:
        return self._rec[4] if self._rec[3] == 1 else None

    @property
    def started(self) -> float:
        return self._rec[5] * 1e-9

    @property
    def post_s(self) -> float:
        return (self._rec[7] - self._rec[6]) * 1e-9

    # -- settlement (the in-flight table's, under the agent's lock) -------------

    def _settle(self, error: TransferError | None, finished: float, settled: float) -> list[Callback] | None:
        """Move to DONE or FAILED once; returns the callbacks to run."""
        self.finished = finished
        self.settled = settled
        self.error = error
        self.state = _FAILED if error is not None else _DONE
        self._notify = None
        self._then = None
        callbacks, self._callbacks = self._callbacks, None
        return callbacks

    # -- caller API -------------------------------------------------------------

    @property
    def elapsed_s(self) -> float:
        end = self.finished if self.finished is not None else time.perf_counter()
        return end - self.started

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes) from post to completion."""
        return self.nbytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    def done(self) -> bool:
        """True once the transfer has completed or failed (drives progress in
        polling mode)."""
        if self.state is _IN_PROGRESS:
            self._owner.poll()
        return self.state is not _IN_PROGRESS

    def wait(self, timeout_s: float | None = None) -> Transfer:
        """Block until completion; raise ``error`` on failure and
        ``TransferTimeoutError`` if ``timeout_s`` passes first (the transfer
        itself goes on; its own deadline still applies)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        owner = self._owner
        while self.state is _IN_PROGRESS:
            # Unbounded waits still return to Python every WAIT_SLICE_S: the
            # transfer's own deadline settles it, and Ctrl-C gets through.
            left = WAIT_SLICE_S if end is None else end - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(
                    f"{self.op.value} transfer {self.id} with {self.peer!r} not complete "
                    f"after waiting {timeout_s} s ({self.num_descs} descriptors, "
                    f"{self.nbytes} bytes)"
                )
            if owner.manual_progress:
                owner.progress_once(left)
            else:
                owner.block(self, min(left, WAIT_SLICE_S))
        if self.error is not None:
            raise self.error
        return self

    def add_done_callback(self, fn: Callback) -> None:
        """Call ``fn(self)`` on completion (from the progress thread), or now."""
        if not self._owner.add_done_callback(self, fn):
            fn(self)

    def __await__(self) -> Generator[Any, None, Transfer]:
        loop = asyncio.get_running_loop()
        if self._owner.manual_progress:
            while not self.done():
                yield from asyncio.sleep(0).__await__()
        else:
            fut: asyncio.Future[None] = loop.create_future()

            def settle() -> None:
                if not fut.done():  # the awaiting task may have been cancelled
                    fut.set_result(None)

            def wake(_: Transfer) -> None:
                loop.call_soon_threadsafe(settle)

            self.add_done_callback(wake)
            yield from fut.__await__()
        if self.error is not None:
            raise self.error
        return self

    def __repr__(self) -> str:
        return (
            f"Transfer(id={self.id}, {self.op.value}, peer={self.peer!r}, "
            f"state={self.state.value}, descs={self.num_descs}, ops={self.ops_posted})"
        )
