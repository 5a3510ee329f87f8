"""The side channel's framing: a 4-byte big-endian length, then the body.

A frame's length is checked against the caller's limit before a byte of
the body is read, and every send and read has a deadline: a point in time
(``time.monotonic``), so that the steps of one call share one bound. Imports the standard
library and ``rdma_kv.errors`` only: what the body means is ``wire``'s.
"""

from __future__ import annotations

import socket
import struct
import time

from rdma_kv.errors import MetadataError, PeerError

__all__ = ["HEADER", "recv_frame", "send_frame"]

HEADER = struct.Struct(">I")
"""A frame's length, before its body: the blocking calls here and the side
channel's event loop (which frames its own non-blocking buffers) share it."""


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """``n`` bytes by ``deadline``. Bytes that arrived by then count even when
    this thread runs again only after it (a loaded host can leave a process
    unscheduled for many seconds): past the deadline, what the socket
    already holds is taken without waiting, and only a frame still
    incomplete is a timeout -- a reply received in time is never dropped for
    a late reader (its call would be retried on a new connection)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        sock.settimeout(max(left, 0.0))  # 0: non-blocking, what is buffered only
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except (BlockingIOError, InterruptedError, TimeoutError):
            if left > 0 and time.monotonic() < deadline:
                continue
            raise TimeoutError(f"{what}: timed out with {len(buf)} of {n} bytes received") from None
        if not chunk:
            raise PeerError(f"{what}: connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, payload: bytes, *, deadline: float) -> None:
    """Send one frame by ``deadline`` (``time.monotonic``); past it, only what
    the socket's buffer takes at once."""
    sock.settimeout(max(deadline - time.monotonic(), 0.0))
    try:
        sock.sendall(HEADER.pack(len(payload)) + payload)
    except BlockingIOError:
        raise TimeoutError(f"send of a {len(payload)}-byte frame: timed out") from None


def recv_frame(sock: socket.socket, max_bytes: int, what: str, *, deadline: float) -> bytes | None:
    """One frame's body, by ``deadline`` (``time.monotonic``, as in
    ``_recv_exact``); ``None`` on a clean close before a frame starts. A
    length above ``max_bytes`` is refused before reading the body."""
    sock.settimeout(max(deadline - time.monotonic(), 0.0))
    try:
        first = sock.recv(HEADER.size)
    except BlockingIOError:
        raise TimeoutError(f"{what}: timed out with 0 of {HEADER.size} header bytes received") from None
    if not first:
        return None
    header = first + (_recv_exact(sock, HEADER.size - len(first), deadline, what)
                      if len(first) < HEADER.size else b"")
    (length,) = HEADER.unpack(header)
    if length > max_bytes:
        raise MetadataError(f"{what}: frame of {length} bytes exceeds the {max_bytes}-byte limit")
    return _recv_exact(sock, length, deadline, what)