"""The namespace helpers themselves (``rdma_kv.harness.netns``): clear
refusals, and no namespace left behind when building a link fails."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

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
        gso_segs = lambda: json.loads(subprocess.run(  # noqa: E731
            ["ip", "-n", link.ns[0], "-d", "-j", "link", "show", link.dev[0]],
            capture_output=True, text=True, timeout=20).stdout)[0]["gso_max_segs"]
        segs = gso_segs()
        link.throttle(0, 16)
        assert gso_segs() == 1  # shaped per segment while throttled ...
        link.unthrottle(0)
        assert gso_segs() == segs  # ... and as before after
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert link.ns[0] not in names and link.ns[1] not in names


def test_host_end_reaches_the_namespace_and_leaves_nothing_behind():
    """``host_end=True``: the pair's second end is here, so this process
    talks to a server inside the first namespace at its address; closing
    takes the end out here away at once."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    serve = ("import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
             "print(s.getsockname()[1], flush=True); c, _ = s.accept(); c.sendall(b'inside'); c.close()")
    with netns.VethLink(f"rh{os.getpid() % 10**6}", "10.213.9", host_end=True) as link:
        assert link.ns[1] is None
        here = subprocess.run(["ip", "-br", "addr", "show", link.dev[1]], capture_output=True, text=True,
                              timeout=20).stdout
        assert link.addr[1] in here, here
        server = subprocess.Popen(["ip", "netns", "exec", link.ns[0], sys.executable, "-c", serve],
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            with socket.create_connection((link.addr[0], port), timeout=10) as conn:
                conn.settimeout(10)
                assert conn.recv(16) == b"inside"
        finally:
            server.kill()
            server.wait(10)
    left = subprocess.run(["ip", "-br", "link", "show"], capture_output=True, text=True, timeout=20).stdout
    assert link.dev[1] not in left, left


@pytest.fixture
def two_ports() -> Iterator[tuple[netns.VethLink, int, int]]:
    """A pair with its first end in a namespace, and a server there on two
    ports, each answering one connection with 50,000 bytes (both at once):
    the link and the ports."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    serve = ("import socket, threading\n"
             "def one(s):\n"
             "    c, _ = s.accept(); c.sendall(b'x' * 50000); c.close()\n"
             "socks = [socket.socket() for _ in range(2)]\n"
             "for s in socks: s.bind(('0.0.0.0', 0)); s.listen()\n"
             "print(*[s.getsockname()[1] for s in socks], flush=True)\n"
             "ts = [threading.Thread(target=one, args=(s,)) for s in socks]\n"
             "for t in ts: t.start()\n"
             "for t in ts: t.join()\n")
    with netns.VethLink(f"rc{os.getpid() % 10**6}", "10.213.9", host_end=True) as link:
        server = subprocess.Popen(["ip", "netns", "exec", link.ns[0], sys.executable, "-c", serve],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            first, second = map(int, server.stdout.readline().split())
            yield link, first, second
        finally:
            server.kill()
            server.wait(10)


def drain(conn: socket.socket, timeout_s: float) -> int:
    """Bytes read from ``conn`` until it closes, or ``timeout_s`` passes without any."""
    conn.settimeout(timeout_s)
    got = 0
    try:
        while chunk := conn.recv(65536):
            got += len(chunk)
    except TimeoutError:
        pass
    return got


def test_a_throttle_lets_exempt_ports_pass_on_their_own_class(two_ports: tuple[netns.VethLink, int, int]):
    """``throttle(..., exempt_ports=...)``: TCP segments from those ports
    leave by the unlimited class, everything else by the limited one (read
    off the classes' byte counters, not timed)."""
    link, exempt, limited = two_ports
    link.throttle(0, 2, exempt_ports=(exempt,))
    for port in (exempt, limited):
        with socket.create_connection((link.addr[0], port), timeout=10) as conn:
            assert drain(conn, 20) == 50000

    def classes() -> dict[str, int]:
        out = subprocess.run(["tc", "-n", link.ns[0], "-s", "class", "show", "dev", link.dev[0]],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        # tc here has no JSON for classes: "class htb 1:10 root ...\n Sent 50330 bytes ..."
        return {m[1]: int(m[2]) for m in re.finditer(r"class htb (\S+) .*\n Sent (\d+) bytes", out)}

    # The limited class also carries what the namespace's kernel sends on its
    # own after the answers (the last ACK of a closed connection, IPv6
    # neighbour discovery): its counter may move between two readings. Compare
    # limited_bytes with a reading of all classes taken while it stood still.
    deadline = time.monotonic() + 20
    while True:
        before = link.limited_bytes(0)
        sent = classes()
        after = link.limited_bytes(0)
        if before == after or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sent["1:10"] >= 50000 and 50000 <= sent["1:20"] < 2 * 50000, sent
    assert before == sent["1:20"] == after


def test_a_rate_near_zero_holds_the_limited_traffic_until_raised(two_ports: tuple[netns.VethLink, int, int]):
    """A throttle of a kilobyte a second with a 16 KiB burst: of a
    50,000-byte answer about the burst arrives (in 1.5 s), while an exempt
    port still answers in full; ``set_rate`` raises it, the rest arrives,
    nothing lost."""
    link, exempt, limited = two_ports
    link.throttle(0, 0.008, exempt_ports=(exempt,), burst="16kb")
    with socket.create_connection((link.addr[0], limited), timeout=10) as held:
        got = drain(held, 1.5)
        assert 12000 < got < 40000, f"{got} bytes came through a kilobyte-a-second class with a 16 KiB burst"
        with socket.create_connection((link.addr[0], exempt), timeout=10) as free:
            assert drain(free, 20) == 50000
        link.set_rate(0, 2)
        # ~0.2 s at 2 Mbit/s; a class left in debt by the hold (GSO packets) took 12 s
        got += drain(held, 5)
        assert got == 50000
