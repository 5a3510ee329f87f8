"""Check groups that misbehave, for tests/selftest/test_supervise.py: the
spawned check process imports them by name (tests/selftest is on the
sys.path a spawned child inherits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rdma_kv.selftest.report import Check


def hang(params, sink) -> None:
    """Report a check, start a grandchild (as the producer peer is started),
    report its pid, then hang in the next check."""
    sink.begin("demo.first")
    sink.add(Check.passed("demo.first", "done"))
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    sink.add(Check.passed("demo.grandchild", "started", pid=grandchild.pid))
    sink.begin("demo.hangs")
    while True:
        time.sleep(1)


def crash(params, sink) -> None:
    sink.begin("demo.crashes")
    print("UCX  ERROR something the check process said before it died", flush=True)  # its fd 1: the log
    os.kill(os.getpid(), signal.SIGSEGV)


def raises(params, sink) -> None:
    sink.begin("demo.raises")
    raise ValueError(f"bad value {params['value']}")
