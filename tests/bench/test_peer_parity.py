"""The bench configures and times rdma-kv and NIXL alike (in-process, no NIXL needed).

- NIXL's bench target waits without NIXL's progress thread, which the Python
  API starts with pthrDelay=0 and which spun one of the host's cores during
  the reader's timed reads, where rdma-kv's target sleeps on its event fd;
  it progresses UCX from its command loop while it waits instead.
- rdma-kv's *seconds* runs from the shim's entry to the completion the reader
  saw, the return from the post to Python included, as NIXL's runs from its
  ``transfer()`` call; before, the return was left out of both columns.
"""

from types import SimpleNamespace
from typing import Any

import pytest

from rdma_kv.bench import nixl_peer, rdmakv_peer, runner
from rdma_kv.bench.workloads import Workload

TINY = Workload("tiny", "kv", num_layers=2, blocks_per_request=8, block_nbytes=4096, pool_blocks=16, seed=11)


class ScriptedChan:
    """A target's end of the control pipe: ``waits`` empty polls, then ``close``."""

    def __init__(self, waits: int) -> None:
        self.waits = waits
        self.polls = 0
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any], blob: bytes | None = None) -> None:
        self.sent.append(msg)

    def poll(self, timeout_s: float) -> bool:
        self.polls += 1
        return self.polls > self.waits

    def recv(self, timeout_s: float | None = None) -> tuple[dict[str, Any], None]:
        return {"type": "close"}, None


class FakeNixlAgent:
    def __init__(self) -> None:
        self.notif_polls = 0
        self.deregistered = False

    def get_agent_metadata(self) -> bytes:
        return b"md"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.notif_polls += 1
        return {}

    def deregister_memory(self, reg: Any) -> None:
        self.deregistered = True


@pytest.mark.parametrize("notify", [False, True])
def test_nixl_target_runs_without_a_progress_thread_and_progresses_while_it_waits(monkeypatch, notify):
    made: dict[str, Any] = {}
    agent = FakeNixlAgent()

    def fake_agent(name: str, options: dict[str, Any]) -> FakeNixlAgent:
        made.update(options)
        return agent

    monkeypatch.setattr(nixl_peer, "_agent", fake_agent)
    monkeypatch.setattr(nixl_peer, "_register", lambda agent, buf: "reg")
    chan = ScriptedChan(waits=3)
    nixl_peer.target(chan, {"workload": TINY.to_dict(), "options": {"notify": notify}})
    assert made["progress_thread"] is False  # rdma-kv's target sleeps: NIXL's must not spin a core
    assert agent.notif_polls >= 3  # one progress call per wait for a command (wire-up, notifications)
    assert agent.deregistered and [m["type"] for m in chan.sent] == ["ready", "closed"]


def test_serve_target_without_idle_only_blocks_on_the_pipe():
    chan = ScriptedChan(waits=3)
    runner.serve_target(chan, fill=lambda rep: None, close=lambda: None)  # type: ignore[arg-type]
    assert chan.polls == 0 and [m["type"] for m in chan.sent] == ["closed"]


def test_rdmakv_rep_times_run_from_the_shims_entry_to_the_completion_seen():
    # t0: before read_prepared; the shim's clock at its entry; the post loop
    # ended long before read_prepared returned; t2: after wait().
    xfer = SimpleNamespace(started=10.000_040, post_s=0.000_010)
    t0, t2 = 10.0, 10.001
    times = rdmakv_peer.rep_times(t0, t2, xfer)
    assert times["seconds"] == pytest.approx(t2 - xfer.started)  # the return to Python counts, as in NIXL's
    assert times["prep_seconds"] == pytest.approx(xfer.started - t0)
    assert times["seconds"] + times["prep_seconds"] == pytest.approx(t2 - t0)
    assert times["post_seconds"] == xfer.post_s


