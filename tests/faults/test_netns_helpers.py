"""The namespace helpers themselves (``rdma_kv.harness.netns``): clear
refusals, and no namespace left behind when building a link fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rdma_kv.harness import netns


def test_unavailable_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "network namespaces need root"


def test_unavailable_without_iproute2(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert "'tc'" in netns.unavailable()


def test_prefix_must_fit_an_interface_name():
    with pytest.raises(ValueError, match="too long for an interface name"):
        netns.VethLink("x" * 13, "10.213.9")


def test_enter_a_missing_namespace_changes_nothing():
    before = os.readlink("/proc/self/ns/net")
    with pytest.raises(FileNotFoundError):
        netns.enter(f"rkv-missing-{os.getpid()}")
    assert os.readlink("/proc/self/ns/net") == before


def test_a_failed_link_leaves_no_namespace_behind():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    prefix = f"rq{os.getpid() % 10**6}"
    taken = f"{prefix}-b"
    subprocess.run(["ip", "netns", "add", taken], check=True, timeout=20)
    try:
        with pytest.raises(OSError, match=taken):
            netns.VethLink(prefix, "10.213.9")  # the second namespace exists already
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
        assert f"{prefix}-a" not in names, "the first namespace was left behind"
    finally:
        subprocess.run(["ip", "netns", "del", taken], timeout=20)


def test_link_counts_bytes_and_goes_down_and_up():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    with netns.VethLink(f"rt{os.getpid() % 10**6}", "10.213.9") as link:
        state = lambda side: subprocess.run(  # noqa: E731
            ["ip", "-n", link.ns[side], "-br", "link", "show", link.dev[side]],
            capture_output=True, text=True, timeout=20).stdout.split()[1]
        before = link.tx_bytes(0)
        send = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                f"s.sendto(b'x' * 1000, ({link.addr[1]!r}, 9))")
        subprocess.run(["ip", "netns", "exec", link.ns[0], sys.executable, "-c", send], check=True, timeout=30)
        deadline = time.monotonic() + 5  # the datagram leaves once ARP resolves
        while link.tx_bytes(0) < before + 1000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.tx_bytes(0) >= before + 1000
        assert state(0) == "UP"
        link.set_link(0, False)
        assert state(0) == "DOWN"
        link.set_link(0, True)
        assert state(0) in ("UP", "LOWERLAYERDOWN")  # carrier returns asynchronously
        link.throttle(0, 16)
        link.unthrottle(0)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert link.ns[0] not in names and link.ns[1] not in names
