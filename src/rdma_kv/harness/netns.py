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
import re
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
        self._gso_segs: dict[int, int] = {}  # per throttled end: its gso_max_segs before the throttle
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

    def throttle(self, side: int, mbit: float, *, exempt_ports: Sequence[int] = (), burst: str = "32kb") -> None:
        """Limit what leaves end ``side`` to ``mbit`` megabits per second (tbf),
        except TCP segments from ``exempt_ports`` (say, a control channel that
        a deployment carries on another path than the data): those go first,
        unthrottled (htb: an unlimited class for them, the default class
        limited). ``burst``: what may leave at once before the limit bites
        (a rate near zero with a burst of N bytes lets about N through, then
        holds the rest until :meth:`set_rate` raises the rate)."""
        tc = self._ip(side, "tc")
        dev = self.dev[side]
        # Segments of one MSS: a GSO packet of 64 KiB would be shaped as one,
        # and at a rate near zero leave the class in debt for a minute after
        # set_rate raised it (tokens are owed in time, not bytes).
        if side not in self._gso_segs:
            out = _run(*self._ip(side), "-d", "-j", "link", "show", dev)
            self._gso_segs[side] = int(json.loads(out)[0].get("gso_max_segs", 65535))
        _run(*self._ip(side), "link", "set", "dev", dev, "gso_max_segs", "1")
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", burst, "latency", "10s"]
        if not exempt_ports:
            _run(*tc, "qdisc", "replace", "dev", dev, "root", *tbf)
            return
        _run(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", *self._limit(mbit, burst))
        for port in exempt_ports:
            _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", "protocol", "6", "0xff", "match", "ip", "sport", str(port), "0xffff",
                 "flowid", "1:10")

    @staticmethod
    def _limit(mbit: float, burst: str) -> list[str]:
        """An htb class's limit: rate and ceiling ``mbit``, ``burst`` at either."""
        return ["rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", burst, "cburst", burst]

    def set_rate(self, side: int, mbit: float, *, burst: str = "32kb") -> None:
        """Change the limit of a throttle put on with ``exempt_ports`` in place:
        what is queued stays queued, the exempt ports still pass. A rate
        near zero (``0.008``: a kilobyte a second, with a small ``burst``)
        holds the limited traffic until the rate is raised again."""
        _run(*self._ip(side, "tc"), "class", "change", "dev", self.dev[side], "parent", "1:", "classid", "1:20",
             "htb", *self._limit(mbit, burst))

    def limited_bytes(self, side: int) -> int:
        """Bytes the limited class of a throttle put on with ``exempt_ports``
        has sent: what left end ``side`` but the exempt ports' segments
        (``tx_bytes`` counts those too: a control path's chatter, an HTTP
        API's answers)."""
        out = _run(*self._ip(side, "tc"), "-s", "class", "show", "dev", self.dev[side], "classid", "1:20")
        found = re.search(r"\bSent (\d+) bytes", out)  # tc here prints no JSON for classes
        if found is None:
            raise OSError(f"no throttle's limited class on {self.dev[side]}: {out.strip()!r}")
        return int(found[1])

    def unthrottle(self, side: int) -> None:
        _run(*self._ip(side, "tc"), "qdisc", "del", "dev", self.dev[side], "root")
        segs = self._gso_segs.pop(side, None)
        if segs is not None:
            _run(*self._ip(side), "link", "set", "dev", self.dev[side], "gso_max_segs", str(segs))

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
