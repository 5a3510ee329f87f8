"""Reference point: ``ucx_perftest -t ucp_get`` from the libucx wheel.

Runs the wheel's own ``ucx_perftest`` as server and client on 127.0.0.1
(a free port, both bounded by timeouts) and parses its ``Final:`` line.
ucx_perftest prints bandwidth in MB/s with MB = 2**20 bytes; results here
are converted to GB/s with GB = 1e9 bytes. Its latency columns are in
microseconds (50th percentile, average, overall).

Imports the stdlib and ``rdma_kv.bench.report`` only; ``libucx`` is located
through ``importlib`` without loading its libraries into this process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rdma_kv.bench.ports import free_port
from rdma_kv.bench.report import Result
from rdma_kv.bench.runner import BenchError

NAME = "ucx_perftest"
MiB = 1 << 20


@dataclass(frozen=True)
class PerftestResult:
    message_nbytes: int
    iterations: int
    outstanding: int
    latency_p50_us: float
    latency_avg_us: float
    bandwidth_mib_s: float  # ucx_perftest's "MB/s": 2**20 bytes per second
    message_rate: float
    wall_seconds: float

    @property
    def gbps(self) -> float:
        return self.bandwidth_mib_s * MiB / 1e9


def libucx_dir() -> Path:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("libucx is not installed (pip install libucx-cu12)")
    return Path(list(spec.submodule_search_locations)[0])


def perftest_binary() -> Path:
    path = libucx_dir() / "bin" / "ucx_perftest"
    if not path.is_file():
        raise BenchError(f"ucx_perftest not found at {path}")
    return path


def _listening(port: int) -> bool:
    """True once some socket listens on ``port`` (Linux /proc/net/tcp, state 0A)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = [line.split() for line in fh.readlines()[1:]]
        except OSError:
            continue
        if any(int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A" for r in rows):
            return True
    return False


def parse_final(output: str) -> tuple[float, float, float, float]:
    """(p50 latency us, average latency us, bandwidth MB/s, message rate) from a ``Final:`` line."""
    for line in output.splitlines():
        if line.strip().startswith("Final:"):
            fields = line.split()[1:]
            # iterations, lat p50, lat avg, lat overall, bw avg, bw overall, rate avg, rate overall
            if len(fields) < 8:
                break
            return float(fields[1]), float(fields[2]), float(fields[5]), float(fields[7])
    raise BenchError(f"no Final: line in ucx_perftest output:\n{output[-2000:]}")


def run_perftest(
    message_nbytes: int, iterations: int, warmup: int = 10, outstanding: int = 0, timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> PerftestResult:
    """One ``ucp_get`` run (client reads from server) over loopback; ``env``
    adds variables (e.g. ``UCX_RNDV_THRESH``) to both processes."""
    binary = perftest_binary()
    env = dict(os.environ, **(env or {}))
    env["LD_LIBRARY_PATH"] = f"{binary.parent.parent / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    port = str(free_port())  # not a kernel-picked one: any outgoing connection could take it first
    server = subprocess.Popen(
        [str(binary), "-p", port], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # Readiness = the port is in LISTEN state (ucx_perftest's stdout is block
        # buffered into a pipe, and a probe connection would be taken as the client).
        deadline = time.monotonic() + timeout_s
        while not _listening(int(port)):
            if server.poll() is not None or time.monotonic() > deadline:
                out = server.communicate(timeout=5)[0] if server.poll() is not None else ""
                raise BenchError(f"ucx_perftest server did not listen on 127.0.0.1:{port}:\n{out}")
            time.sleep(0.01)
        args = [str(binary), "127.0.0.1", "-p", port, "-t", "ucp_get", "-s", str(message_nbytes),
                "-n", str(iterations), "-w", str(warmup)]
        if outstanding:
            args += ["-O", str(outstanding)]
        t0 = time.perf_counter()
        client = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
        if client.returncode != 0:
            raise BenchError(f"ucx_perftest client exited {client.returncode}:\n{client.stdout}\n{client.stderr}")
        p50, avg, bw, rate = parse_final(client.stdout)
        server.communicate(timeout=timeout_s)
        return PerftestResult(message_nbytes, iterations, outstanding, p50, avg, bw, rate, wall)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate(timeout=5)


def run_backend(message_nbytes: int, iterations: int, outstanding: int = 0) -> Result:
    """``ucx_perftest ucp_get`` as a Result (one 'rep' = the whole run)."""
    size = f"{message_nbytes >> 20} MiB" if message_nbytes >= MiB else f"{message_nbytes >> 10} KiB"
    label = f"ucp_get {size}" + (f" -O {outstanding}" if outstanding else "")
    try:
        r = run_perftest(message_nbytes, iterations, outstanding=outstanding)
    except (BenchError, OSError, subprocess.TimeoutExpired) as exc:
        return Result.failed(NAME, label, f"{type(exc).__name__}: {exc}")
    seconds = message_nbytes / (r.bandwidth_mib_s * MiB)  # per-message time implied by bandwidth
    res = Result(NAME, label, descriptors=1, seconds=[seconds], ops=[1], nbytes=[message_nbytes],
                 config={"iterations": iterations, "outstanding": outstanding})
    res.extra = {"latency_p50_us": r.latency_p50_us, "latency_avg_us": r.latency_avg_us,
                 "bandwidth_MiB_s": r.bandwidth_mib_s, "message_rate": r.message_rate, "wall_seconds": r.wall_seconds}
    return res
