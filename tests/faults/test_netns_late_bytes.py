"""Bytes still crossing when a transfer failed at its deadline, on a real
wire: nothing of them may land in the decode's blocks once those went back
to the engine. Two engines in network namespaces of their own
(``tests/faults/test_netns.py``'s setup), UCX over TCP on a veth pair. The
producer's end lets a burst of the KV through, then holds the rest (a
kilobyte a second) past the transfer's deadline; the side channel crosses
unthrottled, as a deployment's control path. Once the request has been
recomputed and finished, the test scribbles every free block, releases the
held bytes (which then leave the producer's end: its counter says so) and
checks that no free block changed; then a transfer between the same
engines verifies again.

**Push** (the producer writes). The producer's transport *abandons* such a
write (UCX still holds it: the flush behind it is outstanding), so its
bytes stay queued in UCX and the kernel, and reach the decode whenever the
path clears. The decode learns of the failure (its query answered FAILED),
fences the producer (its endpoints force-closed,
``Agent.remove_peer(fence=True)``), and only then recomputes the request
and frees its blocks. A graceful close would be no fence: over TCP the
decode's worker kept applying the producer's bytes after it
(``tests/transport/test_fence.py``); here that would overwrite blocks the
engine already handed to someone else.

**Pull** (the decode reads). The read's deadline is the decode's own: its
transport fails the peer, force-closing its endpoints (UCX cancels the
read; no flush holds a read's endpoint open), before the load is reported
failed and its blocks freed. The producer's answers still queued on its
end then meet a closed connection.

Needs root and iproute2 (skips otherwise).
"""

from __future__ import annotations

import time

import pytest
from faults_util import SHAPE, check_loaded, idle, prefill, veth_link, wire_engine
from rdma_testutil import wait_until
from test_netns import assert_recovers

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(180)]

PRODUCER, DECODE = 0, 1
DEADLINE_S = 2.0
"""``read_timeout_s`` on both sides: the deadline of the producer's writes
(push) and of the decode's reads (pull)."""
TOKENS = 320
"""20 blocks of 32 KiB: 640 KiB of KV, written whole by one worker."""
STRIPED_TOKENS = 1280
"""80 blocks: 2.5 MiB, which the producer's transport stripes over its two
workers (parts of at least ``lane_min_bytes``, 1 MiB)."""
HOLD_MBIT = 0.008
HOLD_BURST = 128 << 10
"""The producer's end during the transfer: its first 128 KiB of data cross
at once, the rest at a kilobyte a second (held for the test's minutes)."""
RELEASE_MBIT = 1000
HELD_BYTES = 256 << 10
"""What must still be held on the producer's side when the transfer failed
for the test to show anything (of 640 KiB)."""


@pytest.fixture
def link():
    with veth_link("rf", "10.213.13") as veth:
        yield veth


@pytest.mark.parametrize("mode, redial, tokens",
                         [("push", False, TOKENS), ("pull", False, TOKENS), ("push", True, TOKENS),
                          ("push", False, STRIPED_TOKENS)],
                         ids=["push", "pull", "push-dialled-again", "push-striped"])
def test_a_transfer_failed_mid_wire_lands_nothing_in_the_blocks_given_back(rng, link, mode, redial, tokens):
    """``push-dialled-again``: before the failed push, the decode forgot the
    producer as idle (its endpoint closed gracefully) and dialled it again.
    Until protocol 13 the decode did not introduce itself again, the
    producer kept writing on the endpoint it had made for the first dial,
    which the decode's fence of its new endpoint does not close, and the
    held bytes landed in the freed blocks."""
    def engine(side, name, role, **extra):
        return wire_engine(link, side, name, role, mode=mode, lease_ttl_s=30.0, read_timeout_s=DEADLINE_S,
                           **extra)

    with engine(PRODUCER, "P", "kv_producer") as p, engine(DECODE, "D", "kv_consumer", load_timeout_s=30.0) as d:
        # A first transfer, unthrottled: both sides' endpoints are up.
        kv_bytes = tokens // SHAPE.block_size * SHAPE.block_nbytes
        warm = {"warm": rng.integers(1, 999, TOKENS).tolist()}
        d.add("warm", warm["warm"], prefill(p, warm)["warm"])
        assert check_loaded("warm", d.wait_results(warm, timeout_s=60)["warm"]) == "verified"
        if redial:
            assert d.call("forget_idle_peers") == 1
            again = {"again": rng.integers(1, 999, TOKENS).tolist()}
            d.add("again", again["again"], prefill(p, again)["again"])  # dialled again: a new endpoint
            assert check_loaded("again", d.wait_results(again, timeout_s=60)["again"]) == "verified"

        prompt = {"held": rng.integers(1, 999, tokens).tolist()}
        params = prefill(p, prompt)["held"]
        link.throttle(PRODUCER, HOLD_MBIT, exempt_ports=(p.info["port"],), burst=f"{HOLD_BURST >> 10}kb")
        sent0 = link.limited_bytes(PRODUCER)
        try:
            d.add("held", prompt["held"], params)
            result = d.wait_results(["held"], timeout_s=60)["held"]
            crossed = link.limited_bytes(PRODUCER) - sent0
            # The transfer failed at its deadline (push: the producer's query answered FAILED;
            # pull: the decode's read), the decode recomputed the request, finished it and
            # freed its blocks.
            assert check_loaded("held", result) == "load_error", result
            assert result["recomputed_from_block"] == 0, result
            assert 0 < crossed < kv_bytes - HELD_BYTES, (
                f"{crossed} bytes of the {kv_bytes}-byte transfer crossed before it failed: the test needs its "
                "data on the wire, most of it held")
            d.wait_status(idle(), timeout_s=15)
            stats = d.call("stats")
            assert d.call("scribble_free") == SHAPE.num_blocks
        finally:
            link.set_rate(PRODUCER, RELEASE_MBIT)
        # The held bytes leave the producer's end now; none may land at the decode.
        wait_until(lambda: link.limited_bytes(PRODUCER) - sent0 > crossed + HELD_BYTES, 30,
                   what="held bytes leaving the producer's end")
        time.sleep(1.0)  # (they cross in milliseconds once they left)
        landed = d.call("unscribbled")
        assert landed == [], (
            f"the failed {mode}'s bytes landed in {len(landed)} free blocks ({landed[:8]}...) after the decode "
            f"gave them back; the decode's stats: {stats}")
        link.unthrottle(PRODUCER)
        # The failure was for that transfer, not forever: the same two engines move KV again,
        # bit-exact, and settle with nothing held, leased or in flight.
        outcomes = {"max_recovery_s": 0.0}
        assert_recovers(rng, p, d, "again", outcomes)
        print(f"a {mode} verified again {outcomes['max_recovery_s']} s after the check")
