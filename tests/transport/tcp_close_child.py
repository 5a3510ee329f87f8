"""Run as a script by test_tcp_teardown.py: a target closes while its answer
to a peer's read is still queued, and the peer reads only after a while.

Agents ``a`` (the target) and ``b`` (the reader), both polling, peers of
each other over TCP on ``lo``. ``b`` posts one 64 MiB read of ``a``; ``a``
answers (TCP has no native get: ``a`` sends the bytes back as messages)
until its socket is full, so the rest of its answer waits in its
endpoint's queue. Then ``a`` closes, gracefully, while ``b`` reads nothing
for ``HOLD_S``; then a thread drives ``b``. ``a``'s endpoint close flushes
that answer first, so it completes only once ``b`` reads. Before the fix
the close gave up after 200,000 progress calls (well under ``HOLD_S``),
and ``a``'s worker was destroyed with the answer still queued: UCX 1.22
purges it as if it were a send of the user's, reading state such an answer
never had (a segfault in ``ucp_request_dt_dereg``, or the request leaked:
"was not returned to mpool ucp_requests"). Prints "ok" at the end; the
test also reads UCX's warnings on stdout."""

from __future__ import annotations

import sys
import threading
import time

from rdma_kv.transport import Agent, AgentConfig
from rdma_kv.transport import peer as peer_mod
from transport_helpers import TCP, answer_queued

NBYTES = 64 << 20
HOLD_S = 3.0  # longer than 200,000 progress calls take (about 0.3 s idle)
peer_mod.CLOSE_WAIT_S = 120.0  # the close waits for b however loaded the machine: no timing in the test


def main() -> None:
    a = Agent("a", AgentConfig(ucx_options=TCP, progress="poll", lanes=1))
    b = Agent("b", AgentConfig(ucx_options=TCP, progress="poll", lanes=1))
    _, big = answer_queued(a, b, NBYTES)
    stop = threading.Event()

    def drive() -> None:
        time.sleep(HOLD_S)
        while not stop.is_set():
            b.progress()

    driver = threading.Thread(target=drive)
    driver.start()
    a.close()  # waits for b to read what it has queued
    stop.set()
    driver.join()
    b.close()
    print(f"ok (the read {big.state.name})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
