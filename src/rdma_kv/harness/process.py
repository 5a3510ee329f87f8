"""An engine in a child process, driven over a pipe.

Owns :class:`EngineProcess` (parent side) and the child's loop: step the
engine while it has work, apply commands between steps, send each finished
request's :class:`~rdma_kv.harness.engine.RequestResult` back as a dict.
Every parent-side wait is bounded; a child's traceback is forwarded.

``netns``: run the child in that network namespace (``harness.netns``), a
separate host for partition tests.

Fault injection for tests (``faults``): ``gate_writes`` holds a push's
writes before they are posted (push mode, on the producer) until
``open_gate()``; ``gate_reads`` holds read
completions until ``open_gate()`` (so a test can act "while the reads are in
flight" deterministically), or, closed with ``close_gate(before_post=True)``,
the reads themselves before they are posted (a test acts before the
producer's blocks are read: a read's completion already includes the held
words' read chained behind it); ``idle_until_request`` does not step the
engine before its first request, as vLLM does not (its workers know no
lease epoch until then); the ``expire_leases`` command ends every lease
as its expiry would (after one step, which ships the grants of the
prefills that just finished; and once no read pin holds a lease, at most
the producer's ``read_timeout_s``: a pin holds its lease against expiry,
so a real expiry comes after it too), ``scribble_free`` overwrites
every free block (memory reuse) and ``unscribbled`` names the free blocks
written since (by nothing, if every transfer into them ended);
``forget_idle_peers`` prunes a decode's producer ranks as if each had gone
unused for ``idle_s`` (no load reading from it).

Children are forked from a ``multiprocessing`` fork server that imported
``rdma_kv.harness.engine`` (torch) once (``_context``): after the first, a
child starts in about 1 s instead of the 3 s of a fresh interpreter
importing torch, and tests start many. The fork server is a fresh
interpreter itself (started once per parent, at the first engine, whose
start also waits for its import) and has not loaded UCX. Each child takes
the parent's environment, working directory, stdout and stderr as they
are at its start, as a spawned child would (UCX reads its configuration
from the environment; a test that reads the engines' warnings from its own
stderr still sees them). What is read when an interpreter starts or when
torch is imported (``PYTHON*``, OpenMP threads) is the fork server's, as
it was at the first engine's start. If the preload cannot be imported
(rdma-kv not installed where the fork server looks), each child imports
torch itself: slower, not different.

Imports the standard library, torch (in the child) and ``rdma_kv.harness.engine``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any

from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.forked import ParentFd, adopt

__all__ = ["EngineProcess", "HarnessError"]

SCRIBBLE = 7
"""What ``scribble_free`` writes into every free block (and ``unscribbled`` looks for)."""


class HarnessError(RuntimeError):
    """The child engine failed, or did not answer in time."""


# --- fault injection: gate read completions -----------------------------------------------


class _Gate:
    def __init__(self) -> None:
        self.open = True
        self.before_post = False  # closed: reads are held before they are posted, not their completions
        self.lock = threading.Lock()
        self.held: list[tuple[Any, Any]] = []

    def set(self, is_open: bool, before_post: bool = False) -> None:
        with self.lock:
            self.open, self.before_post = is_open, before_post and not is_open
            held, self.held = (self.held, []) if is_open else ([], self.held)
        for fn, handle in held:
            fn(handle)


class _GatedHandle:
    def __init__(self, inner: Any, gate: _Gate) -> None:
        self._inner, self._gate = inner, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def add_done_callback(self, fn: Any) -> None:
        def gated(_: Any) -> None:
            with self._gate.lock:
                if not self._gate.open:
                    self._gate.held.append((fn, self))
                    return
            fn(self)

        self._inner.add_done_callback(gated)


class _Deferred:
    """A transfer held before it is posted: a push's writes (``gate_writes``:
    the producer answered RUNNING, nothing is on the wire yet, no
    notification), or reads (``gate_reads``, closed ``before_post``). Until
    it is posted it reads as a transfer that started when it was asked for
    and moved nothing; a post refused when the gate opens (the peer went
    meanwhile) fails it with that error, as a refused post would have."""

    def __init__(self, post: Any, gate: _Gate) -> None:
        self._post = post
        self._inner: Any = None
        self._error: BaseException | None = None
        self._asked = time.perf_counter()
        self._callbacks: list[Any] = []
        self._lock = threading.Lock()
        self._resolved = threading.Event()  # posted, or refused
        with gate.lock:
            if not gate.open:
                gate.held.append((lambda _: self._start(), self))
                return
        self._start()

    def _start(self) -> None:
        try:
            inner = self._post()
        except Exception as exc:
            with self._lock:
                self._error, callbacks, self._callbacks = exc, self._callbacks, []
            self._resolved.set()
            for fn in callbacks:
                fn(self)
            return
        with self._lock:
            self._inner, callbacks, self._callbacks = inner, self._callbacks, []
        self._resolved.set()
        for fn in callbacks:
            inner.add_done_callback(lambda _, fn=fn: fn(self))

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            return 0 if name in ("nbytes", "num_descs", "ops_posted", "post_s", "elapsed_s") else None
        return getattr(inner, name)

    @property
    def started(self) -> float:
        return self._asked if self._inner is None else float(self._inner.started)

    @property
    def error(self) -> BaseException | None:
        return self._error if self._inner is None else self._inner.error

    def done(self) -> bool:
        return self._error is not None or (self._inner is not None and self._inner.done())

    def wait(self, timeout_s: float | None = None) -> Any:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._resolved.wait(timeout_s):
            raise TimeoutError(f"a transfer held by the gate was not posted within {timeout_s} s")
        if self._error is not None:
            raise self._error
        self._inner.wait(None if end is None else max(0.0, end - time.monotonic()))
        return self

    def add_done_callback(self, fn: Any) -> None:
        with self._lock:
            if self._inner is None and self._error is None:
                self._callbacks.append(fn)
                return
        if self._inner is None:
            fn(self)
            return
        self._inner.add_done_callback(lambda _: fn(self))


class _GatedTransport:
    def __init__(self, inner: Any, gate: _Gate, reads: bool = True, writes: bool = False) -> None:
        self._inner, self._gate = inner, gate
        self._reads, self._writes = reads, writes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read_prepared(self, *args: Any, **kwargs: Any) -> Any:
        if self._reads and self._gate.before_post:
            return _Deferred(lambda: self._inner.read_prepared(*args, **kwargs), self._gate)
        xfer = self._inner.read_prepared(*args, **kwargs)
        return _GatedHandle(xfer, self._gate) if self._reads else xfer

    def write_prepared(self, *args: Any, **kwargs: Any) -> Any:
        if not self._writes:
            return self._inner.write_prepared(*args, **kwargs)
        return _Deferred(lambda: self._inner.write_prepared(*args, **kwargs), self._gate)


# --- the child -------------------------------------------------------------------------------


def _context() -> Any:
    """The fork server's context, its preload set before it first starts:
    only modules that start no thread and load no UCX (whose libraries read
    part of their configuration from the environment when loaded)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rdma_kv.harness.engine"])
    return ctx


