"""Ports for servers started by the benches and the tests: a side channel at a
fixed port (tensor parallel: rank r of an engine serves ``kv_port + r``, so
kv_port 0 cannot be used), ucx_perftest's server, a vLLM server, a router.

Chosen below the kernel's ephemeral range. A port the kernel picked for a
probe (bind to 0) is an ephemeral one: between the probe and the server's
own bind, any outgoing connection on the host may take it as its local
port, and the server dies with "Address already in use" (seen beside a
stress run making thousands of TCP connections). Below the range only a
listener can hold a port, and the probe sees that.

Imports the standard library only."""

from __future__ import annotations

import random
import socket

_LOWEST = 10000  # above the ports services usually listen on


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for local ports of outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_base_port(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1, outside
    the ephemeral range."""
    lo, hi = ephemeral_range()
    spans = [(a, b - n) for a, b in ((_LOWEST, lo - 1), (hi + 1, 65535)) if b - n >= a]
    if not spans:
        raise RuntimeError(f"no room for {n} ports outside the ephemeral range {lo}-{hi}")
    rng = random.Random()
    for _ in range(200):
        a, b = rng.choice(spans)
        base = rng.randint(a, b)
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


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range."""
    return free_base_port(1)
