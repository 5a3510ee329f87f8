"""Ports for tests that need a fixed side-channel port (tensor parallel:
rank r of an engine serves ``kv_port + r``, so kv_port 0 cannot be used)."""

from __future__ import annotations

import socket


def free_base_port(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports on 127.0.0.1")