def _child(conn: Any, config: dict[str, Any], shape: dict[str, Any], faults: dict[str, Any],
           netns: str | None, env: dict[str, str], cwd: str, out: int, err: int) -> None:
    try:
        # The parent's environment, directory and output now, not the fork
        # server's at its start (the parent may have redirected its output since).
        adopt(env, cwd, {1: out, 2: err})
        if netns is not None:
            from rdma_kv.harness.netns import enter

            enter(netns)  # before UCX or any thread starts
        # An engine process configures logging: warnings (a failed load and
        # why) reach stderr, tagged with the engine's name.
        logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {config.get('engine_id')} "
                            "%(levelname)s %(name)s: %(message)s")
        import torch

        from rdma_kv.connector import KVTransferConfig
        from rdma_kv.connector.rdma import agent_transport
        from rdma_kv.harness.engine import Engine

        torch.set_num_threads(1)
        gate = _Gate()
        kwargs: dict[str, Any] = {}
        if faults.get("gate_reads") or faults.get("gate_writes"):
            reads, writes = bool(faults.get("gate_reads")), bool(faults.get("gate_writes"))
            kwargs["transport_factory"] = lambda name, s: _GatedTransport(agent_transport(name, s), gate,
                                                                           reads, writes)
        engine = Engine(KVTransferConfig.from_dict(config), ModelShape(**shape),
                        connector_kwargs=kwargs or None, verify=faults.get("verify", True))
        def finished(result: Any) -> None:
            conn.send(("finished", _result_dict(result)))
            engine.results.pop(result.request_id, None)  # the parent keeps it: a long run stays flat

        engine.on_finished = finished
        port = getattr(engine.worker, "worker", None)
        conn.send(("ready", {"pid": os.getpid(), "port": port.side_channel_port if port else None}))
        stepped = not faults.get("idle_until_request")
        while True:
            while conn.poll():
                msg = conn.recv()
                op = msg[0]
                if op == "add":
                    stepped = True
                    engine.add_request(msg[1], msg[2], msg[3])
                elif op == "abort":
                    engine.abort_request(msg[1])
                elif op == "gate":
                    gate.set(*msg[1:])
                    conn.send(("reply", True))
                elif op == "expire_leases":
                    engine.step()  # ships the grants of prefills that finished in the last step
                    leases = engine.worker.worker.leases
                    pins_end = time.monotonic() + leases.pin_s
                    while leases.pinned_for() > 0 and time.monotonic() < pins_end:
                        time.sleep(0.01)
                    conn.send(("reply", len(leases.expire(now=float("inf")))))
                elif op == "leases":
                    conn.send(("reply", [
                        {"request_id": lease.ref.request_id, "generation": lease.ref.generation,
                         "renewals": lease.renewals, "claimed": lease.owner is not None}
                        for lease in engine.worker.worker.leases.leases()]))
                elif op == "sleep":
                    engine.sleep()
                    conn.send(("reply", True))
                elif op == "wake_up":
                    engine.wake_up()
                    conn.send(("reply", True))
                elif op == "sidechannel":
                    server = engine.worker.worker._server
                    conn.send(("reply", {**dataclasses.asdict(server.stats), "open": server.counts()[0],
                                         "untrusted": server.counts()[1],
                                         "max_connections": server.limits.max_connections,
                                         "threads": threading.active_count()}))
                elif op == "lease_events":
                    conn.send(("reply", engine.worker.worker.leases.stats.counts()))
                elif op == "scribble_free":
                    free = list(engine.pool.free)
                    engine.kv[:, free] = SCRIBBLE
                    conn.send(("reply", len(free)))
                elif op == "unscribbled":  # free blocks written since scribble_free (nothing may write them)
                    free = list(engine.pool.free)
                    changed = (engine.kv[:, free] != SCRIBBLE).flatten(2).any(2).any(0)
                    conn.send(("reply", [b for b, c in zip(free, changed.tolist()) if c]))
                elif op == "forget_idle_peers":  # as if every producer rank had gone unused for idle_s
                    consumer = engine.worker.worker._consumer
                    with consumer._lock:
                        names = consumer.peers.prune(float("inf"), consumer._book.peer_keys)
                    consumer.peers.remove(names)
                    conn.send(("reply", len(names)))
                elif op == "status":
                    inner = getattr(engine.worker, "worker", None)
                    # Reads first: blocks are freed only in step(), never while
                    # this runs, so "reads on the wire, yet their blocks already
                    # free" cannot be an artefact of the sampling order.
                    reading = inner.reads_on_the_wire() if inner else []
                    conn.send(("reply", {
                        "reading_ids": reading,
                        "free_blocks": engine.num_free_blocks(), "held": len(engine.held),
                        "held_ids": sorted(engine.held),
                        "loading_ids": sorted(r for r, q in engine.requests.items()
                                              if q.status.value == "loading"),
                        "requests": len(engine.requests), "steps": engine.steps,
                        "leases": len(inner.leases) if inner else 0,
                        "inflight_loads": inner.num_inflight() if inner else 0,
                        "resources": inner.resources() if inner else {},
                    }))
                elif op == "loads":  # where each load in flight is, and what it waits on (a failure's message)
                    book = engine.worker.worker._book
                    with book.lock:
                        conn.send(("reply", {rid: {"stage": load.stage.name, "waiting_on": load.waiting_on,
                                                   "error": load.error}
                                             for rid, load in book.loads.items()}))
                elif op == "stats":
                    conn.send(("reply", engine.worker.get_kv_connector_stats()))
                elif op == "shutdown":
                    engine.shutdown()
                    conn.send(("reply", True))
                    return
            if engine.has_work():
                engine.step()
                if not engine._busy():
                    conn.poll(0.0005)
            else:
                if stepped:
                    engine.step()  # keeps lease expiry and late confirmations moving
                conn.poll(0.002)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise
    finally:
        # A forked child leaves through os._exit: run the exit hooks a
        # spawned child's interpreter ran at its end (the finalizers that
        # close an agent the engine did not shut down, e.g. after an error).
        atexit._run_exitfuncs()


