"""Push mode with heterogeneous tensor parallel inside real vLLM: the
producer writes, into each decode rank, the KV heads that rank owns.

Two push-mode engines (``"mode": "push"``, each its own process,
``engine_proc``; TP ranks are vLLM's ``mp`` workers, one OpenMP thread each),
started together and shared by the tests of this module:

- ``tp1``: TP=1, ``kv_both`` (producer for the TP=2 engine and consumer of
  it; its requests without params are the plain reference);
- ``tp2``: TP=2, ``kv_both`` (4 KV heads: 2 per rank).

Sequential dispatch: the prefill's params go to the decode request, whose
worker sends PUSH to each producer rank it needs heads from. While the
decode generates, the producer engine keeps stepping (``begin_free_blocks``),
as an online engine's loop does: offline, vLLM steps only inside
``generate()``, and a push needs the prefill's lease to have reached the
producer's workers, which happens in its next step (pull does not: its
reads need nothing of the producer, and a CONFIRM of an unshipped lease is
answered from an early claim).

- P2 -> D1: the TP=1 decode receives each prompt from both producer
  ranks (two pushes per request, each writing a 2-head slice of the
  decode's 4-head blocks); completions equal plain; its connector stats
  count the pushed loads and no failure.
- P1 -> D2: the TP=1 producer writes each prompt into both decode ranks
  (one push per decode rank, each the 2 heads that rank owns); completions
  equal plain; the producer's stats count those pushes done, bytes written.
- Both directions: every producer block comes back once the decode is
  done (the pushes released the leases).
- Control, both directions: the same decode given the params of other
  prompts of the same lengths refuses them (``remote_prompt_digest``,
  protocol 11): nothing pushed, outputs computed locally. (Before, their
  KV was pushed and changed every output, silently.) That the KV of a push
  came over the wire is the stats' counts above.

The pull versions of these are ``test_vllm_hetero_tp.py`` (its engines run
in pull mode: a module of their own, so the two sets never run at once on
the 2-core host).

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_push_hetero_tp.py -q
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from engine_proc import EngineProcess  # noqa: E402
from netutil import free_base_port  # noqa: E402
from test_vllm_hetero_tp import MODEL, TP2, config, engine  # noqa: E402
from test_vllm_rdma_pd import CONTROL_PROMPTS, MAX_TOKENS, PD_PROMPTS, prefill, tokens  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(900)]


def push_stats(e: EngineProcess) -> dict[str, int]:
    """The TP=1 engine's connector totals since it started (both roles)."""
    stats = e.kv_stats()
    return dict(stats["totals"]) if stats is not None else {}


def grew(before: dict[str, int], after: dict[str, int], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def push_pd(producer: EngineProcess, decode: EngineProcess, prompts: tuple[str, ...] = PD_PROMPTS
            ) -> tuple[list[list[int]], int]:
    """Prefill ``prompts`` on ``producer``, then decode ``PD_PROMPTS`` with
    those params on ``decode`` while the producer steps until it holds no
    request (every lease released). Returns the decode's tokens and the
    producer's free blocks after."""
    params = prefill(producer, prompts)
    return producer.step_during(
        lambda: tokens(decode.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)))


