"""Test hosts on one machine: network namespaces joined by a veth pair.

Owns :class:`VethLink` (create two named namespaces, a veth pair between
them with addresses of the caller's choosing, take the link down and up,
throttle it) and :func:`enter` (move the calling process into a namespace
the way ``ip netns exec`` does). Used by the partition tests; needs root and
iproute2 (``ip``, ``tc``); :func:`unavailable` says why not when it cannot.

:func:`enter` also gives the process a private mount namespace with a fresh
``/sys``: UCX lists network devices from ``/sys/class/net``, which otherwise
still shows the namespace the process came from.

Imports the standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["VethLink", "enter", "unavailable"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2
_NETNS_DIR = "/run/netns"


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise OSError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _delete(ns: str) -> None:
    """Delete namespace ``ns`` (and the veth end inside it); quiet if gone."""
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    name = f"rkv-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "netns", "del", name)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    return None


def enter(name: str) -> None:
    """Move the calling process into network namespace ``name`` (under
    ``/run/netns``), with its own mount namespace and ``/sys``. Call it
    before any other thread starts: threads started earlier stay outside."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(os.path.join(_NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns into network namespace {name!r}")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"", b"/", b"none", _MS_SLAVE | _MS_REC, None), "making / a slave mount")
    check(libc.umount2(b"/sys", _MNT_DETACH), "detaching /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mounting this namespace's sysfs")


class VethLink:
    """Two namespaces, ``<prefix>-a`` and ``<prefix>-b``, joined by a veth pair
    (``<prefix>a`` in the first, ``<prefix>b`` in the second) on ``subnet``
    (``"10.213.7"`` gives 10.213.7.1 and 10.213.7.2 /24). Use as a context
    manager; closing deletes both namespaces and with them the pair.

    ``host_end=True``: the second end stays in the caller's own namespace
    (``ns[1]`` is None), so that processes there (a test, a server it
    reaches over loopback) talk to the first namespace's over the pair."""

    def __init__(self, prefix: str, subnet: str, *, host_end: bool = False) -> None:
        if len(prefix) > 12:
            raise ValueError(f"prefix {prefix!r} too long for an interface name (max 12)")
        self.ns: tuple[str, str | None] = (f"{prefix}-a", None if host_end else f"{prefix}-b")
        self.dev = (f"{prefix}a", f"{prefix}b")
        self.addr = (f"{subnet}.1", f"{subnet}.2")
        made: list[str] = []
        try:
            for ns in self.ns:
                if ns is not None:
                    _run("ip", "netns", "add", ns)
                    made.append(ns)
            peer_ns = ["netns", self.ns[1]] if self.ns[1] is not None else ["netns", str(os.getpid())]
            _run("ip", "-n", self.ns[0], "link", "add", self.dev[0], "type", "veth",
                 "peer", "name", self.dev[1], *peer_ns)
            for side, (dev, addr) in enumerate(zip(self.dev, self.addr)):
                _run(*self._ip(side), "addr", "add", f"{addr}/24", "dev", dev)
                if self.ns[side] is not None:
                    _run(*self._ip(side), "link", "set", "lo", "up")
                _run(*self._ip(side), "link", "set", dev, "up")
        except BaseException:
            for ns in made:
                _delete(ns)  # takes the pair with it, the end outside included
            raise

    def _ip(self, side: int, tool: str = "ip") -> list[str]:
        """``ip`` (or ``tc``) acting in end ``side``'s namespace."""
        ns = self.ns[side]
        return [tool] if ns is None else [tool, "-n", ns]

    def set_link(self, side: int, up: bool) -> None:
        """Take one end of the pair (0 or 1) down or bring it back up."""
        _run(*self._ip(side), "link", "set", self.dev[side], "up" if up else "down")

    def throttle(self, side: int, mbit: float, *, exempt_ports: Sequence[int] = ()) -> None:
        """Limit what leaves end ``side`` to ``mbit`` megabits per second (tbf),
        except TCP segments from ``exempt_ports`` (say, a control channel that
        a deployment carries on another path than the data): those go first,
        unthrottled (htb: an unlimited class for them, the default class
        limited)."""
        tc = self._ip(side, "tc")
        dev = self.dev[side]
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "32kb", "latency", "10s"]
        if not exempt_ports:
            _run(*tc, "qdisc", "replace", "dev", dev, "root", *tbf)
            return
        _run(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", f"{mbit}mbit",
             "ceil", f"{mbit}mbit", "burst", "32kb")
        for port in exempt_ports:
            _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", "protocol", "6", "0xff", "match", "ip", "sport", str(port), "0xffff",
                 "flowid", "1:10")

    def unthrottle(self, side: int) -> None:
        _run(*self._ip(side, "tc"), "qdisc", "del", "dev", self.dev[side], "root")

    def tx_bytes(self, side: int) -> int:
        """Bytes end ``side`` has sent (from its counters)."""
        out = _run(*self._ip(side), "-s", "-j", "link", "show", self.dev[side])
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        if self.ns[1] is None:  # the end out here goes now, not when the kernel reaps the namespace
            subprocess.run(["ip", "link", "del", "dev", self.dev[1]], capture_output=True, timeout=20)
        for ns in self.ns:
            if ns is not None:
                _delete(ns)

    def __enter__(self) -> VethLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
