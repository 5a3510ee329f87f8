"""Push in real vLLM with the writes *on the wire* when the fault hits.

On loopback a tiny model's push is written within a millisecond, so the
other push tests break it before anything is posted. Here the producer is a
host of its own: a vLLM server inside a network namespace, joined to this
one by a veth pair (10.213.11.1 there, 10.213.11.2 here: addresses of the
test's own, nowhere else), UCX over TCP on the pair only (``ucx_options``
``TLS=tcp``, ``NET_DEVICES`` the pair's end), the decode a vLLM server out
here. The producer's end is throttled (htb, ``RATE_MBIT``) while a push is
under way, all but its side channel and HTTP API (a deployment's control
path, which must not queue behind the data), so a 192 KiB push takes
seconds to cross, and the throttle's byte counter for the data (the
limited class) shows that it is crossing when the test breaks it.

- ``test_decode_aborted_mid_write_keeps_its_blocks_until_the_writes_end``:
  the decode's client hangs up while the writes cross. The producer's end
  lets half the push through and holds the rest (a rate near zero after a
  burst) until the test raises it, so that what follows happens with bytes
  still to cross however loaded the machine: vLLM aborts the request; the
  decode asks the producer to abort (its ``push_abort_asked``), and still
  holds the push (and with it the request's blocks). Released, the writes cross; the decode lets the push go
  only once all its bytes crossed, the producer having resolved it ABORTED
  with no more written. Then both hold nothing, and the next push equals
  plain.
- ``test_producer_killed_mid_write_recomputes``: the producer is SIGKILLed
  while the writes cross. The decode's next query meets a refused
  connection: a load error at once (not a lease or write deadline), the
  decode drops its endpoints to the dead producer before the blocks go back
  (with TCP it is the decode's own worker that would apply bytes still in
  its socket), recomputes, and the completion equals plain.

Needs root and iproute2 (skips otherwise), as ``tests/faults/test_netns.py``.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from serve_proc import ApiServer, complete, metric, wait_for  # noqa: E402
from test_vllm_push import Leg, counts, decode_idle, step_reports, wait_producer_counted  # noqa: E402
from test_vllm_router import MAX_TOKENS, START_S, rdma_config  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

from rdma_kv.harness import netns  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(900)]

SUBNET = "10.213.11"
RATE_MBIT = 0.4
"""The producer's end while a push crosses: 50 KB/s, so the long prompt's
192 KiB take about four seconds (under ``read_timeout_s``)."""
LONG = " ".join(["whether tis nobler in the mind to suffer the slings and arrows"] * 16)[:-7]
"""191 words: 192 tokens with BOS, six blocks of 32 (2 layers x 16 KiB each)."""
SHORT = " ".join(["to be or not to be that is the question"] * 7)
PUSH_BYTES = 6 * 2 * (16 << 10)
"""LONG's push: six blocks, two layers of 16 KiB each."""
KILL_RATE_MBIT = 0.1
"""The producer's end while it is killed mid-push: 12.5 KB/s."""
HOLD_MBIT = 0.008
HOLD_BURST = 96 << 10
"""The producer's end while the test hangs up and checks the decode: the
first 96 KiB of data cross at once, the rest at a kilobyte a second, so
that they stay queued on it (half the push, for the minute the test
allows the abort)."""
RELEASE_MBIT = 100
"""... and once released: what was held (TCP's retransmissions of it
included) crosses in milliseconds."""
ON_THE_WIRE = 64 << 10
"""Bytes that show writes are crossing: past the rate throttle's burst
(32 KiB), within the hold's (``HOLD_BURST``)."""
UCX_TCP_ABORT = "Fatal: unexpected error: Endpoint timeout"  # ucp_request.inl, ucp_request_try_send
"""UCX 1.22 over TCP, where it emulates a PUT with messages the target
acknowledges: an acknowledgement's send meets the dead producer's
connection, and UCX treats the error as fatal (it aborts the decode's
worker process, and vLLM's engine with it). Seen after the load had
failed over correctly; not ours to fix, and not on InfiniBand, where the
target of a write sends nothing. Known, so the test says XFAIL for it
alone (reliability.md)."""
FAIL_BOUND_S = 60.0
"""The killed producer's load must fail and recompute well within the push's
deadlines (``read_timeout_s``) plus the decode's own compute."""
DEADLINE_S = 120.0
"""``read_timeout_s``: the writes' deadline. A hold on the pair must end well
before it, or the push fails by deadline instead of being aborted; on a
loaded machine the hold lasts as long as the abort takes (seconds to tens)."""


