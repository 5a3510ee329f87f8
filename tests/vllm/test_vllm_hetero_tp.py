"""Heterogeneous tensor parallel inside real vLLM: prefill and decode at
different TP sizes, the model's KV heads split (and replicated) across ranks.

Engines (each its own process, ``engine_proc``; TP ranks are vLLM's ``mp``
workers with one OpenMP thread each), shared by the tests of this module:

- ``tp1``: TP=1, weights A, ``kv_both`` (producer for the TP=2 engine, and
  consumer of it; its requests without params are the plain reference);
- ``tp2``: TP=2, weights A, ``kv_both`` (4 KV heads: 2 per rank);
- ``other``: TP=1, weights B, ``kv_producer`` (the control: KV with other
  weights must change the TP=2 decode's output).

Checks: P2 -> D1 and P1 -> D2 decode exactly like a plain TP=1 engine; the
controls: KV of other weights changes every output of the TP=2 decode (so
the KV really crossed), the TP=1 decode counts its loads ok, and refuses
the params of other prompts of the same lengths (``remote_prompt_digest``,
protocol 11: before, they loaded and changed every output, silently);
a producer killed before any contact, and one killed after a good load
(connections up), leave the TP=2 decode recomputing (same output, every
block back, no hang); a model with one KV head served
at TP=2 (each rank a replica of it) decodes like plain. A decode in which a
KV load failed, and said so in its log, is repeated once the log's warning
window has passed (``decode_undisturbed``); a producer stopped through the
control's first attempt leaves the repeated one reading its KV.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_hetero_tp.py -q
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from engine_proc import EngineProcess  # noqa: E402
from netutil import free_base_port  # noqa: E402
from procstop import stop  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402
from test_vllm_rdma_pd import CONTROL_PROMPTS, MAX_TOKENS, PD_PROMPTS, prefill, tokens  # noqa: E402

from rdma_kv.connector.rdma.lograte import WINDOW_S  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(900)]

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
MODEL = {"heads": 4, "kv_heads": 4}  # 2 KV heads per rank at TP=2
START_S = 400.0  # a TP=2 engine starts in ~1 min here, several on a loaded 2-core host
# Up to five engines (seven processes, each TP worker with its own spinning
# OpenMP thread) share 2 cores here: a side-channel thread can wait seconds
# for a core. The defaults (2 s) are for a host with cores to spare; these
# tests check what is read, not how fast a handshake is answered.
RPC_BOUNDS = {"connect_timeout_s": 10.0, "rpc_timeout_s": 10.0}


MODEL_ID = "tiny-llama"
"""Every engine of the module names one model (``model_id``), the weights-B
control producer too: the handshake trusts the operator's word on which
model an engine runs, and the controls feed a decode KV computed with other
weights to show it reads the KV it is given. Without it the engines'
identities derive from their model directories (``llama-a...``,
``llama-b...``), and the handshake refuses the control as another model."""


def config(role: str, port: int = 0, **extra: Any) -> dict[str, Any]:
    policy = extra.pop("kv_load_failure_policy", "fail")
    return {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
            "kv_role": role, "kv_port": port, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "model_id": MODEL_ID, **RPC_BOUNDS,
                                          **extra}}


def engine(name: str, model_dir: str, log_dir: Path) -> EngineProcess:
    return EngineProcess(name, model_dir, log_dir, timeout_s=START_S)


LOAD_FAILED = re.compile(r"KV load failed|KV load failures")
"""A load failure the decode logged: one line per request (``loads``), or
the count line once more than five fail per producer per 10 s (``lograte``)."""
RECOVERED = re.compile(r"Recovered from KV load failure|due to KV load failure")
"""vLLM's scheduler, each time it recomputes (or fails) requests because the
connector reported their KV load failed: one line per step, never held back."""
RETRY_PAUSE_S = WINDOW_S + 1.0
"""Between attempts: the connector's warning window (``lograte.WINDOW_S``) of
the failures just seen ends, so those of the next attempt are logged line by
line again, and the side channel's fail-fast after a failed call
(``sideclient``, 1 s) is over, so the next attempt does not fail on the last
one's account."""


