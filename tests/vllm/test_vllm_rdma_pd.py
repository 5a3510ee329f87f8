"""End to end inside real vLLM: prefill instance -> rdma-kv -> decode instance.

Each engine is a separate process (``engine_proc.EngineProcess``), loaded
with ``kv_connector_module_path="rdma_kv.vllm"``; the tiny random Llama is
built locally (``tiny_model``). Greedy token ids of the decode instance are
compared with a plain run of the same prompts (all submitted together):

- ``test_pd_tokens_match_and_control``: identical for prompts of 7, 37,
  51, 64 and 71 tokens (shorter than a block, partial last blocks, exactly
  two blocks), every load counted ok in the decode's stats (a decode that
  recomputed would still match); then the control: the same decode given
  the (genuine) params of other prompts of the same lengths refuses them
  at admission (``remote_prompt_digest``, protocol 11): nothing is read,
  every output is computed locally (before, they loaded and changed every
  output, silently); and params edited to name other blocks of a live prefill are
  refused by the producer (the lease does not cover them): every request
  ends in an error under ``kv_load_failure_policy=fail``, nothing is read
  into an answer.
- ``test_producer_killed_recompute_and_fail``: the producer is SIGKILLed
  after the prefill, before any read. ``kv_load_failure_policy=recompute``:
  output still identical; ``fail``: every request ends with an error, and
  the log says why. Every wait is bounded.
- ``test_abort_during_load_frees_both_sides_and_serves_on``: decode
  requests aborted with their loads in flight; both engines get every block
  back (the producer through the released leases, not their expiry) and
  the pair then decodes like the plain run.
- ``test_pd_multiprocessing_on``: the first test's match with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (connector in EngineCore and Worker
  processes, handshake metadata crossing processes).

Run in the vLLM venv (scripts/install-vllm.sh); skipped elsewhere:

    .venv-vllm/bin/python -m pytest tests/vllm -q -m vllm
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
from tiny_model import BLOCK_SIZE, PROMPTS, build_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(240)]

# BOS + one token per word: 7, 37, 71 (tiny_model.PROMPTS), 51 and 64 tokens.
PD_PROMPTS = (
    *PROMPTS,
    " ".join(["one two three four five six seven eight nine ten"] * 5),
    " ".join(["red green blue yellow black white orange purple"] * 8).rsplit(" ", 1)[0],
)
# The same token counts (one token per word), other content: each prompt's
# length in the words of another prompt.
CONTROL_PROMPTS = tuple(
    " ".join((PD_PROMPTS[(i + 2) % len(PD_PROMPTS)].split(" ") * 64)[:len(p.split(" "))])
    for i, p in enumerate(PD_PROMPTS))
MAX_TOKENS = 8
WRONG_BLOCK_OFFSET = 200  # well inside the 512-block cache, far from any prompt's blocks


def rdma_config(role: str, **extra: Any) -> dict[str, Any]:
    """kv_transfer_config for RdmaKVConnector. ``kv_port`` 0: the producer's
    side channel takes a free port, published through vLLM's handshake
    metadata exchange (so parallel CI jobs never collide)."""
    policy = extra.pop("kv_load_failure_policy", "fail")
    return {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
            "kv_role": role, "kv_port": 0, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", **extra}}


def start_together(*engines: tuple[EngineProcess, dict[str, Any]]) -> None:
    """Start engines at once, each with its kv_transfer_config: their
    start-ups overlap."""
    for engine, kv_config in engines:
        engine.begin_start(kv_config)
    for engine, _ in engines:
        engine.wait_started()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Built here, once: engines started together never write it at once."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def plain(model_dir: str, log_dir: Path) -> list[list[int]]:
    """Reference token ids: no connector, one engine."""
    with EngineProcess("plain", model_dir, log_dir) as engine:
        engine.start()
        outputs = engine.generate(PD_PROMPTS, max_tokens=MAX_TOKENS)["outputs"]
    lengths = [len(o["prompt_token_ids"]) for o in outputs]
    assert lengths == [7, 37, 71, 51, 64], lengths
    assert lengths[0] < BLOCK_SIZE and any(n % BLOCK_SIZE for n in lengths[1:])
    return [o["token_ids"] for o in outputs]


def prefill(engine: EngineProcess, prompts: tuple[str, ...] = PD_PROMPTS, n: int = 1,
            cache_salt: str | None = None) -> list[dict[str, Any]]:
    """Run the prompts as prefill requests; the params a router would forward."""
    outputs = engine.generate(prompts, max_tokens=1,
                              kv_transfer_params=[{"do_remote_decode": True}] * len(prompts), n=n,
                              cache_salt=cache_salt)["outputs"]
    params = [o["kv_transfer_params"] for o in outputs]
    for o, p in zip(outputs, params):
        assert p is not None and p["do_remote_prefill"] is True and p["do_remote_decode"] is False
        assert p["remote_num_tokens"] == len(o["prompt_token_ids"])
        assert len(p["remote_block_ids"]) == -(-len(o["prompt_token_ids"]) // BLOCK_SIZE)
    return params


def tokens(reply: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for o in reply["outputs"]]


def run_match_and_control(plain: list[list[int]], model_dir: str, log_dir: Path,
                          *, multiprocessing: bool) -> None:
    tag = "mp" if multiprocessing else "inproc"
    producer = EngineProcess(f"prefill-{tag}", model_dir, log_dir, multiprocessing=multiprocessing)
    try:
        with EngineProcess(f"decode-{tag}", model_dir, log_dir,
                           multiprocessing=multiprocessing) as consumer:
            # Both instances up before the first prefill, as in a deployment: a
            # lease unclaimed for lease_ttl_s (30 s) expires, and an engine start
            # with multiprocessing on takes about that long here. (Started together.)
            start_together((producer, rdma_config("kv_producer")), (consumer, rdma_config("kv_consumer")))
            good = prefill(producer)
            spare = prefill(producer, CONTROL_PROMPTS)  # genuine params of other prompts of the same lengths
            # The params go verbatim, as a router forwards them (including the
            # remote_prefill_cached_tokens vLLM adds to them).
            assert tokens(consumer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS,
                                            kv_transfer_params=good)) == plain
            if multiprocessing:
                return
            stats = consumer.kv_stats()
            assert stats is not None and stats["totals"]["loads_ok"] == len(PD_PROMPTS), stats
            # The producer publishes held words (the default): loads whose grant had reached its
            # worker are vouched for by them, with no PIN (a later grant's load is CONFIRMed).
            totals = stats["totals"]
            assert totals.get("words_trusted", 0) >= 1 and totals.get("pin_rpcs", 0) == 0, totals
            assert totals.get("words_trusted", 0) + totals.get("words_fallbacks", 0) == len(PD_PROMPTS), totals
            # Genuine params of other prompts of the same lengths (a router
            # mixing requests' params up) are refused at admission: nothing is
            # read, each prompt is computed locally. (Before protocol 11 they
            # loaded, and every output changed with no error: the decode
            # generated from another prompt's KV. That the loaded bytes decide
            # the output is tests/vllm/test_vllm_hybrid.py's control.)
            control = tokens(consumer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS,
                                               kv_transfer_params=spare))
            assert control == plain, "params of other prompts changed the outputs: their KV was loaded"
            stats = consumer.kv_stats()
            assert stats is not None and stats["totals"]["loads_ok"] == len(PD_PROMPTS), stats
            log = consumer.log()
            assert log.count("kv_transfer_params['remote_prompt_digest'] is ") == len(PD_PROMPTS), log[-2000:]
            assert "KV load failed" not in log
            # n = 2: vLLM runs each as two child requests carrying its params (one
            # lease). Each child loaded under it, and the producer lets one claim
            # hold a lease: the other child's load was refused, and under
            # kv_load_failure_policy=fail (vLLM's default) its sample ended in an
            # error. Now one child loads, the other waits and takes its KV from
            # the decode's prefix cache. (Prompts this decode never computed: a
            # local hit would load nothing; top_k=1, so both samples are equal.)
            # The prefill runs n = 2 as well: vLLM hands over one child's params;
            # every child's lease pinned its blocks (the prefix cache shares them)
            # for lease_ttl_s (30 s) after the decode released the one it read.
            # Now the children share the first one's lease, and once the decode
            # has read and released it the producer holds nothing.
            free = producer.free_blocks(settle_s=10.0)
            reply = consumer.generate(CONTROL_PROMPTS, max_tokens=MAX_TOKENS,
                                      kv_transfer_params=prefill(producer, CONTROL_PROMPTS, n=2), n=2)
            samples = [o["samples"] for o in reply["outputs"]]
            assert [[s["finish_reason"] for s in ss] for ss in samples] == [["length", "length"]] * len(PD_PROMPTS), \
                (samples, consumer.log()[-3000:])
            assert all(ss[0]["token_ids"] == ss[1]["token_ids"] for ss in samples), samples
            assert "KV load failed" not in consumer.log()
            stats = consumer.kv_stats()
            assert stats is not None and stats["totals"]["loads_ok"] == 2 * len(PD_PROMPTS), stats
            # (At most 20 s for the decode's RELEASE on a loaded host: still inside the 30 s
            # TTL of the leases granted at the prefill, which a sibling's lease would outlive.)
            assert producer.free_blocks(settle_s=20.0) == free, "a child's lease kept blocks the decode never reads"
            # A cache salt (vLLM's per-tenant prefix-cache key) is bound with the prompt: the same
            # salt on both legs loads, another salt is refused at admission and computed locally
            # (before, the digest covered the token ids only and the other tenant's decode loaded).
            salted = consumer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, cache_salt="tenant-a",
                                       kv_transfer_params=prefill(producer, cache_salt="tenant-a"))
            assert tokens(salted) == plain
            stats = consumer.kv_stats()
            assert stats is not None and stats["totals"]["loads_ok"] == 3 * len(PD_PROMPTS), stats
            other = consumer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, cache_salt="tenant-b",
                                      kv_transfer_params=prefill(producer, cache_salt="tenant-a"))
            assert tokens(other) == plain
            stats = consumer.kv_stats()
            assert stats is not None and stats["totals"]["loads_ok"] == 3 * len(PD_PROMPTS), stats
            # (the control step's refusals above say the same: another prompt, or another salt)
            assert consumer.log().count("kv_transfer_params['remote_prompt_digest'] is ") == 2 * len(PD_PROMPTS)
            # Params edited to name other blocks (of live leases) are refused, never read into an answer.
            wrong = [{**p, "remote_block_ids": [b + WRONG_BLOCK_OFFSET for b in p["remote_block_ids"]]}
                     for p in prefill(producer)]
            reply = consumer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=wrong)
            reasons = [o["finish_reason"] for o in reply["outputs"]]
            assert reasons == ["error"] * len(PD_PROMPTS), reasons
            # FORGED once the grants reached the producer's worker; UNKNOWN before
            # (vLLM ships the last prefills' grants with its next step).
            log = consumer.log()
            assert "its token is genuine but the kv_transfer_params name other blocks" in log \
                or "never granted lease" in log, log[-2000:]
            log = producer.log()
            assert "altered to name blocks the lease does not cover" in log or "token does not verify" in log
    finally:
        producer.close()


def test_pd_tokens_match_and_control(plain: list[list[int]], model_dir: str,
                                     log_dir: Path) -> None:
    run_match_and_control(plain, model_dir, log_dir, multiprocessing=False)


def test_producer_killed_recompute_and_fail(plain: list[list[int]], model_dir: str,
                                            log_dir: Path) -> None:
    producer = EngineProcess("prefill-killed", model_dir, log_dir)
    with EngineProcess("decode-recompute", model_dir, log_dir) as recompute, \
            EngineProcess("decode-fail", model_dir, log_dir) as fail:
        try:
            start_together((producer, rdma_config("kv_producer")),
                           (recompute, rdma_config("kv_consumer", kv_load_failure_policy="recompute",
                                                   connect_timeout_s=1.0, rpc_retries=1)),
                           (fail, rdma_config("kv_consumer", kv_load_failure_policy="fail",
                                              connect_timeout_s=1.0, rpc_retries=1)))
            params = prefill(producer)
        finally:
            producer.kill()  # SIGKILL, before any decode read
        port = params[0]["remote_port"]

        reply = recompute.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
        assert tokens(reply) == plain
        assert f"handshake with 127.0.0.1:{port} failed" in recompute.log()

        consumer = fail
        reply = consumer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
        reasons = [o["finish_reason"] for o in reply["outputs"]]
        assert reasons == ["error"] * len(PD_PROMPTS), reasons
        log = consumer.log()
        assert "KV load failed" in log and f"handshake with 127.0.0.1:{port} failed" in log


def test_abort_during_load_frees_both_sides_and_serves_on(plain: list[list[int]], model_dir: str,
                                                          log_dir: Path) -> None:
    """Decode requests aborted while their KV loads are in flight (vLLM's
    WAITING_FOR_REMOTE_KVS): the decode engine hands every block back once
    the reads resolved, the producer frees its blocks because the leases were
    released (long before their 30 s TTL), and the same pair then decodes
    the prompts bit-for-bit like the plain run."""
    producer = EngineProcess("prefill-abort", model_dir, log_dir)
    try:
        with EngineProcess("decode-abort", model_dir, log_dir) as consumer:
            start_together((producer, rdma_config("kv_producer")), (consumer, rdma_config("kv_consumer")))
            idle = producer.free_blocks()
            doomed = prefill(producer)
            assert producer.free_blocks() < idle, "the producer did not hold the prefilled blocks"
            report = consumer.abort_during_load(PD_PROMPTS, doomed)
            print(f"abort during load in vLLM: {report}")
            assert report["loading_at_abort"] == len(PD_PROMPTS), report
            assert report["held_at_abort"] > 0 and report["free_after"] == report["free_before"], report
            assert producer.free_blocks(settle_s=60.0) == idle, "aborted loads left blocks held on the producer"
            assert tokens(consumer.generate(PD_PROMPTS, max_tokens=MAX_TOKENS,
                                            kv_transfer_params=prefill(producer))) == plain
            assert "Traceback" not in consumer.log() and "Traceback" not in producer.log()
    finally:
        producer.close()


def test_pd_multiprocessing_on(plain: list[list[int]], model_dir: str, log_dir: Path) -> None:
    run_match_and_control(plain, model_dir, log_dir, multiprocessing=True)