def test_bench_gives_nixl_tn_the_split_that_lets_it_use_its_threads(monkeypatch):
    """nixl-tN is NIXL's parallelism at rdma-kv's lane count: NIXL's UCX thread
    pool splits a request only from split_batch_size descriptors on (1024 by
    default: never on kv-contiguous, kv-one-block or contiguous-256m), so the
    variant sets it to N, its smallest, as rdma-kv stripes any large request."""
    from rdma_kv.bench import baselines
    from rdma_kv.cli import main

    variants: dict[str, dict[str, Any]] = {}
    real_add_variant = baselines.add_variant

    def add_variant(name: str, base: str, **options: Any) -> str:
        variants[name] = dict(options, base=base)
        return real_add_variant(name, base, **options)

    monkeypatch.setattr(baselines, "add_variant", add_variant)
    monkeypatch.setattr(baselines, "run", lambda *a, **k: [])
    monkeypatch.setattr(baselines, "BACKENDS", dict(baselines.BACKENDS))  # the run registers its variants
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # the CLI's pin_loopback sets it otherwise
    assert main(["bench", "--vs", "nixl", "--lanes", "2", "--workloads", "kv-one-block", "--perftest", "none",
                 "--no-cma", "--reps", "1"]) == 0
    assert variants["nixl-t2"] == {"base": "nixl", "num_threads": 2, "split_batch_size": 2, "notify": False}
    assert variants["rdma-kv-l1"]["lanes"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.skipif(nixl_peer.nixl_available() is not None, reason="nixl is not importable")
def test_nixl_with_threads_and_a_small_split_moves_and_verifies():
    w = TINY.replace(name="tiny-contig", block_order="contiguous")  # 4 merged runs: split over 2 threads
    r = nixl_peer.run_backend(w, 2, num_threads=2, split_batch_size=2, notify=True)
    assert r.status == "ok", r.reason
    assert r.config["num_threads"] == 2 and r.config["split_batch_size"] == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.skipif(nixl_peer.nixl_available() is not None, reason="nixl is not importable")
def test_nixl_reports_the_ucx_it_runs_on():
    """NIXL's wheel bundles its own UCX, not the libucx rdma-kv loads: each
    reader reports the version it ran on, so a result file shows both."""
    r = nixl_peer.run_backend(TINY, 1)
    assert r.status == "ok", r.reason
    assert r.config["ucx_version"].count(".") == 2 and "libucp" in r.config["ucx_library"]


@pytest.mark.ucx
@pytest.mark.parametrize("lanes", [1, 2])
def test_the_rdma_kv_warm_up_reaches_every_worker(lanes):
    """The untimed warm-up wires up every worker the timed reps use: a read
    of one slot stays on the own worker, so with lanes a striped read
    follows; before, the lanes' first use fell in the first timed rep."""
    import numpy as np

    from rdma_kv.transport import Agent, AgentConfig

    cfg = AgentConfig(lanes=lanes, lane_min_bytes=TINY.slot_nbytes, ucx_options={"NET_DEVICES": "lo"})
    with Agent("warm-target", cfg) as target, Agent("warm-reader", cfg) as reader:
        bufs = [np.zeros(TINY.num_slots * TINY.slot_nbytes, np.uint8) for _ in range(2)]
        target.register(bufs[0])
        reader.register(bufs[1])
        reader.add_peer(target.metadata())
        target.add_peer(reader.metadata())
        local = reader.prep_local(rdmakv_peer.slot_descs(TINY, bufs[1].ctypes.data))
        remote = reader.prep_remote("warm-target", rdmakv_peer.slot_descs(TINY, bufs[0].ctypes.data))
        reads = rdmakv_peer.warm_up(reader, local, remote, TINY)
    used = set()
    for xfer in reads:
        ops = xfer.worker_ops or (xfer.ops_posted,)
        used |= {w for w, n in enumerate(ops) if n}
    assert len(reads) == lanes and len(used) == lanes, [x.worker_ops for x in reads]