def decode_undisturbed(decode: EngineProcess, params: Callable[[], list[dict[str, Any]]],
                       attempts: int = 3) -> list[list[int]]:
    """The tokens of the first decode of ``PD_PROMPTS`` (with ``params()``:
    a new prefill each time) in which no KV load failed.

    A TP=2 engine's workers spin between steps, and on this 2-core host a
    process beside them (a producer) was seen without a CPU for 6-30 s,
    long enough for a load to pass its bound (docs/reliability.md,
    "Processes without a CPU"). The load then fails, loudly, and the decode
    recomputes: the connector doing its job, but an attempt that says
    nothing about where the KV came from, so it is repeated, after
    ``RETRY_PAUSE_S``. An attempt counts as disturbed when the decode
    logged a failure, or vLLM says it recomputed after one. The latter
    without the former fails the test: each attempt starts in a fresh
    warning window (the pause; before the first, the module's earlier
    loads from the producer succeeded), so the connector logs its first
    failures one per line: a failure reported to vLLM and not logged
    fails the test. The caller checks the outputs of an undisturbed
    attempt, so a load that fails without telling vLLM (or reads the
    wrong blocks) still fails it too."""
    failures: list[str] = []
    for attempt in range(attempts):
        if attempt:
            time.sleep(RETRY_PAUSE_S)
        start = len(decode.log())
        reply = decode.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params())
        lines = decode.log()[start:].splitlines()
        failures = [line for line in lines if LOAD_FAILED.search(line)]
        recovered = [line for line in lines if RECOVERED.search(line)]
        assert failures or not recovered, f"vLLM recomputed after a KV load failure no worker logged: {recovered}"
        if not failures:
            return tokens(reply)
    pytest.fail(f"a KV load failed in each of {attempts} attempts; the last: {failures[:3]}")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {"a": str(tmp_path_factory.mktemp("llama-a")), "b": str(tmp_path_factory.mktemp("llama-b")),
            "logs": tmp_path_factory.mktemp("engine-logs")}


@pytest.fixture(scope="module")
def engines(dirs: dict[str, Any]):
    started: dict[str, EngineProcess] = {}
    # The models are built here, once, so that the engines (started together:
    # their start-ups overlap) never write one model dir at once.
    build_tiny_llama(dirs["a"], **MODEL)
    build_tiny_llama(dirs["b"], **MODEL, seed=1)
    try:
        started["tp1"] = engine("tp1", dirs["a"], dirs["logs"])
        started["tp1"].begin_start(config("kv_both", kv_load_failure_policy="recompute"), model=MODEL)
        started["tp2"] = engine("tp2", dirs["a"], dirs["logs"])
        started["tp2"].begin_start(config("kv_both", free_base_port(2), kv_load_failure_policy="recompute"),
                                   model=MODEL, **TP2)
        started["other"] = engine("other", dirs["b"], dirs["logs"])
        started["other"].begin_start(config("kv_producer"), model={**MODEL, "seed": 1})
        for proc in started.values():
            proc.wait_started()
        # Requests without kv_transfer_params are plain ones: the reference
        # (prefix caching is off, so they leave nothing behind).
        reference = tokens(started["tp1"].generate(PD_PROMPTS, max_tokens=MAX_TOKENS))
        yield {"plain": reference, **started}
    finally:
        for proc in started.values():
            proc.close()


def test_prefill_tp2_decode_tp1(engines) -> None:
    def params() -> list[dict[str, Any]]:
        made = prefill(engines["tp2"])
        assert {p["tp_size"] for p in made} == {2}
        return made

    before = engines["tp1"].kv_stats()
    assert decode_undisturbed(engines["tp1"], params) == engines["plain"]
    after = engines["tp1"].kv_stats()
    loaded = after["totals"].get("loads_ok", 0) - (before or {"totals": {}})["totals"].get("loads_ok", 0)
    assert loaded >= len(PD_PROMPTS), f"the TP=1 decode did not load the KV read: {after['totals']}"
    # The TP=2 producer's params of other prompts of the same lengths are refused
    # at admission (protocol 11; before it they loaded and every output changed,
    # silently): nothing read, computed locally.
    start = len(engines["tp1"].log())
    control = decode_undisturbed(engines["tp1"], lambda: prefill(engines["tp2"], CONTROL_PROMPTS))
    assert control == engines["plain"], "params of other prompts changed the outputs: their KV was read"
    refused = engines["tp1"].log()[start:].count("kv_transfer_params['remote_prompt_digest'] is ")
    assert refused == len(PD_PROMPTS), refused


def test_prefill_tp1_decode_tp2(engines) -> None:
    assert decode_undisturbed(engines["tp2"], lambda: prefill(engines["tp1"])) == engines["plain"]
    # Control: KV computed with other weights, read by both TP=2 ranks.
    control = decode_undisturbed(engines["tp2"], lambda: prefill(engines["other"]))
    assert all(c != p for c, p in zip(control, engines["plain"])), "the TP=2 decode did not use the KV read"


