"""Stopping a process for a test, for real: SIGSTOP, then wait until every
thread is stopped.

``kill`` returns with the stop only queued: the group stop begins when one
thread of the process takes the signal, and until then its other threads
run on. On a loaded host that is milliseconds: a producer answered a
HANDSHAKE sent 2 ms after the kill (the test pinned to one CPU beside a
busy loop; its threads all reached state T 2.6 ms after it), and the loads
meant to meet a stopped producer read and waited on their CONFIRM instead
(docs/reliability.md, "Reviews of flaky tests").
"""

from __future__ import annotations

import os
import signal
import time


def _running_threads(pid: int) -> list[tuple[str, str]]:
    running = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []  # the process ended
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        if state not in ("T", "t", "Z", "X"):
            running.append((f"{pid}/{tid}", state))
    return running


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid:  # (state, ppid, pgrp, ...)
            members.append(int(entry))
    return members


def _wait_stopped(pids: list[int], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        running = [t for pid in pids for t in _running_threads(pid)]
        if not running:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: threads {running} not stopped {timeout_s} s after SIGSTOP")
        time.sleep(0.0005)


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP process ``pid``; return once every thread of it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    _wait_stopped([pid], f"process {pid}", timeout_s)


def stop_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP process group ``pgid``; return once every thread of every
    process in it is stopped."""
    os.killpg(pgid, signal.SIGSTOP)
    _wait_stopped(_group(pgid), f"process group {pgid}", timeout_s)
