"""A hybrid model inside real vLLM: sliding-window layers around a
full-attention layer, with vLLM's hybrid KV-cache manager left on.

The tiny Llama gets ``layer_types = [sliding, full, sliding]`` and a
window of 32 tokens (block size 32), so vLLM runs three KV-cache groups
(one per layer here) and frees a sliding layer's blocks once they leave
the window. Prompts of 7, 32 (exactly one window), 37, 63, 64, 95 and 100
tokens: the longer ones have blocks outside the window, which the
connector must not read (and the decode engine does not even keep); at 63
and 95 the window starts exactly on a block boundary.

``test_hybrid_pd_matches_plain_with_hma_on`` (the four engines start
together, each a separate process):

- no engine (plain, producer, consumer, control producer) logs that vLLM
  turned its hybrid KV-cache manager off, and each runs several KV-cache
  groups (the positive check: a connector vLLM does not consider
  ``SupportsHMA`` would leave one);
- the decode output equals a plain engine's;
- the consumer's connector stats report bytes not read because they lie
  outside the window (``nbytes_skipped`` > 0);
- control: a producer with other weights changes every decode output of a
  prompt longer than one block, so the KV really came over the wire.

``test_hybrid_push_matches_plain_with_hma_on``: the same model in push mode
(``"mode": "push"`` on both engines, sequential dispatch: the decode's worker
sends PUSH with its blocks of each KV-cache group, and the producer writes
every group's blocks at once, its whole-request write: layer-wise writes
apply to single-group models only):

- both engines keep the hybrid KV-cache manager on, several groups;
- the decode output equals the plain output (the producer's own, for
  requests without params); the producer engine keeps stepping meanwhile,
  as an online engine's loop does (offline, vLLM steps only inside
  ``generate()``, and a push needs the prefill's lease shipped to the
  producer's worker by its next step), and has every block back after;
- every load came by push (``push_loads_done``), none failed, and the
  blocks outside the window were not written (``nbytes_skipped`` > 0);
- control: params of other prompts of the same lengths are refused at
  admission (``remote_prompt_digest``): nothing pushed, every output
  computed locally (before protocol 11 they were pushed and changed every
  output, silently).

Run in the vLLM venv (scripts/install-vllm.sh); skipped elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from engine_proc import EngineProcess  # noqa: E402
from test_vllm_rdma_pd import rdma_config  # noqa: E402
from tiny_model import BLOCK_SIZE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(300)]

WINDOW = 32
HYBRID = {"num_layers": 3, "sliding_window": WINDOW,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
_COUNT = "one two three four five six seven eight nine ten".split()
# BOS + one token per word: 7, 32, 37, 63, 64, 95 and 100 tokens. At 63
# and 95, P - W + 1 is a multiple of the block size: the window of the
# last prompt token starts exactly on a block boundary, so an off-by-one in
# which blocks the window needs drops (or keeps) a whole block.
PROMPTS = (
    "the cat sat on the mat",
    " ".join((_COUNT * 4)[:31]),
    " ".join(["a quick brown fox jumps over the lazy dog"] * 4),
    " ".join((_COUNT * 7)[:62]),
    " ".join((_COUNT * 7)[:63]),
    " ".join((_COUNT * 10)[:94]),
    " ".join((_COUNT * 10)[:99]),
)
# The same token counts, words none of PROMPTS has (tiny_model's corpus).
_COLORS = "red green blue yellow black white orange purple".split()
CONTROL_PROMPTS = tuple(" ".join((_COLORS * 16)[:len(p.split(" "))]) for p in PROMPTS)
MAX_TOKENS = 8
TURNED_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-logs")


def tokens(reply: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for o in reply["outputs"]]


def prefill(engine: EngineProcess) -> list[dict[str, Any]]:
    outputs = engine.generate(PROMPTS, max_tokens=1,
                              kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))["outputs"]
    return [o["kv_transfer_params"] for o in outputs]


def check_hybrid(engine: EngineProcess) -> None:
    assert TURNED_OFF not in engine.log(), f"{engine.name}: vLLM turned its hybrid KV-cache manager off"
    groups = engine.kv_cache_groups()
    assert "SlidingWindowSpec" in groups and len(groups) > 1, (engine.name, groups)


def test_hybrid_pd_matches_plain_with_hma_on(tmp_path_factory: pytest.TempPathFactory,
                                             log_dir: Path) -> None:
    model_dir = str(tmp_path_factory.mktemp("hybrid-llama"))
    other_dir = str(tmp_path_factory.mktemp("hybrid-llama-other"))
    # Built here, once, so that the engines below (started together: about
    # half the wall time of one after the other) never write one model dir at once.
    from tiny_model import build_tiny_llama

    build_tiny_llama(model_dir, **HYBRID)
    build_tiny_llama(other_dir, **HYBRID, seed=1)

    plain_engine = EngineProcess("hybrid-plain", model_dir, log_dir, timeout_s=300)
    producer = EngineProcess("hybrid-prefill", model_dir, log_dir, timeout_s=300)
    consumer = EngineProcess("hybrid-decode", model_dir, log_dir, timeout_s=300)
    other = EngineProcess("hybrid-prefill-other-weights", other_dir, log_dir, timeout_s=300)
    try:
        plain_engine.begin_start(model=HYBRID)
        producer.begin_start(rdma_config("kv_producer"), model=HYBRID)
        consumer.begin_start(rdma_config("kv_consumer"), model=HYBRID)
        other.begin_start(rdma_config("kv_producer"), model={**HYBRID, "seed": 1})
        for engine in (plain_engine, producer, consumer, other):
            engine.wait_started()
            check_hybrid(engine)

        reply = plain_engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        plain_engine.close()
        lengths = [len(o["prompt_token_ids"]) for o in reply["outputs"]]
        assert lengths == [7, 32, 37, 63, 64, 95, 100], lengths
        assert lengths[-1] > WINDOW + BLOCK_SIZE  # at least one whole block outside the window
        plain = tokens(reply)

        params = prefill(producer)
        decoded = tokens(consumer.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params))
        stats = consumer.kv_stats()
        assert stats is not None and stats["totals"]["loads_ok"] == len(PROMPTS), stats
        skipped = {r["request_id"]: r["nbytes_skipped"] for r in stats["requests"]}
        assert stats["totals"]["nbytes_skipped"] > 0, f"no load skipped a block outside the window: {skipped}"
        assert decoded == plain
        assert "KV load failed" not in consumer.log()
        # One list of block ids per KV-cache group; a sliding group's list
        # holds only the blocks inside the window (100 tokens, window 32:
        # the last two of four blocks).
        longest = params[-1]["remote_block_ids"]
        assert len(longest) == len(producer.kv_cache_groups()) > 1
        assert sorted(len(g) for g in longest) == [2, 2, 4], longest

        control = tokens(consumer.generate(PROMPTS, max_tokens=MAX_TOKENS,
                                           kv_transfer_params=prefill(other)))
        differ = [c != p for c, p in zip(control, plain)]
        assert all(differ), f"a producer with other weights left outputs unchanged: {differ}"
    finally:
        for engine in (plain_engine, producer, consumer, other):
            engine.close()


def test_hybrid_push_matches_plain_with_hma_on(tmp_path_factory: pytest.TempPathFactory,
                                               log_dir: Path) -> None:
    from tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("hybrid-llama-push"), **HYBRID)
    producer = EngineProcess("hybrid-push-prefill", model_dir, log_dir, timeout_s=300)
    consumer = EngineProcess("hybrid-push-decode", model_dir, log_dir, timeout_s=300)
    try:
        producer.begin_start(rdma_config("kv_producer", mode="push"), model=HYBRID)
        consumer.begin_start(rdma_config("kv_consumer", mode="push"), model=HYBRID)
        for engine in (producer, consumer):
            engine.wait_started()
            check_hybrid(engine)

        # Requests without kv_transfer_params are plain ones (prefix caching is off).
        plain = tokens(producer.generate(PROMPTS, max_tokens=MAX_TOKENS))
        idle = producer.free_blocks(settle_s=60.0)
        params = prefill(producer)
        assert sorted(len(g) for g in params[-1]["remote_block_ids"]) == [2, 2, 4], params[-1]
        decoded, free = _push_decode(producer, consumer, params)
        assert free == idle, "the producer kept blocks after its pushes"
        stats = consumer.kv_stats()
        assert stats is not None, "the decode's connector reported nothing"
        totals = stats["totals"]
        assert totals["loads_ok"] == len(PROMPTS), totals
        assert totals.get("push_loads_done", 0) == len(PROMPTS), f"not every load came by push: {totals}"
        assert totals.get("push_loads_failed", 0) == 0, totals
        assert totals["nbytes_skipped"] > 0, f"blocks outside the window were pushed: {totals}"
        assert decoded == plain
        assert "KV load failed" not in consumer.log()

        # Params of other prompts of the same lengths (a router mixing
        # requests' params up) are refused at admission: no push, each prompt
        # computed locally. (Before protocol 11 their KV was pushed and every
        # output changed, with no error.)
        control, _ = _push_decode(producer, consumer, _control_params(producer))
        assert control == plain, "params of other prompts changed the outputs: their KV was pushed"
        after = consumer.kv_stats()
        assert after is not None and after["totals"]["loads_ok"] == len(PROMPTS), after["totals"]
        log = consumer.log()
        assert log.count("kv_transfer_params['remote_prompt_digest'] is ") == len(PROMPTS), log[-2000:]
        assert "KV load failed" not in log
    finally:
        for engine in (producer, consumer):
            engine.close()


def _push_decode(producer: EngineProcess, consumer: EngineProcess, params: list[dict[str, Any]]
                 ) -> tuple[list[list[int]], int]:
    """Decode with ``params`` while the producer steps (offline, vLLM steps
    only inside ``generate()``; a push needs the prefill's lease shipped to
    the producer's worker, which its next step does) until it holds no
    request: the decode's tokens and the producer's free blocks after."""
    return producer.step_during(
        lambda: tokens(consumer.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)))


def _control_params(engine: EngineProcess) -> list[dict[str, Any]]:
    outputs = engine.generate(CONTROL_PROMPTS, max_tokens=1,
                              kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))["outputs"]
    assert [len(o["prompt_token_ids"]) for o in outputs] == [7, 32, 37, 63, 64, 95, 100]
    return [o["kv_transfer_params"] for o in outputs]
