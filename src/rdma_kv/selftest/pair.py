"""Two processes, the real ``Agent``: KV-shaped reads checked bit for bit.

The check process is the *reader* (a decode engine's side); it spawns a
*producer peer* (a prefill engine's side) as its own child, so the reader
reads its child's memory: allowed under Yama's ``ptrace_scope=1``, which
CMA obeys. The producer registers one buffer per memory it is asked for
(``host``, ``cuda:N``), fills it with the benchmark pattern on request and
reports the notifications it receives. The reader registers its own
buffers, imports the producer's metadata, prepares one list per buffer on
each side once, and reads by block-table indices (``read_prepared``), as
the connector does. Every read is verified bit-exact and timed from post to
completion.

Control messages are JSON over a pipe (``rdma_kv.bench.runner``'s
channel); every wait is bounded by the check's ``Deadline``.

May import: numpy, the standard library, rdma_kv.errors, rdma_kv.transport,
rdma_kv.bench (workloads, runner, peer descriptors), rdma_kv.selftest;
torch only for ``cuda:N`` memory, inside the processes that use it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdma_kv.bench import runner
from rdma_kv.bench.cma import page_aligned_buffer
from rdma_kv.bench.rdmakv_peer import slot_descs
from rdma_kv.bench.workloads import Workload, batch
from rdma_kv.errors import RdmaKVError
from rdma_kv.selftest.protocols import PROTO_INFO, read_protocols
from rdma_kv.selftest.report import Check
from rdma_kv.selftest.supervise import Deadline, Sink, UcxLog

__all__ = ["Buffer", "ReadSpec", "Reads", "kv_workload", "run_reads"]

PRODUCER = "rdma_kv.selftest.pair:producer"
MiB = 1 << 20


def kv_workload(quick: bool, seed: int = 0) -> Workload:
    """The KV shape every read moves: layers x K/V x blocks of a pool, random
    block ids (non-contiguous on both sides, as a decode's block table is).
    Either size is at least 2 MiB, so a read is striped over the lanes."""
    if quick:
        return Workload("selftest-quick", "kv", num_layers=4, blocks_per_request=32, block_nbytes=16 << 10,
                        pool_blocks=64, repetitions=1, seed=seed)
    return Workload("selftest", "kv", num_layers=16, blocks_per_request=128, block_nbytes=16 << 10,
                    pool_blocks=256, repetitions=3, seed=seed)


def describe(w: Workload) -> str:
    return (f"{w.transfer_nbytes / MiB:.0f} MiB ({w.num_layers} layers x K/V x {w.blocks_per_request} random "
            f"of {w.pool_blocks} blocks x {w.block_nbytes >> 10} KiB)")


@dataclass(frozen=True)
class ReadSpec:
    """One check: read the producer's ``remote`` memory into ``local``."""

    name: str
    local: str  # "host" | "cuda:N"
    remote: str
    notify: bool = False
    label: str = ""  # how the detail opens; default "<remote> -> <local>"
    # FAIL when UCX carried the read by software emulation (an active-message
    # exchange, e.g. over tcp/lo) rather than a zero-copy transport: set where
    # a zero-copy path is the point (GPU -> GPU: cuda_ipc or the HCA).
    zero_copy: bool = False
    hint: str = ""  # what to do when ``zero_copy`` fails


@dataclass(frozen=True)
class Reads:
    """What a run of reads found: its checks, the CUDA context current where
    the reader's agent was made (None: none, or host memory only), its lanes."""

    checks: tuple[Check, ...]
    cuda_context: int | None = None
    lanes: int = 1


# --- buffers ---------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


@contextlib.contextmanager
def device_scope(memory: str) -> Iterator[None]:
    """Make ``cuda:N`` the current device (its context current on this
    thread) for what runs inside; nothing for host memory."""
    if memory == "host":
        yield
        return
    with _torch().cuda.device(_torch().device(memory)):
        yield


class Buffer:
    """One side's KV buffer: page-aligned host memory (numpy) or a torch
    CUDA tensor. ``obj`` is what ``Agent.register`` takes."""

    def __init__(self, memory: str, nbytes: int) -> None:
        self.memory = memory
        self.nbytes = nbytes
        if memory == "host":
            self._host = page_aligned_buffer(nbytes)
            self.obj: Any = self._host
            self.address = int(self._host.ctypes.data)
        else:
            torch = _torch()
            self._host = page_aligned_buffer(nbytes)  # staging for the pattern
            self.obj = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device(memory))
            torch.cuda.synchronize(self.obj.device)
            self.address = int(self.obj.data_ptr())
        self._filler = runner.PatternFiller(self._host, 0)
        self._seed = -1

    def fill(self, seed: int, rep: int) -> None:
        """The benchmark pattern of (seed, rep): every 8-byte word distinct."""
        if seed != self._seed:
            self._filler, self._seed = runner.PatternFiller(self._host, seed), seed
        self._filler.fill(rep)
        if self.memory != "host":
            torch = _torch()
            self.obj.copy_(torch.from_numpy(self._host))
            torch.cuda.synchronize(self.obj.device)

    def zero(self) -> None:
        if self.memory == "host":
            self._host.fill(0)
        else:
            self.obj.zero_()
            _torch().cuda.synchronize(self.obj.device)  # before UCX writes into it

    def host_view(self) -> np.ndarray:
        return self._host if self.memory == "host" else self.obj.cpu().numpy()


