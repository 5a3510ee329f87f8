"""Registering an engine with a P/D router's service discovery.

vllm-router's ``--vllm-discovery-address H:P`` (the only way its
``--kv-connector moriio`` mode learns its engines, and the mode in which it
dispatches prefill and decode at once) binds a ZMQ ROUTER socket; each
engine's rank 0 sends it, at least every 3 s (entries expire after 5 s), one
msgpack map per frame from a DEALER socket::

    {"type": "P" | "D", "http_address": "ip:port", "zmq_address": <opaque>,
     "transfer_mode": "WRITE" | "READ"}

The router copies both engines' ``zmq_address`` into the ``X-Request-Id``
it gives both legs (``___prefill_addr_{P}___decode_addr_{D}_{32 hex}``):
for rdma-kv it is the producer's side channel
(``params.format_router_address``), which the decode parses from its
request id (``params.router_address``). ``WRITE`` (push mode) makes the
router dispatch both legs at once; ``READ`` (pull) makes it sequential.

Settings: ``router_discovery_address`` (``host:port``) and
``router_http_address`` (this engine's OpenAI server, ``host:port``: the
router sends requests there). Needs pyzmq (vLLM installs it); imported only
when registering. One daemon thread; every send is non-blocking (a router
not up yet loses nothing: ZMQ queues, the next beat repeats).

Imports the standard library, msgspec and (lazily) zmq.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from rdma_kv.errors import ConfigError

__all__ = ["RouterRegistration"]

logger = logging.getLogger(__name__)

BEAT_S = 2.0
"""How often the registration is repeated (the router forgets an engine 5 s after its last)."""


class RouterRegistration:
    """Heartbeats ``payload()`` to the router at ``address`` until :meth:`close`."""

    def __init__(self, address: str, payload: Callable[[], dict[str, Any]], interval_s: float = BEAT_S) -> None:
        try:
            import zmq
        except ImportError:
            raise ConfigError("router_discovery_address needs pyzmq (pip install pyzmq; vLLM installs it)") from None
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"router_discovery_address {address!r}: expected host:port")
        self._zmq = zmq
        self._context: Any = zmq.Context.instance()
        self._socket: Any = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 16)
        # ZMQ sockets are IPv4-only unless told: "[::1]:PORT" (an IPv6 cluster's
        # address) never connected, and every beat was dropped without a word.
        self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.connect(f"tcp://{address}")
        self._payload = payload
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="rdma-kv-router-registration", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                self._socket.send(msgspec.msgpack.encode(self._payload()), self._zmq.NOBLOCK)
                self.beats += 1
            except self._zmq.Again:
                pass  # the router is not up (yet): ZMQ's queue is full; the next beat repeats
            except Exception as exc:  # never kill the engine over its registration
                if not warned:
                    logger.warning("registering with the router failed: %s (retrying every %.0f s)",
                                   exc, self._interval_s)
                    warned = True
            self._stop.wait(self._interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._socket.close(linger=0)
