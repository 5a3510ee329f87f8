"""One offline vLLM engine in a child process, driven over pipes: the
building block of the P/D tests and of ``bench/vllm_pd.py``.

Child (this file run as a script): reads JSON commands on stdin, one per
line, answers each on a result pipe of its own (vLLM logs to stdout, which
goes to a log file):

    {"op": "start", "kv_transfer_config": {...} | null, "llm": {...}}
    {"op": "generate", "prompts": [...], "max_tokens": 8,
     "kv_transfer_params": [... | null],
     "trace": false}                              -> {"outputs": [...], "elapsed_s"[, "trace"]}
    {"op": "kv_cache_groups"}                     -> {"groups": [spec class name, ...]}
    {"op": "kv_stats"}                            -> {"stats": merged connector stats | null}
                                                     (TP=1 only: its worker runs in the child)
    {"op": "held_blocks"}                         -> {"held": blocks the producer scheduler counts
                                                     held under leases} (multiprocessing off)
    {"op": "stop"}                                -> engine shut down, child exits

Parent: :class:`EngineProcess` (``start``, ``generate``, ``kill``,
``close``, ``log``); every wait is bounded (``timeout_s``), and a child
that dies or times out raises with the tail of its log. The child has its
own temporary directory (``tiny_model.PrivateTmp``: vLLM's IPC sockets),
removed by ``kill()`` and ``close()``.

Children are forked from a ``multiprocessing`` fork server that imported
vLLM once (``vllm_preload``): a child starts without the ~10 s of
``import vllm`` a fresh interpreter spends, and the suite starts dozens
(the first start also waits for the server's import, unbounded). Each
child takes the parent's environment and working directory as they are at
its start, leads a session of its own, reads its commands on its stdin and
runs the exit hooks on its way out, as the script it once was (``python
engine_proc.py``, still runnable) did. What is read when an interpreter
starts or when torch and vLLM are imported (``PYTHON*``, OpenMP threads,
``VLLM_LOGGING_*``, ``HF_*``) is the fork server's: ``tiny_model.vllm_env``
for every engine; no test sets those per engine. If ``vllm_preload`` cannot
be imported, each child imports vLLM itself: slower, not different.

Imports only the standard library, ``tiny_model`` and
``rdma_kv.harness.forked`` (free to import) at module level: vLLM runs in
children.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import forkserver
from multiprocessing import process as mp_process
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from tiny_model import PrivateTmp  # noqa: E402

from rdma_kv.harness.forked import ParentFd, adopt  # noqa: E402

T = TypeVar("T")


class EngineProcess:
    """A child process holding at most one ``vllm.LLM``."""

    def __init__(self, name: str, model_dir: str, log_dir: Path, *,
                 multiprocessing: bool = False, env: Mapping[str, str] | None = None,
                 timeout_s: float = 120.0) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.log_path = Path(log_dir) / f"{name}.log"
        self.tmp = PrivateTmp(name)
        read_fd, write_fd = os.pipe()
        stdin_r, stdin_w = os.pipe()
        child_env = {**os.environ, **(env or {}), "UCX_NET_DEVICES": "lo", **self.tmp.env}
        try:
            with open(self.log_path, "w") as log:
                process = fork(_forked_child, name,
                               (ParentFd(stdin_r), ParentFd(log.fileno()), ParentFd(write_fd), child_env,
                                os.getcwd(), model_dir, multiprocessing))
        except BaseException:
            for fd in (read_fd, stdin_w):
                os.close(fd)
            self.tmp.remove()
            raise
        finally:
            for fd in (write_fd, stdin_r):
                os.close(fd)
        self.proc = Forked(process, os.fdopen(stdin_w, "w"))
        self._results = os.fdopen(read_fd)
        self._starting: dict[str, Any] | None = None
        self._stepping: dict[str, Any] | None = None

    def _call(self, command: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        self._send(command)
        return self._receive(command, timeout_s)

    def _send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # reported by _receive with the log

    def _receive(self, command: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        ready, _, _ = select.select([self._results], [], [], timeout_s or self.timeout_s)
        line = self._results.readline() if ready else ""
        if not line:
            self.kill()
            raise RuntimeError(f"{self.name}: no answer to {command['op']!r} "
                               f"(rc={self.proc.returncode}); log tail ({self.log_path}):\n"
                               f"{self.log()[-4000:]}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"{self.name}: {command['op']} failed:\n{reply.get('error')}")
        return reply

    def start(self, kv_transfer_config: Mapping[str, Any] | None = None, *,
              model: Mapping[str, Any] | None = None, **llm: Any) -> dict[str, Any]:
        """Build (or reuse) the tiny model with ``model`` (``build_tiny_llama``
        keywords) and start an engine with ``llm`` overrides (``llm_kwargs``)."""
        self.begin_start(kv_transfer_config, model=model, **llm)
        return self.wait_started()

    def begin_start(self, kv_transfer_config: Mapping[str, Any] | None = None, *,
                    model: Mapping[str, Any] | None = None, **llm: Any) -> None:
        """``start`` without waiting, so that several engines start at once;
        ``wait_started`` returns the answer (bounded by ``timeout_s``)."""
        self._starting = {"op": "start", "kv_transfer_config": kv_transfer_config,
                          "model": dict(model or {}), "llm": llm}
        self._send(self._starting)

    def wait_started(self) -> dict[str, Any]:
        command, self._starting = self._starting, None
        assert command is not None, "wait_started() without begin_start()"
        return self._receive(command)

    def generate(self, prompts: Sequence[str], *, max_tokens: int = 8,
                 kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
                 trace: bool = False, n: int = 1, cache_salt: str | None = None) -> dict[str, Any]:
        """``trace``: also return ``trace``, the connector calls of this
        generate() with their times (``connector_trace``; multiprocessing off).
        ``n``: samples per prompt (vLLM's parallel sampling: child requests
        carrying the prompt's params); each output's ``samples`` lists them.
        ``cache_salt``: every prompt's (vLLM's prefix cache keys on it)."""
        return self._call({"op": "generate", "prompts": list(prompts), "max_tokens": max_tokens,
                           "kv_transfer_params": kv_transfer_params, "trace": trace, "n": n,
                           "cache_salt": cache_salt})

    def abort_during_load(self, prompts: Sequence[str], kv_transfer_params: Sequence[Mapping[str, Any]],
                          *, settle_s: float = 30.0) -> dict[str, Any]:
        """Submit decode requests, step until their KV loads are in flight,
        abort them all, then keep stepping until the engine has handed every
        block back (bounded by ``settle_s``). Needs multiprocessing off."""
        return self._call({"op": "abort_during_load", "prompts": list(prompts),
                           "kv_transfer_params": list(kv_transfer_params), "settle_s": settle_s})

    def free_blocks(self, settle_s: float = 0.0) -> int:
        """Free blocks in the engine's KV cache (multiprocessing off); with
        ``settle_s``, first step the engine until no request is left (finished
        ones whose blocks a connector still holds included), at most that long."""
        return int(self._call({"op": "free_blocks", "settle_s": settle_s})["free"])

    def begin_free_blocks(self, settle_s: float) -> None:
        """``free_blocks(settle_s)`` without waiting: the engine steps, as an
        online engine's loop would, while the test drives another engine
        (offline, vLLM steps only inside ``generate()``); a push-mode producer
        ships a finished prefill's lease to its workers, and frees the blocks
        once released, only in a step. ``wait_free_blocks`` returns the count."""
        self._stepping = {"op": "free_blocks", "settle_s": settle_s}
        self._send(self._stepping)

    def wait_free_blocks(self) -> int:
        command, self._stepping = self._stepping, None
        assert command is not None, "wait_free_blocks() without begin_free_blocks()"
        return int(self._receive(command, command["settle_s"] + self.timeout_s)["free"])

    def step_during(self, work: Callable[[], T], settle_s: float = 120.0) -> tuple[T, int]:
        """Run ``work()`` (driving another engine) while this engine steps
        (``begin_free_blocks``), then let it step until it holds no request:
        ``work``'s result and this engine's free blocks after."""
        self.begin_free_blocks(settle_s)
        try:
            out = work()
        finally:
            free = self.wait_free_blocks()
        return out, free

    def kv_cache_groups(self) -> list[str]:
        """The spec class of each KV-cache group the engine's scheduler
        runs with (multiprocessing off): several when vLLM's hybrid KV-cache
        manager is on for a hybrid model, one when it was turned off."""
        return list(self._call({"op": "kv_cache_groups"})["groups"])

    def kv_stats(self) -> dict[str, Any] | None:
        """Everything the worker's connector returned from
        ``get_kv_connector_stats()`` since the engine started, merged
        (``rdma_kv.connector.rdma.metrics.merge_stats``); multiprocessing off."""
        return self._call({"op": "kv_stats"})["stats"]

    def held_blocks(self) -> int:
        """The blocks the producer's connector scheduler counts held under its
        leases (``RdmaScheduler.num_held_blocks``; multiprocessing off)."""
        return int(self._call({"op": "held_blocks"})["held"])

    def kill(self) -> None:
        """SIGKILL the child and everything it started (its session)."""
        # 255 is also what a live child reads as once the fork server is gone.
        if self.proc.poll() in (None, 255):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet the leader of its session, or gone
                try:
                    os.kill(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)
        self.tmp.remove()  # the sockets a killed vLLM leaves

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self._call({"op": "stop"}, timeout_s)
                self.proc.wait(timeout=timeout_s)
            except Exception:
                self.kill()
        self._results.close()
        self.tmp.remove()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the fork server ----------------------------------------------------------------


def fork_context() -> Any:
    """The fork server, started with ``vllm_preload`` imported. Python 3.11's
    fork server drops the parent's ``sys.path`` (``forkserver.main`` ignores
    its ``sys_path``) and skips a preload it cannot import without a word, so
    it finds ``vllm_preload`` through ``PYTHONPATH``, set while it starts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm_preload"])  # before the server starts; a no-op after
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), saved]))
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def fork(target: Callable[..., None], name: str, args: tuple[Any, ...]) -> Any:
    """A ``multiprocessing.Process`` running ``target(*args)``, forked from
    the fork server and started. Not a daemon (vLLM's own children need
    that), yet not joined at this process's exit either: its owner ends it
    (``kill``, ``close``), as it ended a ``Popen`` child."""
    process = fork_context().Process(target=target, name=name, args=args)
    process.start()
    mp_process._children.discard(process)  # type: ignore[attr-defined]
    return process


