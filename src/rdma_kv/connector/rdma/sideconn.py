"""One accepted side-channel connection, and what the server counts.

Owns :class:`Accepted` (an accepted connection's socket, buffers, opening
:class:`Phase`, trust and deadlines: a small record, not a thread; it cuts
its input into frames, frames its replies, and says when it is due),
:func:`abort` (close with a reset), :func:`bind_advice` (what to change when
the listener cannot bind) and :class:`SideChannelCounters` (what the server
did with its connections, with the tables from ``admission``'s refusal and
eviction reasons to those counters). The server that drives them is
``sidechannel``.

Imports the standard library and the connector's ``rdma.framing``,
``rdma.stats`` and ``rdma.wire``.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import selectors
import socket
import struct
from typing import Any

from rdma_kv.connector.rdma import framing, wire
from rdma_kv.connector.rdma.stats import Counters

__all__ = ["EVICTED", "REFUSED", "Accepted", "FrameTooLarge", "Phase", "SideChannelCounters", "abort", "bind_advice"]


@dataclasses.dataclass(frozen=True, slots=True)
class SideChannelCounters(Counters):
    """What a side-channel server did with its connections (``SideChannelServer.stats``)."""

    connections: int = 0
    """Accepted (admitted) connections."""
    requests: int = 0
    authenticated: int = 0
    trusted: int = 0
    """Connections that became trusted (AUTH, or a lease they proved)."""
    untrusted_again: int = 0
    accept_paused: int = 0
    """Times accepting paused (``sidechannel.ACCEPT_PAUSE_S``) because accept()
    found no file descriptor or no memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)."""
    refused_connections: int = 0
    """Refused at accept (any reason below) or at the opening."""
    refused_full: int = 0
    refused_per_source: int = 0
    evicted_per_source: int = 0
    evicted_untrusted_per_source: int = 0
    evicted_untrusted_total: int = 0
    evicted_full: int = 0
    closed_at_deadline: int = 0
    closed_idle: int = 0
    closed_slow: int = 0
    auth_failures: int = 0
    bad_frames: int = 0
    forged: int = 0
    """Lease calls answered FORGED."""
    unknown: int = 0
    """Lease calls answered UNKNOWN."""


REFUSED = {"full": "refused_full", "per_source": "refused_per_source"}
"""``admission.Admission.REASONS`` -> its counter (a field of :class:`SideChannelCounters`)."""
EVICTED = {"per_source": "evicted_per_source", "untrusted_per_source": "evicted_untrusted_per_source",
           "untrusted_total": "evicted_untrusted_total", "full": "evicted_full"}
"""``admission.Admission.EVICTIONS`` -> its counter."""


class Phase(enum.IntEnum):
    """Where a connection's opening is."""

    HELLO = 0  # waiting for HELLO
    AUTH = 1  # CHALLENGE sent, waiting for AUTH (a secret is configured)
    READY = 2  # opened: requests are served


class Accepted:
    """One accepted connection: its socket, buffers, phase, trust and deadlines."""

    __slots__ = ("sock", "fd", "addr", "source", "phase", "trusted", "inbuf",
                 "outbuf", "closing", "accepted_at", "last_active", "opening_deadline", "handshaken",
                 "frame_started", "write_started", "due", "requests", "nonce", "hello", "closed", "mask",
                 "read_turn")

    def __init__(self, sock: socket.socket, addr: tuple[Any, ...], now: float, opening_s: float) -> None:
        self.sock, self.fd, self.addr, self.source = sock, sock.fileno(), addr, str(addr[0])
        self.phase = Phase.HELLO
        self.trusted = False
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.closing = False  # close once the output drained
        self.accepted_at = self.last_active = now
        self.opening_deadline = now + opening_s
        self.handshaken = False  # a HANDSHAKE was answered: the opening is done, idle-bounded from then on
        self.frame_started: float | None = None
        self.write_started: float | None = None
        self.due = 0.0
        self.requests = 0
        self.nonce = b""
        self.hello: wire.Hello | None = None
        self.closed = False
        self.mask = selectors.EVENT_READ
        self.read_turn = 0  # the server's loop turn that last read it while untrusted (0: none yet)

    def take_frame(self) -> bytes | None:
        """The next whole request frame's body, taken from the input buffer;
        None until one has arrived whole. ``FrameTooLarge`` when its header
        announces more than ``wire.MAX_REQUEST_BYTES``."""
        buf = self.inbuf
        if len(buf) < framing.HEADER.size:
            return None
        (length,) = framing.HEADER.unpack_from(buf)
        if length > wire.MAX_REQUEST_BYTES:
            raise FrameTooLarge(f"side channel request from {self.addr}: frame of {length} bytes exceeds the "
                                f"{wire.MAX_REQUEST_BYTES}-byte limit")
        if len(buf) < framing.HEADER.size + length:
            return None
        body = bytes(buf[framing.HEADER.size:framing.HEADER.size + length])
        del buf[:framing.HEADER.size + length]
        return body

    def queue(self, payload: bytes, then_close: bool) -> None:
        """Frame ``payload`` into the output buffer (the server flushes it)."""
        self.outbuf += framing.HEADER.pack(len(payload))
        self.outbuf += payload
        self.closing = self.closing or then_close

    def deadline(self, idle_s: float, handshake_idle_s: float, io_timeout_s: float) -> float:
        """When the server closes it unless it acts: idle for ``idle_s`` once
        trusted, ``handshake_idle_s`` once handshaken, else at the opening's
        deadline; and within ``io_timeout_s`` of a request frame begun or a
        reply unread."""
        if self.trusted:
            due = self.last_active + idle_s
        elif self.handshaken:
            due = self.last_active + handshake_idle_s
        else:
            due = self.opening_deadline
        if self.frame_started is not None:
            due = min(due, self.frame_started + io_timeout_s)
        if self.write_started is not None:
            due = min(due, self.write_started + io_timeout_s)
        return due


class FrameTooLarge(ValueError):
    """A request frame's header announced more than a request may carry."""


def abort(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): a refused, evicted or expired flood
    connection leaves no TIME_WAIT entry behind on this host."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def bind_advice(exc: OSError, host: str, port: int) -> str | None:
    """What to change when the side channel cannot bind ``host:port`` (None:
    no specific advice). ``rdma-kv info --config`` gives the same words."""
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"side_channel_host {host} is not an address of this host; set "
                "kv_connector_extra_config['side_channel_host'] to one of its interfaces")
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use; choose another kv_port or side_channel_port "
                "(tensor-parallel rank r listens on port + r)")
    return None