def _result_dict(result: Any) -> dict[str, Any]:
    out = dataclasses.asdict(result)
    out["status"] = result.status.value
    out["load_s"] = result.load_s
    return out


# --- the parent ---------------------------------------------------------------------------------


class EngineProcess:
    """A harness engine in a child process (forked from the fork server,
    above). Use as a context manager. ``start_timeout_s`` bounds the child's
    start (a fork that builds the engine: about 1 s here when quiet, 3 s as
    a fresh interpreter importing torch; a CI run beside vLLM servers once
    waited more than 60 s for one)."""

    def __init__(self, name: str, config: dict[str, Any], shape: ModelShape,
                 faults: dict[str, Any] | None = None, start_timeout_s: float = 180.0,
                 netns: str | None = None) -> None:
        self.name = name
        ctx = _context()
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child, name=name, daemon=True,
                                 args=(child_conn, dict(config), dataclasses.asdict(shape),
                                       dict(faults or {}), netns, dict(os.environ), os.getcwd(),
                                       ParentFd(1), ParentFd(2)))
        self._proc.start()
        child_conn.close()
        self.results: dict[str, dict[str, Any]] = {}
        self.info = self._expect("ready", start_timeout_s)

    @property
    def pid(self) -> int:
        return int(self._proc.pid or 0)

    def _recv(self, timeout_s: float) -> tuple:
        if not self._conn.poll(timeout_s):
            raise HarnessError(f"{self.name}: no message within {timeout_s} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            raise HarnessError(f"{self.name}: child exited (code {self._proc.exitcode})") from None
        if msg[0] == "error":
            raise HarnessError(f"{self.name} failed:\n{msg[1]}")
        if msg[0] == "finished":
            self.results[msg[1]["request_id"]] = msg[1]
        return msg

    def _expect(self, kind: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if msg[0] == kind:
                return msg[1]

    def add(self, request_id: str, prompt: list[int], params: dict[str, Any] | None = None) -> None:
        self._conn.send(("add", request_id, list(prompt), params))

    def abort(self, request_id: str) -> None:
        self._conn.send(("abort", request_id))

    def call(self, op: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send((op, *args))
        return self._expect("reply", timeout_s)

    def open_gate(self) -> None:
        self.call("gate", True)

    def close_gate(self, before_post: bool = False) -> None:
        """Hold read completions (``gate_reads``) and push writes
        (``gate_writes``) until :meth:`open_gate`; ``before_post``: hold the
        reads before they are posted instead."""
        self.call("gate", False, before_post)

    def pump(self, timeout_s: float = 0.0) -> None:
        """Take in the results that arrived (waiting at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self._conn.poll(max(0.0, deadline - time.monotonic())):
            self._recv(0.0)

    def wait_results(self, request_ids: Any, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Results of ``request_ids`` (blocks until all arrived, bounded)."""
        wanted = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while not wanted <= set(self.results):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - set(self.results))
                raise HarnessError(f"{self.name}: no result for {len(missing)} request(s) "
                                   f"after {timeout_s} s: {missing[:8]}")
            try:
                self._recv(min(left, 0.5))
            except HarnessError as exc:
                if "no message" not in str(exc):
                    raise
        return {rid: self.results[rid] for rid in wanted}

    def wait_status(self, predicate: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.call("status")
            if predicate(status):
                return status
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.name}: status {status} did not meet the condition in {timeout_s} s")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the child (a crash, no cleanup). An exit code of 255 is
        also what a live child reads as once the fork server is gone (its
        pipe closed), so that child is killed too."""
        if self._proc.exitcode in (None, 255):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.join(10)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._proc.is_alive():
            try:
                self.call("shutdown", timeout_s=timeout_s)
            except (HarnessError, OSError, BrokenPipeError):
                pass
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                self.kill()
        self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