class Forked:
    """The part of ``subprocess.Popen`` that EngineProcess and the tests use
    (``pid``, ``stdin``, ``poll``, ``wait``, ``returncode``), over the
    ``multiprocessing.Process`` of a forked child."""

    def __init__(self, process: Any, stdin: Any) -> None:
        self._process, self.stdin, self.pid = process, stdin, int(process.pid)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0.0)
        if self.stdin is not None and not self.stdin.closed:
            try:
                self.stdin.close()
            except BrokenPipeError:
                pass
        return int(self._process.exitcode)


def _forked_child(stdin_fd: int, log_fd: int, result_fd: int, env: dict[str, str], cwd: str,
                  model_dir: str, multiprocessing: bool) -> None:
    """The child as the script's ``__main__`` ran it: a session of its own
    (``kill`` ends vLLM's processes with it), commands on stdin, vLLM's
    output to the log, the parent's environment and directory."""
    os.setsid()
    adopt(env, cwd, {0: stdin_fd, 1: log_fd, 2: log_fd})  # $TMPDIR: this child's (vLLM's IPC sockets)
    sys.stdin = open(0, closefd=False)  # multiprocessing gave the child /dev/null
    try:
        _child(result_fd, model_dir, multiprocessing)
    finally:
        # A forked child leaves through os._exit: run the exit hooks the
        # script's interpreter ran at its end (vLLM's finalizers stop its
        # EngineCore, which multiprocessing would otherwise wait for when
        # stdin ends without a "stop": the parent died).
        atexit._run_exitfuncs()


