"""Two-process machinery shared by every benchmark backend.

Owns: the control channel between the runner and its children (JSON
headers plus optional raw blobs over ``multiprocessing`` pipes: no pickle
of peer data, no sleeps, no files), the child entry point that forwards
tracebacks, ``run_pair`` (target + reader children driven rep by rep, each
step bounded by a timeout, children always reaped), and the data pattern
targets fill and readers verify.

Protocol (messages are dicts with a ``type``)::

    runner -> target : start(workload)          target -> runner : ready(info, blob)
    runner -> reader : start(workload, options) then peer(info, blob)
                                                reader -> runner : ready
    per rep r        : target fill(r) -> filled ; reader rep(r) -> rep_result(record)
    finally          : close -> closed (both)
    on any exception : error(traceback)

A backend provides ``target(chan, start_msg)`` and ``reader(chan, start_msg)``
as importable module-level functions. Imports numpy, the stdlib and
``rdma_kv.errors`` / ``rdma_kv.bench.workloads`` only.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import socket
import time
import traceback
from typing import Any

import numpy as np

from rdma_kv.bench.workloads import Batch, Workload
from rdma_kv.errors import RdmaKVError


class BenchError(RdmaKVError, RuntimeError):
    """A benchmark backend failed; the message carries the child's traceback."""


class BackendUnavailableError(BenchError, ImportError):
    """A backend's optional dependency is missing (reported as skipped)."""


class VerificationError(BenchError, AssertionError):
    """Bytes read differ from the bytes the target wrote."""


Message = dict[str, Any]


class Channel:
    """One end of a control pipe: JSON header, then an optional raw blob."""

    def __init__(self, conn: Any, peer: str) -> None:
        self._conn = conn
        self.peer = peer

    def send(self, msg: Message, blob: bytes | None = None) -> None:
        header = dict(msg, has_blob=blob is not None)
        self._conn.send_bytes(json.dumps(header).encode())
        if blob is not None:
            self._conn.send_bytes(blob)

    def poll(self, timeout_s: float) -> bool:
        """True once a message is waiting (within ``timeout_s``)."""
        return bool(self._conn.poll(timeout_s))

    def recv(self, timeout_s: float | None = None) -> tuple[Message, bytes | None]:
        if timeout_s is not None and not self._conn.poll(timeout_s):
            raise TimeoutError(f"no message from {self.peer} within {timeout_s:.0f} s")
        try:
            msg = json.loads(self._conn.recv_bytes())
            blob = self._conn.recv_bytes() if msg.pop("has_blob") else None
        except (EOFError, ConnectionError) as exc:
            raise BenchError(f"{self.peer} closed its pipe ({type(exc).__name__}): the process died") from None
        if msg.get("type") == "error":
            error = BackendUnavailableError if msg.get("unavailable") else BenchError
            raise error(f"{self.peer} failed:\n{msg['traceback']}")
        return msg, blob

    def expect(self, kind: str, timeout_s: float | None = None) -> tuple[Message, bytes | None]:
        msg, blob = self.recv(timeout_s)
        if msg.get("type") != kind:
            raise BenchError(f"{self.peer}: expected {kind!r}, got {msg.get('type')!r}")
        return msg, blob


def child_entry(conn: Any, entry: str, role: str) -> None:
    """Spawned process body: run ``module:function`` and forward any failure."""
    chan = Channel(conn, "runner")
    try:
        module_name, func_name = entry.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        start, _ = chan.expect("start")
        func(chan, start)
    except BaseException as exc:  # forward everything, then exit non-zero
        try:
            chan.send({
                "type": "error",
                "role": role,
                "unavailable": isinstance(exc, ImportError),
                "traceback": traceback.format_exc(),
            })
        except (OSError, ValueError):
            pass
        raise SystemExit(1) from None
    finally:
        conn.close()