def test_control_survives_a_producer_stalled_through_one_attempt(engines) -> None:
    """The TP=1 producer (weights B) stopped (SIGSTOP) from its prefill until
    the TP=2 decode logs the loads failed, as a producer without a CPU on a
    loaded host (docs/reliability.md, "Processes without a CPU"): the CONFIRMs
    go unanswered, the loads fail, loudly, and the decode recomputes. The
    repeated attempt must then read the KV (the control differs from plain):
    one at once met the side channel still failing fast, its failures held
    back by the warning window, and passed for undisturbed with the plain
    output (2026-11-29)."""
    other, decode = engines["other"], engines["tp2"]
    stalled = threading.Event()

    def resume_once_failed(start: int) -> None:
        try:
            for _ in range(6000):  # 5 min at most: the loads fail within load_timeout_s (30 s)
                if "KV load failed" in decode.log()[start:]:
                    stalled.set()
                    return
                time.sleep(0.05)
        finally:
            os.kill(other.proc.pid, signal.SIGCONT)

    def params() -> list[dict[str, Any]]:
        made = prefill(other)
        if watcher.ident is None:  # the first attempt only
            stop(other.proc.pid)  # (returns once every thread of it is stopped)
            watcher.start()
        return made

    # Both ranks connected to the producer first (as after the control above): its stall then
    # meets the loads' CONFIRMs, not their handshakes.
    decode.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=prefill(other))
    watcher = threading.Thread(target=resume_once_failed, args=(len(decode.log()),), daemon=True)
    try:
        control = decode_undisturbed(decode, params)
    finally:
        os.kill(other.proc.pid, signal.SIGCONT)
    watcher.join()
    assert stalled.is_set(), "the stalled producer failed no load"
    assert all(c != p for c, p in zip(control, engines["plain"])), "the TP=2 decode did not use the KV read"


def test_producer_killed_tp2_decode_recomputes(engines, dirs) -> None:
    """A TP=1 producer both TP=2 decode ranks read from dies twice over:
    once before any contact (the handshake fails), once after a good load
    (the ranks' endpoints and side-channel connections are up, so its
    death is met by reads or CONFIRMs in flight). Each time: the decode
    recomputes the same output, every decode block comes back, no hang."""
    idle = engines["tp2"].free_blocks(settle_s=60.0)
    never_met = engine("doomed", dirs["a"], dirs["logs"])
    try:
        never_met.start(config("kv_producer"), model=MODEL)
        params = prefill(never_met)
    finally:
        never_met.kill()  # SIGKILL before any read
    assert tokens(engines["tp2"].generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) \
        == engines["plain"]
    assert f"handshake with 127.0.0.1:{params[0]['remote_port']} failed" in engines["tp2"].log()
    assert engines["tp2"].free_blocks(settle_s=60.0) == idle, "the failed loads stranded decode blocks"

    met = engine("doomed-after-contact", dirs["a"], dirs["logs"])
    try:
        met.start(config("kv_producer"), model=MODEL)
        assert tokens(engines["tp2"].generate(PD_PROMPTS, max_tokens=MAX_TOKENS,
                                              kv_transfer_params=prefill(met))) == engines["plain"]
        failures = engines["tp2"].log().count("KV load failed")
        params = prefill(met)
    finally:
        met.kill()  # SIGKILL with both decode ranks connected to it
    assert tokens(engines["tp2"].generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) \
        == engines["plain"]
    assert engines["tp2"].log().count("KV load failed") > failures, "a dead producer's blocks were used"
    assert engines["tp2"].free_blocks(settle_s=60.0) == idle, "the failed loads stranded decode blocks"
    # Everything is usable afterwards: a good load still matches.
    assert tokens(engines["tp2"].generate(PD_PROMPTS, max_tokens=MAX_TOKENS,
                                          kv_transfer_params=prefill(engines["tp1"]))) == engines["plain"]


def test_one_kv_head_replicated_on_both_decode_ranks(dirs) -> None:
    """A model with fewer KV heads (1) than decode ranks (2): each rank holds
    a replica of the head and reads it from the TP=1 producer."""
    model, logs = {"heads": 4, "kv_heads": 1}, dirs["logs"]
    path = str(Path(dirs["a"]).parent / "llama-1kv")
    build_tiny_llama(path, **model)  # here, before the two engines start together
    producer = engine("prefill-1kv", path, logs)
    try:
        with engine("decode-1kv-tp2", path, logs) as consumer:
            producer.begin_start(config("kv_producer"), model=model)
            consumer.begin_start(config("kv_consumer", free_base_port(2)), model=model, **TP2)
            producer.wait_started()
            consumer.wait_started()
            reference = tokens(producer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS))  # plain requests
            assert decode_undisturbed(consumer, lambda: prefill(producer)) == reference
    finally:
        producer.close()