# --- the child ----------------------------------------------------------------------


def _child(result_fd: int, model_dir: str, multiprocessing: bool) -> None:
    sys.path.insert(0, str(HERE))
    from tiny_model import apply_vllm_env, build_tiny_llama

    apply_vllm_env(multiprocessing=multiprocessing)
    results = os.fdopen(result_fd, "w")
    llm = None
    collected: list[dict[str, Any]] = []

    def reply(obj: dict[str, Any]) -> None:
        results.write(json.dumps(obj) + "\n")
        results.flush()

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "start":
                from tiny_model import make_llm

                model = build_tiny_llama(model_dir, **command.get("model", {}))
                tp = int(command.get("llm", {}).get("tensor_parallel_size", 1))
                if tp > 1:  # one OpenMP thread per rank, ranks spread over the CPUs
                    cpus = os.cpu_count() or 1
                    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cpus) for r in range(tp))
                t0 = time.monotonic()
                llm = make_llm(model, kv_transfer_config=command["kv_transfer_config"],
                               **command.get("llm", {}))
                if command["kv_transfer_config"] and not multiprocessing and tp == 1:
                    _collect_stats(collected)  # the worker runs in this process
                reply({"ok": True, "elapsed_s": time.monotonic() - t0})
            elif op == "generate":
                reply({"ok": True, **_generate(llm, command)})
            elif op == "abort_during_load":
                reply({"ok": True, **_abort_during_load(llm, command)})
            elif op == "free_blocks":
                _settle(llm, command["settle_s"])
                reply({"ok": True, "free": _block_pool(llm).get_num_free_blocks()})
            elif op == "kv_cache_groups":
                groups = _scheduler(llm).kv_cache_config.kv_cache_groups
                reply({"ok": True, "groups": [type(g.kv_cache_spec).__name__ for g in groups]})
            elif op == "held_blocks":
                reply({"ok": True, "held": _scheduler(llm).connector.connector.scheduler.num_held_blocks()})
            elif op == "kv_stats":
                from rdma_kv.connector.rdma.metrics import merge_stats

                reply({"ok": True, "stats": merge_stats(collected)})
            elif op == "stop":
                if llm is not None:
                    from tiny_model import shutdown_llm

                    shutdown_llm(llm)
                reply({"ok": True})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception:
            reply({"ok": False, "error": traceback.format_exc()})


