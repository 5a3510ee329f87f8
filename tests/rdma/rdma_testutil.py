"""Helpers for the RDMA connector tests: a bounded wait, prefills then their
loads through two harness engines, and side-channel
frames built and taken apart by hand (4-byte big-endian length, then the
body), independently of ``framing.send_frame`` / ``recv_frame``."""

from __future__ import annotations

import struct
import time

from rdma_kv.connector.rdma import wire


def wait_until(predicate, timeout_s=10.0, step=None, what="condition"):
    """Call ``step()`` until ``predicate()``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.001)


def pump_until(p, d, predicate, what, timeout_s=10.0):
    """Step engines ``p`` and ``d`` in turn until ``predicate()`` holds."""
    def pump():
        p.step()
        d.step()

    wait_until(predicate, timeout_s=timeout_s, step=pump, what=what)


def prefill_then_decode(P, D, prompts, timeout_s=10.0):
    """Prefill ``prompts`` ({request id: token ids}) on engine ``P``, then
    hand each one's params to engine ``D``; step both until every decode
    finished or failed. Returns ``D``'s results of these requests."""
    def pump():
        P.step()
        D.step()

    for rid, prompt in prompts.items():
        P.add_request(rid, prompt, {"do_remote_decode": True})
    wait_until(lambda: all(P.results.get(r) and P.results[r].status.value == "finished" for r in prompts),
               timeout_s, step=pump, what="prefills")
    for rid, prompt in prompts.items():
        D.add_request(rid, prompt, P.results[rid].kv_transfer_params)
    wait_until(lambda: all(D.results.get(r) and D.results[r].status.value in ("finished", "failed")
                           for r in prompts), timeout_s, step=pump, what="decodes")
    return {rid: D.results[rid] for rid in prompts}


def frame(message):
    """``message`` encoded as one side-channel frame."""
    body = wire.encode(message)
    return struct.pack(">I", len(body)) + body


def decode_replies(data):
    """The replies in a byte stream the server sent (whole frames only)."""
    out, offset = [], 0
    while offset + 4 <= len(data):
        (n,) = struct.unpack(">I", data[offset:offset + 4])
        out.append(wire.decode_reply(data[offset + 4:offset + 4 + n]))
        offset += 4 + n
    return out