class Child:
    """A spawned child and the runner's end of its pipe; always reaped."""

    def __init__(self, ctx: Any, entry: str, role: str) -> None:
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.role = role
        self.process = ctx.Process(
            target=child_entry, args=(child_conn, entry, role), name=f"bench-{role}", daemon=True
        )
        self.process.start()
        child_conn.close()
        self.chan = Channel(parent_conn, role)
        self._conn = parent_conn

    def close(self, timeout_s: float) -> None:
        """Reap the child: at most ``timeout_s`` for it to exit, then
        terminate, then kill. The runner stops writing to its pipe first
        (the duplex pipe is a socket pair: shut down for writing, still open
        for reading): a child still waiting for a command (its peer failed)
        reads the end of the pipe and exits at once, where it waited out
        ``timeout_s``, and a child told to close can still answer."""
        try:
            with socket.socket(fileno=os.dup(self._conn.fileno())) as end:
                end.shutdown(socket.SHUT_WR)
        except OSError:  # closed already, or the child's end is gone
            pass
        if self.process.is_alive():
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()


def run_pair(
    backend_module: str,
    workload: Workload,
    reps: int,
    options: dict[str, Any] | None = None,
    setup_timeout_s: float = 180.0,
    rep_timeout_s: float = 120.0,
) -> tuple[list[Message], Message]:
    """Run ``reps`` repetitions of a two-process backend; return the reader's
    per-rep records and its ready message (backend configuration)."""
    ctx = mp.get_context("spawn")
    start = {"type": "start", "workload": workload.to_dict(), "options": options or {}}
    children: list[Child] = []
    try:
        target = Child(ctx, f"{backend_module}:target", "target")
        children.append(target)
        reader = Child(ctx, f"{backend_module}:reader", "reader")
        children.append(reader)
        target.chan.send(start)
        reader.chan.send(start)
        info, blob = target.chan.expect("ready", setup_timeout_s)
        reader.chan.send(dict(info, type="peer"), blob)
        config, _ = reader.chan.expect("ready", setup_timeout_s)
        records = []
        for rep in range(reps):
            target.chan.send({"type": "fill", "rep": rep})
            target.chan.expect("filled", rep_timeout_s)
            reader.chan.send({"type": "rep", "rep": rep})
            record, _ = reader.chan.expect("rep_result", rep_timeout_s)
            records.append(record)
        for child in (reader, target):  # reader first: it holds the peer's rkeys
            child.chan.send({"type": "close"})
            child.chan.expect("closed", setup_timeout_s)
        return records, config
    finally:
        for child in reversed(children):
            child.close(timeout_s=10)


def serve_target(chan: Channel, fill: Any, close: Any, idle: Any = None, idle_s: float = 0.001) -> None:
    """Target command loop: ``fill(rep)`` on request until ``close``. With
    ``idle``, a target without a progress thread of its own calls it every
    ``idle_s`` while it waits for a command (asleep in between, never
    spinning), so that its transport still progresses (wire-up, notifications)."""
    while True:
        if idle is not None:
            while not chan.poll(idle_s):
                idle()
        msg, _ = chan.recv()
        if msg["type"] == "fill":
            fill(int(msg["rep"]))
            chan.send({"type": "filled", "rep": msg["rep"]})
        elif msg["type"] == "close":
            close()
            chan.send({"type": "closed"})
            return
        else:
            raise BenchError(f"target: unexpected message {msg['type']!r}")


def await_notifications(poll: Any, expected: list[bytes], timeout_s: float, who: str) -> None:
    """Target side of ``--notify``: ``poll()`` returns the payloads received
    so far; wait (bounded) until they are exactly ``expected``, in any order."""
    end = time.monotonic() + timeout_s
    got = sorted(poll())
    while len(got) < len(expected) and time.monotonic() < end:
        time.sleep(0.01)
        got = sorted(poll())
    if got != sorted(expected):
        raise BenchError(f"{who}: expected one notification per repetition ({len(expected)}), got {len(got)} "
                         f"after {timeout_s} s: missing {sorted(set(expected) - set(got))[:5]}, "
                         f"extra {[g for g in got if g not in expected][:5]}")


