"""Transfer handles: one posted batch of READ or WRITE operations.

The handle owns the C batch record that UCX completion callbacks write into;
the agent's completions (progress.py) keep it alive until UCX is done with
it, whatever the caller does. State moves IN_PROGRESS -> DONE | FAILED
exactly once, under the agent's lock, by the completions; waiters are woken
through a ``threading.Event`` and asyncio futures through
``call_soon_threadsafe``. A handle reaches its completions only through
``Completer``.

May import: rdma_kv.errors.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

from rdma_kv.errors import TransferError, TransferTimeoutError


class Completer(Protocol):
    """What a ``Transfer`` needs of the completions that resolve it."""

    @property
    def manual_progress(self) -> bool:
        """True when nothing but the caller progresses (polling mode)."""
        ...

    def poll(self) -> None:
        """Progress once unless a service thread does."""

    def progress_once(self, block_s: float | None) -> None:
        """Polling mode: progress, or sleep briefly (at most ``block_s``) when idle."""

    def completion_event(self, xfer: Transfer) -> threading.Event:
        """The event set when ``xfer`` resolves (set already if it has)."""
        ...

    def add_done_callback(self, xfer: Transfer, fn: Callable[[Transfer], None]) -> bool:
        """Queue ``fn`` for ``xfer``'s resolution; False if it has resolved already."""
        ...


class XferOp(enum.Enum):
    READ = "read"
    WRITE = "write"
    FLUSH = "flush"


class XferState(enum.Enum):
    IN_PROGRESS = "in-progress"
    DONE = "done"
    FAILED = "failed"


class Transfer:
    """A batch in flight. Poll ``state`` / ``done()``, block on ``wait()``, or
    ``await`` it. After failure ``error`` holds the exception ``wait`` raises."""

    # Defaults as class attributes: a transfer is made per request on the
    # engine's hot path (often with caches cold), so __init__ stores only
    # what differs per transfer.
    ops_posted = 0
    post_s = 0.0
    finished: float | None = None
    error: TransferError | None = None
    _event: threading.Event | None = None  # made by the first blocking wait()
    _peer_ref: Any = None  # the Peer incarnation it was posted to
    _expired = False
    _keepalive: tuple[Any, ...] = ()  # buffers UCX may still read (notification)
    # Operations posted on each worker (own first, then lanes) when striped
    # over lanes (lanes.py), else None.
    worker_ops: tuple[int, ...] | None = None

    def __init__(
        self,
        completions: Completer,
        xfer_id: int,
        op: XferOp,
        peer: str,
        batch: Any,
        keepalive: tuple[Any, ...],
        nbytes: int,
        num_descs: int,
        deadline: float | None,
    ) -> None:
        self._completions = completions
        self.id = xfer_id
        self.op = op
        self.peer = peer
        self._batch = batch
        if keepalive:
            self._keepalive = keepalive
        self.nbytes = nbytes
        self.num_descs = num_descs
        self.started = time.perf_counter()
        self.deadline = deadline
        self.state = XferState.IN_PROGRESS
        self._callbacks: list[Callable[[Transfer], None]] = []

    # -- completion (called by the completions, under the agent's lock) -----

    def _resolve(self, error: TransferError | None) -> list[Callable[[Transfer], None]]:
        if self.state is not XferState.IN_PROGRESS:
            return []
        self.finished = time.perf_counter()
        self.error = error
        self.state = XferState.FAILED if error else XferState.DONE
        self._batch = None
        self._keepalive = ()
        self._peer_ref = None
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks, []
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
        if self.state is XferState.IN_PROGRESS:
            self._completions.poll()
        return self.state is not XferState.IN_PROGRESS

    def wait(self, timeout_s: float | None = None) -> Transfer:
        """Block until completion; raise ``error`` on failure and
        ``TransferTimeoutError`` if ``timeout_s`` passes first (the transfer
        itself goes on; its own deadline still applies)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.state is XferState.IN_PROGRESS:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise TransferTimeoutError(
                    f"{self.op.value} transfer {self.id} with {self.peer!r} not complete "
                    f"after waiting {timeout_s} s ({self.num_descs} descriptors, "
                    f"{self.nbytes} bytes)"
                )
            if self._completions.manual_progress:
                self._completions.progress_once(left)
            else:
                self._completions.completion_event(self).wait(left if left is None else min(left, 1.0))
        if self.error is not None:
            raise self.error
        return self

    def add_done_callback(self, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(self)`` on completion (from the progress thread), or now."""
        if not self._completions.add_done_callback(self, fn):
            fn(self)

    def __await__(self) -> Generator[Any, None, Transfer]:
        loop = asyncio.get_running_loop()
        if self._completions.manual_progress:
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
