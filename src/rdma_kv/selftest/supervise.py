"""A group of checks in a process of its own, under a deadline.

Each group that moves data (host reads, CUDA, NICs) runs in a spawned
*check process*. It starts a session of its own (``os.setsid``), so that it
and every process it starts (the producer peer) are killed together; it
sends ``begin`` before each check and the check's record after it. The
supervisor waits on the pipe until the group's deadline, then kills the
session and reports the check that was running as FAIL. A check process
that dies (a crash in UCX or the CUDA driver) is a FAIL naming its exit
code or signal and UCX's last output, never a lost report.

UCX prints its log and, with ``PROTO_INFO=y``, its protocol tables on
stdout: the check process points its fd 1 at a file (``UcxLog``), which
the checks read and the supervisor quotes on a crash.

A group is a function ``group(params: dict, sink: Sink) -> None`` named as
``module:function``; ``params`` is JSON (the spawn message), with
``ucx_log`` added (the path fd 1 points at). The same
function runs in-process with a ``Collect`` sink (tests).

May import: the standard library, rdma_kv.errors, rdma_kv.bench.runner
(the JSON control channel), rdma_kv.selftest.report.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rdma_kv.bench.runner import BenchError, Channel
from rdma_kv.selftest.report import Check, from_wire

__all__ = ["Collect", "Deadline", "Sink", "UcxLog", "run_group"]

# After the deadline the check process gets this long to report its own
# timeout (its inner waits end at the deadline) before it is killed.
GRACE_S = 15.0
JOIN_S = 5.0


class Deadline:
    """A point in time every wait of a check is bounded by."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (at least a millisecond, so a wait still polls once)."""
        return max(0.001, self._end - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self._end


class Sink(Protocol):
    def begin(self, name: str) -> None: ...

    def add(self, check: Check) -> None: ...


class Collect:
    """A sink that keeps the checks (in-process runs, tests)."""

    def __init__(self) -> None:
        self.checks: list[Check] = []
        self.current: str | None = None

    def begin(self, name: str) -> None:
        self.current = name

    def add(self, check: Check) -> None:
        self.checks.append(check)


class _PipeSink:
    """The check process's end: ``current`` is the check that began last."""

    def __init__(self, chan: Channel, group: str) -> None:
        self._chan = chan
        self.group = self.current = group

    def begin(self, name: str) -> None:
        self.current = name
        self._chan.send({"type": "begin", "name": name})

    def add(self, check: Check) -> None:
        self.current = self.group
        self._chan.send({"type": "check", "check": check.to_dict()})


class UcxLog:
    """The file a check process's fd 1 points at (UCX's stdout): ``take()``
    returns what was written since the last call."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def take(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return ""
        self._offset += len(data)
        return data.decode(errors="replace")

    def tail(self, lines: int = 6) -> str:
        try:
            text = self.path.read_bytes().decode(errors="replace")
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _group_entry(conn: Any, entry: str, log_path: str) -> None:
    """Body of a check process: own session, fd 1 to the log, run the group."""
    os.setsid()
    chan = Channel(conn, "supervisor")
    chan.send({"type": "session", "pgid": os.getpgid(0)})
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.close(fd)
    sink = _PipeSink(chan, entry)
    try:
        params, _ = chan.expect("start")
        sink.group = sink.current = str(params["group"])
        module, func = entry.split(":")
        group: Callable[[dict[str, Any], Sink], None] = getattr(importlib.import_module(module), func)
        group(params["params"], sink)
    except BaseException as exc:  # report it as the running check's failure, then exit
        last = traceback.format_exc().strip().splitlines()[-3:]
        sink.add(Check.failed(sink.current, f"unexpected {type(exc).__name__}: {exc} ({' / '.join(last)})"))
    finally:
        try:
            chan.send({"type": "done"})
        except (OSError, ValueError):
            pass
        conn.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_group(entry: str, params: dict[str, Any], *, group: str, deadline_s: float,
              on_check: Callable[[Check], None] | None = None, grace_s: float = GRACE_S) -> list[Check]:
    """Run group ``entry`` (``module:function``) in a check process and
    return its checks. At ``deadline_s`` (plus a grace for the process to
    report its own timeouts) the process and its children are killed and
    the check that was running, or ``group`` itself, FAILs."""
    ctx = mp.get_context("spawn")
    checks: list[Check] = []

    def add(check: Check) -> None:
        checks.append(check)
        if on_check is not None:
            on_check(check)

    with tempfile.TemporaryDirectory(prefix="rdma-kv-selftest-") as tmp:
        log = UcxLog(Path(tmp) / "ucx-stdout.log")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_group_entry, args=(child, entry, str(log.path)),
                           name=f"rdma-kv-selftest-{group}", daemon=False)  # it starts the producer peer
        proc.start()
        child.close()
        chan = Channel(parent, f"check process {group!r}")
        pgid: int | None = None
        current = group
        end = time.monotonic() + deadline_s + grace_s
        try:
            chan.send({"type": "start", "group": group, "params": {**params, "ucx_log": str(log.path)}})
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    add(Check.failed(current, f"did not finish within {deadline_s:.0f} s (+{grace_s:.0f} s "
                                     "grace): the check process and its children were killed"
                                     + _ucx_said(log)))
                    break
                if not chan.poll(min(left, 1.0)):
                    if not proc.is_alive() and not chan.poll(0):
                        add(Check.failed(current, f"the check process died ({_describe_exit(proc.exitcode)})"
                                         + _ucx_said(log)))
                        break
                    continue
                try:
                    msg, _ = chan.recv()
                except BenchError:  # the pipe closed: the process is gone
                    proc.join(JOIN_S)
                    add(Check.failed(current, f"the check process died ({_describe_exit(proc.exitcode)})"
                                     + _ucx_said(log)))
                    break
                kind = msg.get("type")
                if kind == "session" and msg.get("pgid") == proc.pid:
                    pgid = proc.pid
                elif kind == "begin":
                    current = str(msg["name"])
                elif kind == "check":
                    add(from_wire(msg["check"]))
                    current = group
                elif kind == "done":
                    break
        finally:
            _reap(proc, pgid)
            parent.close()
    return checks


def _ucx_said(log: UcxLog) -> str:
    tail = log.tail()
    return f"; UCX's last output: {tail}" if tail else ""


def _reap(proc: Any, pgid: int | None) -> None:
    """Kill what is left of the check process's session (a producer peer
    outlives a check process that was killed) and reap the process."""
    proc.join(JOIN_S if pgid is None else 1.0)
    if pgid is not None and pgid != os.getpgid(0):  # never our own group
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.is_alive():
        proc.kill()
    proc.join(JOIN_S)