def serve_reader(chan: Channel, run_rep: Any, close: Any) -> None:
    """Reader command loop: ``run_rep(rep) -> record`` until ``close``."""
    while True:
        msg, _ = chan.recv()
        if msg["type"] == "rep":
            record = run_rep(int(msg["rep"]))
            chan.send(dict(record, type="rep_result", rep=msg["rep"]))
        elif msg["type"] == "close":
            close()
            chan.send({"type": "closed"})
            return
        else:
            raise BenchError(f"reader: unexpected message {msg['type']!r}")


# --- data pattern --------------------------------------------------------------
#
# Word w of the target buffer holds w * _MUL + salt(seed, rep) (mod 2**64):
# every 8-byte word differs from its neighbours and from every other rep, so
# a shifted, stale, duplicated or missing read cannot pass verification.

_MUL = np.uint64(0x9E3779B97F4A7C15)
_CHUNK_WORDS = 1 << 22  # 32 MiB of uint64 per numpy pass


def pattern_salt(seed: int, rep: int) -> np.uint64:
    return np.uint64(np.random.default_rng([seed, rep, 0x5A17]).integers(0, 2**63))


class PatternFiller:
    """Fills a target buffer with rep ``r``'s pattern; later reps cost one add."""

    def __init__(self, buf: np.ndarray, seed: int) -> None:
        self._words = buf.view(np.uint64)
        self._seed = seed
        self._salt: np.uint64 | None = None

    def fill(self, rep: int) -> None:
        salt = pattern_salt(self._seed, rep)
        words = self._words
        if self._salt is None:
            for start in range(0, words.size, _CHUNK_WORDS):
                stop = min(start + _CHUNK_WORDS, words.size)
                chunk = words[start:stop]
                chunk[:] = np.arange(start, stop, dtype=np.uint64)
                np.multiply(chunk, _MUL, out=chunk)
                np.add(chunk, salt, out=chunk)
        else:
            delta = np.uint64((int(salt) - int(self._salt)) % 2**64)
            np.add(words, delta, out=words)  # wraps mod 2**64: w*MUL + old + delta
        self._salt = salt


def verify(local: np.ndarray, p: Batch, what: str = "") -> None:
    """Raise VerificationError unless every descriptor of ``p`` landed in
    ``local`` holding the target's pattern for ``p.rep``."""
    salt = pattern_salt(p.workload.seed, p.rep)
    words = local.view(np.uint64)
    lengths = p.lengths
    with np.errstate(over="ignore"):
        if lengths.size > 1 and np.all(lengths == lengths[0]):
            row_words = int(lengths[0]) // 8
            rows = words.reshape(-1, row_words)
            step = max(1, _CHUNK_WORDS // row_words)
            col = np.arange(row_words, dtype=np.uint64)
            for i in range(0, lengths.size, step):
                got = rows[p.local_slots[i : i + step]]
                want = (p.remote_slots[i : i + step].astype(np.uint64)[:, None] * np.uint64(row_words) + col) * _MUL + salt
                if not np.array_equal(got, want):
                    bad = i + int(np.flatnonzero((got != want).any(axis=1))[0])
                    _fail(p, bad, what)
            return
        for i in range(lengths.size):
            lo, ro, n = int(p.local_offsets[i]) // 8, int(p.remote_offsets[i]) // 8, int(lengths[i]) // 8
            for s in range(0, n, _CHUNK_WORDS):
                e = min(n, s + _CHUNK_WORDS)
                want = np.arange(ro + s, ro + e, dtype=np.uint64) * _MUL + salt
                if not np.array_equal(words[lo + s : lo + e], want):
                    _fail(p, i, what)


def _fail(p: Batch, index: int, what: str) -> None:
    raise VerificationError(
        f"{what or 'reader'}: {p.workload.name} rep {p.rep}: descriptor {index} "
        f"(local offset {int(p.local_offsets[index])}, remote offset {int(p.remote_offsets[index])}, "
        f"{int(p.lengths[index])} bytes) does not hold the target's bytes"
    )
