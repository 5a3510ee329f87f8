"""The consumer's side-channel clients, one per producer address, made on
first use and closed once idle, and the RPC threads that call them.

A client holds a socket to one producer rank. Producers come and go (a
restart with an OS-chosen port is a new address), so a client nobody
used for ``idle_s`` and that no peer or load refers to is closed and
forgotten; the next load that needs the address makes a new one.

Handshakes, confirmations and lease calls run on the pool's threads
(:meth:`ClientPool.submit`), never on the engine thread. Renewals have
threads of their own (:meth:`ClientPool.submit_renewal`): a RENEW queued
behind handshakes, confirmations or pushes stuck on a slow producer would
come late, and its lease lapse. The worker owns the pool: it outlives a
consumer put to sleep, so the calls that consumer queued (releases of the
loads the sleep failed) still go out.

Imports the standard library and the connector's ``sideclient``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from rdma_kv.connector.rdma.sideclient import SideChannelClient

__all__ = ["ClientPool"]

logger = logging.getLogger(__name__)

Address = tuple[str, int]


class ClientPool:
    def __init__(self, make: Callable[[str, int], SideChannelClient], idle_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, threads: int = 1,
                 thread_name: str = "rdma-kv-rpc") -> None:
        self._make, self._idle_s, self._clock = make, idle_s, clock
        self._lock = threading.Lock()
        self._clients: dict[Address, tuple[SideChannelClient, float]] = {}
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=thread_name)
        self._renewals = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"{thread_name}-renew")

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on an RPC thread; False (nothing runs) once closed."""
        return self._submit(self._executor, fn, args)

    def submit_renewal(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Like :meth:`submit`, on the threads only renewals use."""
        return self._submit(self._renewals, fn, args)

    @staticmethod
    def _submit(executor: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., Any], args: Any) -> bool:
        try:
            executor.submit(_logged, fn, *args)
        except RuntimeError:  # shut down: the worker is closing
            return False
        return True

    @property
    def idle_s(self) -> float:
        """How long a client may go unused before ``prune`` closes it (the
        peer directory forgets an unused producer rank after as long)."""
        return self._idle_s

    def get(self, host: str, port: int) -> SideChannelClient:
        with self._lock:
            if self._closed:
                raise RuntimeError("the side-channel client pool is closed")
            entry = self._clients.get((host, port))
            client = entry[0] if entry is not None else self._make(host, port)
            self._clients[(host, port)] = (client, self._clock())
            return client

    def prune(self, in_use: Callable[[], Collection[Address]], now: float | None = None) -> int:
        """Close clients idle for ``idle_s`` whose address is not in
        ``in_use()`` (known peers, loads in flight; asked only when some
        client is idle, so a step pays nothing otherwise); returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            if not any(now - used >= self._idle_s for _, used in self._clients.values()):
                return 0
        busy = in_use()  # may take the caller's lock: not under ours
        with self._lock:
            idle = [addr for addr, (_, used) in self._clients.items()
                    if now - used >= self._idle_s and addr not in busy]
            dropped = [self._clients.pop(addr)[0] for addr in idle]
        for client in dropped:
            client.close()
        return len(dropped)

    def close(self) -> None:
        """Stop the RPC threads (calls not started are dropped) and close every client."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._renewals.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            clients = [c for c, _ in self._clients.values()]
            self._clients.clear()
        for client in clients:
            client.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)


def _logged(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn``: a job that raises is a bug, and its loads would otherwise
    sit until their deadline with nothing said (an executor keeps what a
    job raises in a future nobody reads)."""
    try:
        fn(*args)
    except Exception:
        logger.exception("rdma-kv RPC thread: %s failed (a bug: please report it); the loads it "
                         "served fail at their deadline", getattr(fn, "__qualname__", fn))
