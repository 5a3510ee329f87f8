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
    manager; closing deletes both namespaces and with them the pair."""

    def __init__(self, prefix: str, subnet: str) -> None:
        if len(prefix) > 12:
            raise ValueError(f"prefix {prefix!r} too long for an interface name (max 12)")
        self.ns = (f"{prefix}-a", f"{prefix}-b")
        self.dev = (f"{prefix}a", f"{prefix}b")
        self.addr = (f"{subnet}.1", f"{subnet}.2")
        made: list[str] = []
        try:
            for ns in self.ns:
                _run("ip", "netns", "add", ns)
                made.append(ns)
            _run("ip", "-n", self.ns[0], "link", "add", self.dev[0], "type", "veth",
                 "peer", "name", self.dev[1], "netns", self.ns[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            for ns in made:
                _delete(ns)
            raise

    def set_link(self, side: int, up: bool) -> None:
        """Take one end of the pair (0 or 1) down or bring it back up."""
        _run("ip", "-n", self.ns[side], "link", "set", self.dev[side], "up" if up else "down")

    def throttle(self, side: int, mbit: float) -> None:
        """Limit what leaves end ``side`` to ``mbit`` megabits per second (tbf)."""
        _run("tc", "-n", self.ns[side], "qdisc", "replace", "dev", self.dev[side], "root", "tbf",
             "rate", f"{mbit}mbit", "burst", "32kb", "latency", "10s")

    def unthrottle(self, side: int) -> None:
        _run("tc", "-n", self.ns[side], "qdisc", "del", "dev", self.dev[side], "root")

    def tx_bytes(self, side: int) -> int:
        """Bytes end ``side`` has sent (from its counters)."""
        out = _run("ip", "-n", self.ns[side], "-s", "-j", "link", "show", self.dev[side])
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        for ns in self.ns:
            _delete(ns)

    def __enter__(self) -> VethLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
