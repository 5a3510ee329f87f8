"""A group of checks in a check process of its own: a group that hangs is
killed at its deadline with every process it started, one that crashes or
raises is a FAIL naming why; nothing hangs the selftest and no report is
lost. The deadlines here are short on purpose: the outcome is the same
however slowly the host runs (a slow start only means an earlier kill)."""

from __future__ import annotations

import time

import pytest

from rdma_kv.selftest import Status
from rdma_kv.selftest.supervise import run_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_group_that_hangs_is_killed_at_its_deadline_with_its_children():
    # The group hangs from its third check on, so the test takes its deadline:
    # 8 s starts a check process and its grandchild even on a loaded host.
    seen = []
    checks = run_group("selftest_groups:hang", {}, group="demo", deadline_s=8, grace_s=1, on_check=seen.append)
    assert checks == seen
    names = [c.name for c in checks]
    if names == ["demo"]:  # this host was too slow to even start it within 8 s: killed all the same
        assert checks[0].status is Status.FAIL and "did not finish within 8 s" in checks[0].detail
        return
    assert names == ["demo.first", "demo.grandchild", "demo.hangs"]
    assert checks[2].status is Status.FAIL
    assert "did not finish within 8 s (+1 s grace): the check process and its children were killed" in checks[2].detail
    pid = checks[1].figures["pid"]
    end = time.monotonic() + 60  # bounded: init reaps the orphan when it gets to it
    while not gone(pid) and time.monotonic() < end:
        time.sleep(0.1)
    assert gone(pid), f"the grandchild {pid} outlived its check process"


def test_a_group_that_crashes_is_a_fail_naming_the_signal_and_what_it_printed():
    (check,) = run_group("selftest_groups:crash", {}, group="demo", deadline_s=120)
    assert check.name == "demo.crashes" and check.status is Status.FAIL
    assert "the check process died (killed by signal SIGSEGV)" in check.detail
    assert "something the check process said before it died" in check.detail


def test_a_group_that_raises_is_a_fail_naming_the_exception():
    (check,) = run_group("selftest_groups:raises", {"value": 7}, group="demo", deadline_s=120)
    assert check.name == "demo.raises" and check.status is Status.FAIL
    assert check.detail.startswith("unexpected ValueError: bad value 7")

