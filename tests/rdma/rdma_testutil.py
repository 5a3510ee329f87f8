"""Helpers for the RDMA connector tests: a bounded wait, and side-channel
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