def wire_config(role: str, link: netns.VethLink, side: int) -> dict[str, Any]:
    return rdma_config(role, mode="push", side_channel_host=link.addr[side], allow_unauthenticated=True,
                       ucx_options={"TLS": "tcp", "NET_DEVICES": link.dev[side]},
                       read_timeout_s=DEADLINE_S, rpc_timeout_s=10.0)


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The pair, the producer in its namespace, the decode out here; one
    good push of a short prompt first, unthrottled, so the connections
    (side channel, PUSH_HELLO, UCX endpoints over the pair) are up."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"push on the wire needs network namespaces: {why}")
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    log_dir = tmp_path_factory.mktemp("push-wire-logs")
    with netns.VethLink(f"rw{os.getpid() % 10**6}", SUBNET, host_end=True) as link:
        p = ApiServer("prefill-push-wire", model_dir, log_dir, netns=link.ns[0], host=link.addr[0],
                      kv_transfer_config=wire_config("kv_producer", link, 0))
        d = ApiServer("decode-push-wire", model_dir, log_dir, kv_transfer_config=wire_config("kv_consumer", link, 1))
        try:
            for s in (p, d):
                s.wait_healthy(START_S)
            reference = {prompt: plain_text(d, prompt) for prompt in (SHORT, LONG)}
            assert push(p, d, SHORT)["text"] == reference[SHORT]
            # The producer resolves that push on its own threads, maybe after its
            # last step: counted before the tests take their baselines, or the
            # first test counts it as one of its own (it did: 'done' grew by 1).
            wait_producer_counted(p, d, {}, "done", 1)
            yield {"link": link, "p": p, "d": d, "reference": reference}
        finally:
            for s in (p, d):
                s.close()


def plain_text(d: ApiServer, prompt: str) -> str:
    """The decode computing ``prompt`` itself (no params: no transfer)."""
    out = complete(d.url, prompt, max_tokens=MAX_TOKENS)
    assert out["status"] == 200, out
    return str(out["text"])