def _generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = command.get("kv_transfer_params") or [None] * len(command["prompts"])
    n = command.get("n", 1)  # vLLM refuses n > 1 with greedy sampling: top_k=1 samples the same tokens
    sampling = [SamplingParams(temperature=0.0 if n == 1 else 1.0, top_k=1 if n > 1 else 0,
                               max_tokens=command["max_tokens"], ignore_eos=True, n=n,
                               extra_args=None if p is None else {"kv_transfer_params": p})
                for p in params]
    tracer = None
    if command.get("trace"):
        from connector_trace import ConnectorTrace

        tracer = ConnectorTrace(_scheduler(llm))
    t0 = time.monotonic()
    salt = command.get("cache_salt")
    prompts = command["prompts"] if salt is None else [{"prompt": p, "cache_salt": salt} for p in command["prompts"]]
    try:
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
    finally:
        if tracer is not None:
            tracer.close()
    elapsed = time.monotonic() - t0
    extra = {"trace": tracer.result(t0)} if tracer is not None else {}
    return {"elapsed_s": elapsed, **extra, "outputs": [
        {"request_id": o.request_id, "prompt_token_ids": list(o.prompt_token_ids),
         "token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
         "kv_transfer_params": o.kv_transfer_params, "num_cached_tokens": o.num_cached_tokens,
         "queued_to_first_token_s": _queued_to_first_token(o), **_timestamps(o, t0),
         "samples": [{"token_ids": list(c.token_ids), "finish_reason": c.finish_reason} for c in o.outputs]}
        for o in outputs]}


def _collect_stats(collected: list[dict[str, Any]]) -> None:
    """Keep a copy of every stats dict the worker's connector hands vLLM
    (each call resets the connector's records, so the engine's own call is
    the only one that sees them)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    take = connector.get_kv_connector_stats

    def recording() -> Any:
        stats = take()
        if stats is not None and stats.data:
            collected.append(json.loads(json.dumps(stats.data)))
        return stats

    connector.get_kv_connector_stats = recording


def _scheduler(llm: Any) -> Any:
    # vLLM 0.32, multiprocessing off: LLMEngine -> InprocClient -> EngineCore.
    return llm.llm_engine.engine_core.engine_core.scheduler


def _block_pool(llm: Any) -> Any:
    return _scheduler(llm).kv_cache_manager.block_pool


def _settle(llm: Any, settle_s: float) -> None:
    deadline = time.monotonic() + settle_s
    while _scheduler(llm).requests and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.001)


def _abort_during_load(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    engine, sched, pool = llm.llm_engine, _scheduler(llm), _block_pool(llm)
    free_before = pool.get_num_free_blocks()
    ids = [f"abort-{i}-{time.monotonic_ns()}" for i in range(len(command["prompts"]))]
    for rid, prompt, params in zip(ids, command["prompts"], command["kv_transfer_params"]):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                       extra_args={"kv_transfer_params": params}))
    deadline = time.monotonic() + 30.0
    loading: list[str] = []
    while len(loading) < len(ids):  # the scheduler admitted them: their reads are posted
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(loading)} of {len(ids)} requests started loading")
        engine.step()
        loading = [r.request_id for r in sched.requests.values()
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    held_at_abort = free_before - pool.get_num_free_blocks()
    engine.abort_request(ids)
    steps, deadline = 0, time.monotonic() + command["settle_s"]
    while pool.get_num_free_blocks() < free_before or sched.requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"after the abort, {free_before - pool.get_num_free_blocks()} blocks "
                               f"and {len(sched.requests)} requests still held after {command['settle_s']} s")
        engine.step()
        steps += 1
        time.sleep(0.001)
    return {"loading_at_abort": len(loading), "held_at_abort": held_at_abort, "steps_to_settle": steps,
            "free_before": free_before, "free_after": pool.get_num_free_blocks()}


def _queued_to_first_token(output: Any) -> float | None:
    """Engine-core time from queueing to the first token (needs the engine's
    stats on: ``disable_log_stats=False``); for a decode with a remote
    prefill: the KV load plus one step."""
    m = getattr(output, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0) or not getattr(m, "queued_ts", 0):
        return None
    return m.first_token_ts - m.queued_ts


def _timestamps(output: Any, t0: float) -> dict[str, float]:
    """Engine-core timestamps of a request, in seconds after ``t0`` (the
    generate() call; both on ``time.monotonic``)."""
    m = getattr(output, "metrics", None)
    out = {}
    for name in ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts"):
        value = getattr(m, name, 0.0) if m is not None else 0.0
        if value:
            out[name[:-3] + "_s"] = value - t0
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--result-fd", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--multiprocessing", action="store_true")
    a = ap.parse_args()
    _child(a.result_fd, a.model_dir, a.multiprocessing)