# --- the producer peer (a child of the check process) -----------------------------------


def producer(chan: runner.Channel, start: dict[str, Any]) -> None:
    """Register one buffer per memory, then fill / report notifications on
    request until ``close``. Its agent is made after the CUDA buffers, so
    its pump gets their device's context."""
    from rdma_kv.transport import Agent, AgentConfig

    workload = Workload.from_dict(start["workload"])
    memories: list[str] = start["memories"]
    idle_s = float(start["idle_timeout_s"])
    cuda = [m for m in memories if m != "host"]
    with device_scope(cuda[0] if cuda else "host"):
        buffers = {m: Buffer(m, workload.buffer_nbytes) for m in memories}
        agent = Agent("selftest-producer", AgentConfig(ucx_options=dict(start["ucx_options"])))
    try:
        for buf in buffers.values():
            agent.register(buf.obj)
        chan.send({"type": "ready", "addresses": {m: b.address for m, b in buffers.items()}}, agent.metadata())
        while True:
            msg, _ = chan.recv(idle_s)
            if msg["type"] == "fill":
                buffers[msg["memory"]].fill(workload.seed, int(msg["rep"]))
                chan.send({"type": "filled"})
            elif msg["type"] == "await_notification":
                chan.send(_await_notification(agent, msg["payload"].encode(), float(msg["timeout_s"])))
            elif msg["type"] == "close":
                break
            else:
                raise runner.BenchError(f"producer peer: unexpected message {msg['type']!r}")
    finally:
        agent.close()
    chan.send({"type": "closed"})


def _await_notification(agent: Any, payload: bytes, timeout_s: float) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    seen: list[str] = []
    while True:
        for note in agent.get_notifications():
            if note.payload == payload:
                return {"type": "notified", "received": True, "peer": note.peer}
            seen.append(repr(note.payload))
        if time.monotonic() >= end:
            return {"type": "notified", "received": False, "seen": seen[:5]}
        time.sleep(0.001)


# --- the reader (the check process) ----------------------------------------------------


def run_reads(reads: Sequence[ReadSpec], workload: Workload, sink: Sink, deadline: Deadline, *,
              ucx_options: dict[str, str], lanes: int | None = None, log: UcxLog | None = None) -> Reads:
    """Run ``reads`` against one producer peer; every read is a check sent
    to ``sink`` (FAIL with the reason when it fails or cannot run)."""
    from rdma_kv.transport import Agent, AgentConfig
    from rdma_kv.transport.cuda import creator_context

    checks: list[Check] = []
    cuda_context: int | None = None
    lanes_made = 1
    locals_ = sorted({r.local for r in reads})
    cuda = [m for m in locals_ if m != "host"]
    assert len(cuda) <= 1, "one reader agent per GPU, as one connector per rank"
    ctx = mp.get_context("spawn")
    child: runner.Child | None = None
    agent: Any = None
    pending = list(reads)
    closed = False
    try:
        child = runner.Child(ctx, PRODUCER, "producer peer")
        child.chan.send({"type": "start", "workload": workload.to_dict(), "memories": sorted({r.remote for r in reads}),
                         "ucx_options": ucx_options, "idle_timeout_s": deadline.seconds})
        info, blob = child.chan.expect("ready", deadline.left())
        with device_scope(cuda[0] if cuda else "host"):
            buffers = {m: Buffer(m, workload.buffer_nbytes) for m in locals_}
            # PROTO_INFO: UCX prints the protocol it picks for each read (protocols.py).
            options = {**ucx_options, **(PROTO_INFO if log is not None else {})}
            config = AgentConfig(ucx_options=options) if lanes is None else AgentConfig(ucx_options=options, lanes=lanes)
            agent = Agent("selftest-reader", config)
            made_in = creator_context()
            cuda_context = made_in.handle if made_in is not None else None
        lanes_made = agent.config.lanes
        for buf in buffers.values():
            agent.register(buf.obj)
        peer = agent.add_peer(blob)
        local_prep = {m: agent.prep_local(slot_descs(workload, b.address)) for m, b in buffers.items()}
        remote_prep = {m: agent.prep_remote(peer, slot_descs(workload, int(a))) for m, a in info["addresses"].items()}
        protocols: dict[tuple[str, str], list[str]] = {}
        for rep, read in enumerate(list(pending)):
            sink.begin(read.name)
            try:
                check = _one_read(read, rep, workload, agent, child.chan, buffers[read.local],
                                  local_prep[read.local], remote_prep[read.remote], deadline, log, protocols)
            except runner.BenchError:
                raise  # the producer peer is gone: nothing after this can run
            except RdmaKVError as exc:  # this read failed (a transfer error, a deadline): the next may not
                check = Check.failed(read.name, f"{type(exc).__name__}: {exc}")
            pending.remove(read)
            checks.append(check)
            sink.add(check)
        closed = True
        child.chan.send({"type": "close"})
        child.chan.expect("closed", deadline.left())
    except Exception as exc:  # a diagnostic: every read gets its line, whatever broke
        why = one_line(exc)
        for read in pending:  # the first was running; the rest could not run
            check = Check.failed(read.name, why if read is pending[0] else f"not run: {why}")
            checks.append(check)
            sink.add(check)
    finally:
        if agent is not None:
            agent.close()  # first: it holds the producer's keys
        if child is not None:
            if not closed:
                # The reader broke before its reads ended: the producer peer
                # still waits for requests, and left so it was terminated only
                # at the join's bound (10 s more on every failing group).
                with contextlib.suppress(Exception):
                    child.chan.send({"type": "close"})
            child.close(timeout_s=min(10.0, deadline.left()))
    return Reads(tuple(checks), cuda_context, lanes_made)


