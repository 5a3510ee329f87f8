"""Push mode on a real wire: a push whose writes failed at the producer's
deadline while its bytes were still crossing. Nothing of it may land in the
decode's blocks once they went back to the engine.

The producer's transport *abandons* such a write (UCX still holds it: the
flush behind it is outstanding), so its bytes stay queued in UCX and the
kernel, and reach the decode whenever the path clears. The decode learns
of the failure (its query answered FAILED), fences the producer (its
endpoints force-closed, ``Agent.remove_peer(fence=True)``), and only then
recomputes the request and frees its blocks. A graceful close would be no
fence: over TCP the decode's worker kept applying the producer's bytes
after it (``tests/transport/test_fence.py``); here that would overwrite
blocks the engine already handed to someone else.

Two engines in network namespaces of their own (``tests/faults/test_netns.py``'s
setup), UCX over TCP on a veth pair. The producer's end lets a burst of the
push's data through, then holds the rest (a kilobyte a second) past the
producer's write deadline; the side channel crosses unthrottled, as a
deployment's control path, so the FAILED answer arrives. Once the request
has been recomputed and finished, the test scribbles every free block,
releases the held bytes (which then leave the producer's end: its counter
says so) and checks that no free block changed; then a push between the
same engines verifies again.

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
WRITE_TIMEOUT_S = 2.0
"""The producer's ``read_timeout_s``: its writes' deadline."""
TOKENS = 320
"""20 blocks of 32 KiB: a 640 KiB push."""
PUSH_BYTES = TOKENS // SHAPE.block_size * SHAPE.block_nbytes
HOLD_MBIT = 0.008
HOLD_BURST = 128 << 10
"""The producer's end during the push: its first 128 KiB of data cross at
once, the rest at a kilobyte a second (held for the test's minutes)."""
RELEASE_MBIT = 1000
HELD_BYTES = 256 << 10
"""What must still be held on the producer's side when the push failed for
the test to show anything (of 640 KiB)."""


@pytest.fixture
def link():
    with veth_link("rf", "10.213.13") as veth:
        yield veth


def engine(link, side, name, role, **extra):
    return wire_engine(link, side, name, role, mode="push", lease_ttl_s=30.0, **extra)


def test_a_push_failed_mid_write_lands_nothing_in_the_blocks_it_gave_back(rng, link):
    with engine(link, PRODUCER, "P", "kv_producer", read_timeout_s=WRITE_TIMEOUT_S) as p, \
            engine(link, DECODE, "D", "kv_consumer", read_timeout_s=WRITE_TIMEOUT_S, load_timeout_s=30.0) as d:
        # A first push, unthrottled: both sides' endpoints are up.
        warm = {"warm": rng.integers(1, 999, TOKENS).tolist()}
        d.add("warm", warm["warm"], prefill(p, warm)["warm"])
        assert check_loaded("warm", d.wait_results(warm, timeout_s=60)["warm"]) == "verified"

        prompt = {"held": rng.integers(1, 999, TOKENS).tolist()}
        params = prefill(p, prompt)["held"]
        link.throttle(PRODUCER, HOLD_MBIT, exempt_ports=(p.info["port"],), burst=f"{HOLD_BURST >> 10}kb")
        sent0 = link.limited_bytes(PRODUCER)
        try:
            d.add("held", prompt["held"], params)
            result = d.wait_results(["held"], timeout_s=60)["held"]
            crossed = link.limited_bytes(PRODUCER) - sent0
            # The push failed at the producer's write deadline (its query answered FAILED),
            # the decode recomputed the request, finished it and freed its blocks.
            assert check_loaded("held", result) == "load_error", result
            assert result["recomputed_from_block"] == 0, result
            assert 0 < crossed < PUSH_BYTES - HELD_BYTES, (
                f"{crossed} bytes of the {PUSH_BYTES}-byte push crossed before it failed: the test needs its "
                "writes on the wire, most of them held")
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
            f"the failed push's bytes landed in {len(landed)} free blocks ({landed[:8]}...) after the decode "
            f"gave them back; the load: {result['error']}; the decode's stats: {stats}")
        link.unthrottle(PRODUCER)
        # The fence was for that path, not forever: the same two engines push again, bit-exact,
        # and settle with nothing held, leased or in flight.
        outcomes = {"max_recovery_s": 0.0}
        assert_recovers(rng, p, d, "again", outcomes)
        print(f"a push verified again {outcomes['max_recovery_s']} s after the check")
