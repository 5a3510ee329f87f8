"""Run as a script by test_tcp_teardown.py: rounds of a writer whose peer
fails on a deadline with writes in flight over TCP, then closes gracefully.

Each round: agents ``a`` (polling, the target) and ``b`` (``progress`` as
given, lanes as given), peers of each other over TCP on ``lo`` with
rdma-kv's default UCX options. ``b`` first reads every slot once, so that
each of its workers' endpoints to ``a`` is wired up. Then ``b`` posts 24
transfers back to back (reads and writes, not notified: no endpoint flush
of rdma-kv's is in flight), every fifth with a deadline that has passed
before it can complete. ``a`` does not progress until one of them has
failed (no read completes meanwhile), so the first expiry is certain to
fail the peer and force-close its endpoints with writes in flight. Once
every slot came back, ``a`` closes (gracefully: its endpoints flush and say
goodbye to ``b``'s half-closed ones, which ``b``'s pump sees), then ``b``.
A crash kills this process; the test reads its exit status. Prints "ok"
after the last round.

Flags after LANES: ``notify`` notifies the writes (an endpoint flush behind
each); ``cold`` skips the warm-up read, so that the peer fails while its
endpoints are still wiring up. ``python tcp_teardown_child.py 30 SEED
thread 3 notify cold`` shows the crashes UCX 1.22 still has there (a flush
rescheduled during wireup outlives the endpoint's forced close; a TCP
endpoint destroyed with requests pending after its reconnects were
refused: docs/reliability.md). Not part of the suite.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from rdma_kv.transport import Agent, AgentConfig, XferState
from rdma_kv.transport import ucx
from transport_helpers import TCP, link, post_burst, prepare_slots, settle_until_one_failed, wait_until

NBYTES = 8 << 20
BLOCK = 4096
SLOTS = NBYTES // BLOCK
LANE_MIN = 256 << 10
# RDMA_KV_TEST_TCP_PUT=y: UCX's native TCP put, as before the fix (to show the test fails without it).
OVERRIDE = {"TCP_PUT_ENABLE": os.environ["RDMA_KV_TEST_TCP_PUT"]} if "RDMA_KV_TEST_TCP_PUT" in os.environ else {}
# a's close drains its worker until b has read every answer queued: however loaded the machine (no timing in
# the test; the product's bound, 2 s, held in 92 runs under load: docs/reliability.md).
ucx.DRAIN_WAIT_S = 120.0


def one_round(rng: np.random.Generator, progress: str, lanes: int, notify: bool, warm: bool) -> int:
    """One round; returns how many of its transfers failed."""
    options = {**TCP, **OVERRIDE}
    a = Agent("a", AgentConfig(ucx_options=options, progress="poll", lanes=1))
    b = Agent("b", AgentConfig(ucx_options=options, progress=progress, lanes=lanes, lane_min_bytes=LANE_MIN))
    local, remote = prepare_slots(link(a, b, NBYTES), BLOCK)
    end = time.monotonic() + 30.0
    if warm:  # every worker's endpoint wired up: one read over all slots (striped over the lanes)
        every = np.arange(SLOTS)
        first = b.read_prepared(local, every, remote, every)
        wait_until(first.done, 30.0, "the warm-up read", drive=[a, b])
        if first.state is not XferState.DONE:
            raise SystemExit(f"the warm-up read failed: {first.state}")
    xfers = post_burst(b, local, remote, rng, SLOTS, 2 * LANE_MIN // BLOCK, notify=notify)
    ctx = b._core.inflight.ctx
    settle_until_one_failed(b, xfers, max(0.0, end - time.monotonic()))  # before a answers anything
    while not all(x.done() for x in xfers) or ctx.nfree != ctx.nslots:
        a.progress()  # a answers TCP gets and applies puts
        b.settle()
        if time.monotonic() > end:
            raise SystemExit(f"{ctx.nslots - ctx.nfree} transfers never came back")
    failed = sum(x.state is not XferState.DONE for x in xfers)
    close_target(a)
    time.sleep(0.01)  # b's pumps see a's goodbye
    b.close()
    return failed


def close_target(a: Agent) -> None:
    """``a.close()``, named in a crash's stack (faulthandler): UCX 1.22
    segfaulted in it, destroying a's worker with answers to b's reads still
    queued, before ``Worker.close`` drained it (docs/reliability.md,
    "Reviews of the TCP target's close"); the test knows that crash by this
    frame."""
    a.close()


def main() -> None:
    rounds, seed, progress, lanes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    flags = set(sys.argv[5:])
    if flags - {"notify", "cold"}:
        raise SystemExit(f"unknown flags {sorted(flags - {'notify', 'cold'})}: expected notify, cold")
    rng = np.random.default_rng(seed)
    failed = [one_round(rng, progress, lanes, "notify" in flags, "cold" not in flags) for _ in range(rounds)]
    if not all(failed):
        raise SystemExit(f"a round had no failed transfer (failed per round: {failed}): the deadlines did not fail the peer")
    print("ok", flush=True)


if __name__ == "__main__":
    main()