def push(p: ApiServer, d: ApiServer, prompt: str) -> dict[str, Any]:
    """A sequential push: the prefill leg, then the decode leg with its params."""
    out = complete(p.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert out["status"] == 200 and out["kv_transfer_params"], out
    out = complete(d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=out["kv_transfer_params"])
    assert out["status"] == 200, out
    return out


def start_crossing(link: netns.VethLink, p: ApiServer, d: ApiServer, *, stream: bool,
                   hold: bool = False, rate_mbit: float = RATE_MBIT) -> tuple[Leg, int]:
    """Throttle the producer's end, run LONG's prefill leg, send its decode
    leg, and return once the push's writes are crossing the pair: the leg,
    and the count of the producer end's limited class (the data, not the
    side channel's or the API's answers) when the throttle went on.

    ``hold``: the throttle lets ``HOLD_BURST`` bytes of the data through,
    then holds the rest (a kilobyte a second) until ``set_rate`` raises it:
    the push is on the wire, and cannot finish, whatever the machine's pace."""
    out = complete(p.url, LONG, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert out["status"] == 200 and out["kv_transfer_params"], out
    # The side channel and the HTTP API cross unthrottled: as a deployment's
    # control path, they must not queue behind the data (an abort waits for
    # the PUSH's answer).
    exempt = (int(out["kv_transfer_params"]["remote_port"]), p.port)
    if hold:
        link.throttle(0, HOLD_MBIT, exempt_ports=exempt, burst=f"{HOLD_BURST >> 10}kb")
    else:
        link.throttle(0, rate_mbit, exempt_ports=exempt)
    sent0 = link.limited_bytes(0)
    leg = Leg(d, LONG, f"wire-{uuid.uuid4().hex}", out["kv_transfer_params"], stream=stream)
    wait_for("the push's writes to cross the pair", lambda: link.limited_bytes(0) - sent0 > ON_THE_WIRE, 60,
             poll_s=0.05)
    return leg, sent0


def abort_asked(p: ApiServer) -> float:
    """The producer's count of aborts asked for a push whose writes were
    running (after a step, so that it reached ``/metrics``)."""
    step_reports(p)
    return metric(p.url, "rdma_kv_events_total", event="push_abort_asked")


def settled(p: ApiServer | None, d: ApiServer) -> bool:
    """Nothing held: the decode's requests, blocks, loads and pushes
    (``decode_idle``), and the producer's pushes and leases (``p`` None: a
    dead producer)."""
    idle = decode_idle(d)
    if p is not None and idle:
        step_reports(p)
        idle = (metric(p.url, "rdma_kv_resource", resource="pushes_running") == 0
                and metric(p.url, "rdma_kv_leases_held") == 0)
    return idle


def test_decode_aborted_mid_write_keeps_its_blocks_until_the_writes_end(wire: dict[str, Any]) -> None:
    link, p, d, reference = wire["link"], wire["p"], wire["d"], wire["reference"]
    before, asked = counts(p, d), abort_asked(p)
    try:
        leg, sent0 = start_crossing(link, p, d, stream=True, hold=True)
        held_since = time.monotonic()
        leg.hang_up()

        def asked_to_abort() -> bool:
            step_reports(d)  # the decode steps: vLLM's abort reaches its connector
            return abort_asked(p) > asked

        wait_for("the producer to be asked to abort the running push", asked_to_abort, DEADLINE_S / 2,
                 poll_s=0.25)
        step_reports(d)  # the gauge as of this step
        running = metric(d.url, "rdma_kv_resource", resource="pushes_running")
        held_at = link.limited_bytes(0) - sent0
        assert held_at < PUSH_BYTES, f"{held_at} bytes of the push crossed although held: nothing was tested"
        assert running == 1, "the decode let the aborted push go while its writes were still held on the wire"
        # Released at once (what TCP resent during the hold crosses with it), the
        # writes complete; only then does the decode let the push go ...
        link.set_rate(0, RELEASE_MBIT)
        held_s = time.monotonic() - held_since
        deadline = time.monotonic() + 120
        while True:
            step_reports(d)
            running = metric(d.url, "rdma_kv_resource", resource="pushes_running")
            crossed = link.limited_bytes(0)
            if running == 0:
                break
            assert time.monotonic() < deadline, "the decode held the aborted push for 120 s"
            time.sleep(0.25)
        assert crossed - sent0 >= PUSH_BYTES, (
            f"the decode let the push go with {crossed - sent0} of its {PUSH_BYTES} bytes crossed "
            f"(held {held_s:.1f} s; counts since the test began: {counts(p, d, before)})")
        # ... and once it let the push go, nothing more of it crosses.
        time.sleep(2.0)
        after = link.limited_bytes(0) - crossed
        assert after < 16 << 10, f"{after} bytes crossed after the decode let the aborted push go"
        assert crossed - sent0 < 4 << 20, "more crossed than the push could hold"
    finally:
        link.unthrottle(0)

    wait_producer_counted(p, d, before, "aborted", 1)  # the producer resolved the push ABORTED
    grew = counts(p, d, before)
    assert grew["aborted"] == 1 and grew["done"] == 0 and grew["failed"] == 0, grew
    assert grew["written"] == PUSH_BYTES, grew  # posted before the abort: they crossed, and count
    assert grew["pushed_aborted"] == 1 and grew["pushed_failed"] == 0 and grew["pushed_ok"] == 0, grew
    wait_for("both engines to hold nothing", lambda: settled(p, d), 60, poll_s=0.5)
    assert push(p, d, LONG)["text"] == reference[LONG]
    wait_for("both engines to hold nothing after the next push", lambda: settled(p, d), 60, poll_s=0.5)


def test_producer_killed_mid_write_recomputes(wire: dict[str, Any]) -> None:
    """Last in the module: it kills the producer while the push crosses, at
    a quarter of the other tests' rate: the remaining 128 KiB take about ten
    seconds (at 0.4 Mbit/s a loaded machine let the writes finish before
    the kill, and nothing was tested). What the dead producer's kernel had
    queued (the data, then its resets) crosses in order, as from a crashed
    host; a hold would drop it when released."""
    link, p, d, reference = wire["link"], wire["p"], wire["d"], wire["reference"]
    before = counts(None, d)
    try:
        leg, sent0 = start_crossing(link, p, d, stream=False, rate_mbit=KILL_RATE_MBIT)
        assert link.limited_bytes(0) - sent0 < PUSH_BYTES, "the push crossed before the kill"
        killed_at = time.monotonic()
        p.kill()
        answer = leg.result(FAIL_BOUND_S + 60)
    finally:
        link.unthrottle(0)
    took = time.monotonic() - killed_at
    assert answer["status"] == 200 and answer["text"] == reference[LONG], answer
    grew = counts(None, d, before)
    assert grew["pushed_failed"] == 1 and grew["loads_failed"] == 1 and grew["pushed_ok"] == 0, grew
    assert grew["producer_gone"] == 1, (grew, d.log()[-3000:])
    assert took < FAIL_BOUND_S, f"the load failed {took:.1f} s after the kill"

    def decode_settled() -> bool:
        try:
            return settled(None, d)
        except AssertionError:
            if UCX_TCP_ABORT in d.log():  # only this known abort; anything else fails the test
                pytest.xfail("the decode's worker aborted in UCX after its producer died mid-push over TCP "
                             f"({UCX_TCP_ABORT!r}; reliability.md: not fixed)")
            raise

    wait_for("the decode to hold nothing", decode_settled, 60, poll_s=0.5)
    assert plain_text(d, SHORT) == reference[SHORT]
