"""A peer Agent in a child process (multiprocessing ``spawn``), driven over a
pipe, and the parent's handle on it.

Rendezvous is the pipe alone: the child sends its metadata once its Agent is
up, then answers one command at a time. A child failure comes back as its
formatted traceback and is raised in the parent as ``ChildError``; every
wait for an answer is bounded, and a child that does not answer, or dies, is
reported with its exit code. The child imports numpy and rdma_kv only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from typing import Any

from transport_helpers import collect_notifications, pattern, wait_until

ANSWER_S = 30.0


class ChildError(RuntimeError):
    """The child raised (its traceback is in the message) or died."""


# -- the child ------------------------------------------------------------------------


def serve(conn: Any, name: str, env: dict[str, str], sizes: list[int], seed: int) -> None:
    """Child main: an Agent with one registered buffer per entry of ``sizes``
    (filled with ``pattern(seed + i)``), serving commands until "close"."""
    try:
        # Before the Agent: UCX reads UCX_* variables when the context is made.
        os.environ.update(env)
        import numpy as np

        from rdma_kv.transport import Agent, AgentConfig, DescList

        bufs = [pattern(seed + i, n) for i, n in enumerate(sizes)]
        agent = Agent(name, AgentConfig(progress="thread"))
        for buf in bufs:
            agent.register(buf)
        conn.send(("ok", (agent.metadata(), [b.ctypes.data for b in bufs], os.getpid())))

        def fill(region: int, fill_seed: int) -> None:
            bufs[region][:] = pattern(fill_seed, bufs[region].nbytes)

        def notifications(expected: list[bytes], sentinel: bytes, timeout_s: float) -> list[tuple[str, bytes]]:
            return [(n.peer, n.payload) for n in collect_notifications(agent, expected, sentinel, timeout_s)]

        def read_with_notifications(peer: str, remote_addr: int, nbytes: int, payloads: list[bytes]) -> None:
            local = DescList([bufs[0].ctypes.data], nbytes)
            remote = DescList([remote_addr], nbytes)
            # The last payload is the reader's sentinel: posted once every other
            # read completed (transfers on different workers complete, and
            # notify, in any order).
            xfers = [agent.read(peer, local, remote, notify=p) for p in payloads[:-1]]
            for x in xfers:
                x.wait(ANSWER_S)
            agent.read(peer, local, remote, notify=payloads[-1]).wait(ANSWER_S)

        commands = {
            "add_peer": agent.add_peer,
            "snapshot": lambda region: bytes(bufs[region]),
            "fill": fill,
            "notifications": notifications,
            "read_with_notifications": read_with_notifications,
            "inflight": lambda: agent.inflight,
            "ping": lambda: np.__version__,
        }
        while True:
            cmd, args = conn.recv()
            if cmd == "close":
                agent.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", commands[cmd](*args)))
    except BaseException:  # noqa: BLE001 -- forwarded to the parent, which raises it
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass


# -- the parent's handle -------------------------------------------------------------------


class Child:
    """Start ``serve`` in a spawned process and talk to it."""

    def __init__(self, name: str, env: dict[str, str], sizes: list[int], seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child_conn, name, env, sizes, seed),
                                name=f"rdma-kv-test-{name}", daemon=True)
        self.proc.start()
        child_conn.close()  # so that the child's death reads as EOF here
        try:
            self.metadata, self.addrs, self.pid = self._answer("start-up", 60.0)
        except BaseException:
            self.terminate()
            raise

    def _answer(self, what: str, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise ChildError(f"child {self.name!r} did not answer {what} within {timeout_s} s "
                             f"(alive={self.proc.is_alive()}, exitcode={self.proc.exitcode})")
        try:
            tag, value = self.conn.recv()
        except EOFError:
            self.proc.join(5.0)
            raise ChildError(f"child {self.name!r} died during {what} (exitcode {self.proc.exitcode})") from None
        if tag == "error":
            raise ChildError(f"child {self.name!r} failed during {what}; its traceback:\n{value}")
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = ANSWER_S) -> Any:
        self.conn.send((cmd, args))
        return self._answer(cmd, timeout_s)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap (bounded)."""
        self.signal(signal.SIGKILL)
        self.proc.join(10.0)
        if self.proc.is_alive():
            raise ChildError(f"child {self.name!r} survived SIGKILL for 10 s")

    def stop(self) -> None:
        """SIGSTOP, returning once the kernel reports the child stopped."""
        self.signal(signal.SIGSTOP)
        wait_until(lambda: self._state() in ("T", "t"), 10.0, f"SIGSTOP of child {self.name!r}")

    def _state(self) -> str:
        with open(f"/proc/{self.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def close(self) -> None:
        """Ask the child to close its Agent and exit; kill it if it does not."""
        try:
            if self.proc.is_alive():
                self.call("close", timeout_s=15.0)
                self.proc.join(10.0)
        finally:
            self.terminate()

    def terminate(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # also ends a SIGSTOPped child
            self.proc.join(10.0)
        self.conn.close()