STARVATION_BOUNDS = {"load_timeout_s": 120.0, "lease_ttl_s": 120.0, "read_timeout_s": 60.0}
"""A TP=2 vLLM engine's two workers spin (``shm_broadcast`` dequeue, pinned one per
core by ``VLLM_CPU_OMP_THREADS_BIND``): on this 2-core host, with any load beside
them, the decode process was seen getting no CPU for 25-37 s (a ``sleep 0.2`` took
15.6 s), past the 30 s load and lease bounds, and its loads recomputed. These tests
check where the KV came from, not how fast: the bounds leave room for that, and
every wait still ends within them."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tiny_model import build_tiny_llama

    # Built here, once: the two engines start together and must not write one model dir at once.
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("llama-push-tp"), **MODEL)
    logs = tmp_path_factory.mktemp("push-tp-logs")
    started = {"tp1": engine("push-tp1", model_dir, logs), "tp2": engine("push-tp2", model_dir, logs)}
    try:
        started["tp1"].begin_start(config("kv_both", mode="push", kv_load_failure_policy="recompute",
                                          **STARVATION_BOUNDS), model=MODEL)
        started["tp2"].begin_start(config("kv_both", free_base_port(2), mode="push",
                                          kv_load_failure_policy="recompute", **STARVATION_BOUNDS),
                                   model=MODEL, **TP2)
        for e in started.values():
            e.wait_started()
        # Requests without kv_transfer_params are plain ones (prefix caching is off).
        reference = tokens(started["tp1"].generate(PD_PROMPTS, max_tokens=MAX_TOKENS))
        yield {"plain": reference, **started}
    finally:
        for e in started.values():
            e.close()


@pytest.mark.slow  # not in CI: fails under load here (below), an open finding of issue 30
def test_push_prefill_tp2_decode_tp1(engines: dict[str, Any]) -> None:
    """A TP=2 producer writing into a TP=1 decode. Passes on a quiet host;
    with load beside it (2026-11-26: load 9-56 from other jobs) the TP=2
    producer's writes missed their deadline (10 s, and 60 s with
    ``STARVATION_BOUNDS``) and the loads recomputed: never silent, but not
    the KV pushed. Each TP worker process is pinned to one of the 2 cores
    and spins in vLLM's ``shm_broadcast`` dequeue while the engine steps;
    in push the writes are posted by that process (the pull direction has
    the decode's own process read), so they wait for the core the spin
    holds. Not resolved: see docs/rdma-connector.md, "Push mode"."""
    tp1, tp2, n = engines["tp1"], engines["tp2"], len(PD_PROMPTS)
    idle = tp2.free_blocks(settle_s=60.0)
    before = push_stats(tp1)
    decoded, free = push_pd(tp2, tp1)
    assert decoded == engines["plain"]
    assert free == idle, "the producer kept blocks after its pushes"
    after = push_stats(tp1)
    # Every load came by push, one push from each of the two producer ranks (its 2 heads).
    assert grew(before, after, "loads_ok") == n, after
    assert grew(before, after, "push_loads_done") == 2 * n, after
    assert grew(before, after, "push_loads_failed") == 0, after
    # The TP=2 producer's params of other prompts of the same lengths are
    # refused at admission (protocol 11; before it their KV was pushed and
    # every output changed, silently): no push, computed locally.
    control, _ = push_pd(tp2, tp1, CONTROL_PROMPTS)
    assert control == engines["plain"], "params of other prompts changed the outputs: their KV was pushed"
    assert grew(before, push_stats(tp1), "loads_ok") == n
    assert push_stats(tp1).get("push_loads_failed", 0) == 0
    assert tp1.log().count("kv_transfer_params['remote_prompt_digest'] is ") == n
    assert "KV load failed" not in tp1.log()


@pytest.mark.slow  # not in CI: under load a TP=2 decode's workers starve too (below)
def test_push_prefill_tp1_decode_tp2(engines: dict[str, Any]) -> None:
    """A TP=1 producer writing each TP=2 decode rank the heads it owns.
    Passes on a quiet host (6 of 6 runs); with two busy loops beside it one
    run of three failed: a TP=2 decode rank's loads stayed "reading" for the
    whole 120 s bound (recomputed). Its worker process spins on its pinned
    core as the producer's does in the test above, and the push's
    completion (the notification, or PUSH_QUERY's answer) is handled by
    threads of that process."""
    tp1, tp2, n = engines["tp1"], engines["tp2"], len(PD_PROMPTS)
    idle = tp1.free_blocks(settle_s=60.0)
    before = push_stats(tp1)
    decoded, free = push_pd(tp1, tp2)
    assert decoded == engines["plain"]
    assert free == idle, "the producer kept blocks after its pushes"
    after = push_stats(tp1)
    # The producer wrote each prompt twice: into each decode rank, the 2 heads it owns.
    assert grew(before, after, "push_done") == 2 * n, after
    assert grew(before, after, "push_failed") + grew(before, after, "push_refused") == 0, after
    assert grew(before, after, "push_written_bytes") > 0, after
    # Params of other prompts: refused at admission, nothing pushed (protocol 11).
    control, _ = push_pd(tp1, tp2, CONTROL_PROMPTS)
    assert control == engines["plain"], "params of other prompts changed the outputs: their KV was pushed"
    assert tp2.log().count("kv_transfer_params['remote_prompt_digest'] is ") == n
    assert grew(before, push_stats(tp1), "push_done") == 2 * n
    assert "KV load failed" not in tp2.log()
