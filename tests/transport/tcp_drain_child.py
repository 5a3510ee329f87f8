"""Run as a script by test_tcp_teardown.py: a target's answer to a read that
arrives while the target closes its endpoint is still queued when that
close completes.

Agents ``a`` (the target) and ``b`` (the reader), both polling, peers of
each other over TCP on ``lo``. ``b`` reads 64 MiB of ``a``; ``a`` answers
(TCP has no native get: the bytes go back as messages) until its socket is
full, and the rest waits in its endpoint's queue. ``a`` closes: its
endpoint's close queues a flush behind that answer. Only then (an event,
no timing) ``b`` posts a second 64 MiB read and starts reading; ``a``,
progressing for its close, answers the second read behind the flush. The
flush, and so the close, completes once the first answer is out, with most
of the second still queued. UCX keeps a gracefully closed endpoint to a
connected peer until the worker goes, and ``ucp_worker_destroy`` purges
what it still has queued as if it were sends of the user's: the answer
leaks ("was not returned to mpool ucp_requests"), or, its request
recycled, the purge segfaults in ``ucp_request_dt_dereg``. ``Worker.close``
now drains the worker first (``Worker.drain``). Prints "ok" at the end;
the test also reads UCX's warnings on stdout."""

from __future__ import annotations

import sys
import threading

from rdma_kv.transport import Agent, AgentConfig
from rdma_kv.transport import peer as peer_mod
from rdma_kv.transport import ucx
from transport_helpers import TCP, answer_queued

NBYTES = 64 << 20
peer_mod.CLOSE_WAIT_S = 120.0  # the waits end on b's reading however loaded the machine: no timing in the test
ucx.DRAIN_WAIT_S = 120.0


def main() -> None:
    a = Agent("a", AgentConfig(ucx_options=TCP, progress="poll", lanes=1))
    b = Agent("b", AgentConfig(ucx_options=TCP, progress="poll", lanes=1))
    read, big = answer_queued(a, b, NBYTES)
    reads = [big]

    closing = threading.Event()
    close_ep = peer_mod.Peer._close_ep

    def close_ep_seen(self, entry, force):  # a's endpoint close: its flush is queued behind the first answer
        closing.set()
        close_ep(self, entry, force)
    peer_mod.Peer._close_ep = close_ep_seen  # type: ignore[method-assign]
    stop = threading.Event()

    def drive() -> None:
        closing.wait()
        reads.append(read(NBYTES))  # a answers it while closing, behind the flush
        while not stop.is_set():
            b.progress()

    driver = threading.Thread(target=drive)
    driver.start()
    a.close()
    stop.set()
    driver.join()
    peer_mod.Peer._close_ep = close_ep  # type: ignore[method-assign]
    b.close()
    print(f"ok (reads {[r.state.name for r in reads]})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