def one_line(exc: BaseException) -> str:
    """A check's reason from an exception, on one line: a peer's forwarded
    traceback (``runner.Channel``: "producer peer failed:" then the
    traceback) becomes its first line and the error it ended in."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{lines[0]} {lines[-1]}" if len(lines) > 1 else "".join(lines)
    return f"{type(exc).__name__}: {text}"


def _one_read(read: ReadSpec, rep: int, w: Workload, agent: Any, chan: runner.Channel, local: Buffer,
              local_prep: Any, remote_prep: Any, deadline: Deadline, log: UcxLog | None,
              protocols: dict[tuple[str, str], list[str]]) -> Check:
    """``w.repetitions`` timed reads of one (local, remote) pair after an
    untimed one, each verified (a notified read's notification too).
    ``protocols`` gathers UCX's tables as they are printed (once per kind)."""
    seconds, ops, workers = [], 0, 1
    p = batch(w, rep)
    chan.send({"type": "fill", "memory": read.remote, "rep": rep})
    chan.expect("filled", deadline.left())
    for i in range(w.repetitions + 1):  # the first is a warm-up (endpoints wired, protocols chosen): untimed
        local.zero()
        payload = f"selftest-{read.name}-{i}".encode() if read.notify else None
        t0 = time.perf_counter()
        xfer = agent.read_prepared(local_prep, p.local_slots, remote_prep, p.remote_slots, notify=payload,
                                   timeout_s=deadline.left())
        xfer.wait(deadline.left())
        if i:
            seconds.append(time.perf_counter() - t0)
        ops, workers = xfer.ops_posted, len([n for n in (xfer.worker_ops or (1,)) if n])
        try:
            runner.verify(local.host_view(), p, f"{read.name} ({read.remote} -> {read.local})")
        except runner.VerificationError as exc:
            return Check.failed(read.name, str(exc))
        if payload is not None:
            chan.send({"type": "await_notification", "payload": payload.decode(), "timeout_s": deadline.left()})
            note, _ = chan.expect("notified", deadline.left() + 5)
            if not note["received"]:
                return Check.failed(read.name, f"the read completed bit-exact but the producer did not receive its "
                                    f"notification {payload!r} before the deadline (it saw {note['seen']})")
    median = statistics.median(seconds)
    gbps = p.nbytes / median / 1e9
    figures: dict[str, Any] = {"gbps": round(gbps, 3), "nbytes": p.nbytes, "descriptors": p.descriptor_count,
                               "ops": ops, "workers": workers, "reads": len(seconds),
                               "seconds": round(median, 6)}
    via = ""
    if log is not None:
        for key, rows in read_protocols(log.take()).items():
            protocols.setdefault(key, []).extend(r for r in rows if r not in protocols.get(key, []))
        local_kind, remote_kind = ("host" if m == "host" else "cuda" for m in (read.local, read.remote))
        chosen = protocols.get((local_kind, remote_kind))
        if chosen:
            figures["ucx_protocol"] = "; ".join(chosen)
            via = f" via {figures['ucx_protocol']}"
    notified = ", notification delivered" if read.notify else ""
    timed = f"median of {len(seconds)} after a warm-up" if len(seconds) > 1 else "after a warm-up"
    if read.zero_copy and "software emulation" in str(figures.get("ucx_protocol", "")):
        return Check.failed(read.name, f"{read.label or f'{read.remote} -> {read.local}'}: bit-exact but UCX carried "
                            f"it by {figures['ucx_protocol']} (no zero-copy path), {gbps:.2f} GB/s"
                            f"{'; ' + read.hint if read.hint else ''}", **figures)
    return Check.passed(read.name, f"{read.label or f'{read.remote} -> {read.local}'}: {describe(w)}, "
                        f"{p.descriptor_count} descriptors in {ops} ops on {workers} worker(s){via}; "
                        f"bit-exact{notified}; {gbps:.2f} GB/s ({timed})", **figures)
