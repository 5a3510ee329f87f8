"""The producer's leases and vLLM's memory, inside real vLLM (a producer
engine alone: no decode is needed).

- ``test_leases_over_a_shared_prefix_count_its_blocks_once`` (prefix
  caching on): vLLM's prefix cache gives prefills with a common prefix (a
  system prompt) the same blocks, so their leases name the same block ids. The scheduler
  counts what leases hold against ``lease_max_share`` (memory pressure
  ends the oldest leases beyond it): it must count the blocks vLLM really
  keeps, each once. Before, it added up each lease's blocks: four
  121-token prompts sharing 100 tokens counted 16 held blocks where vLLM
  kept 7, and pressure reclaimed leases (their decodes recomputed) that
  freed nothing.
- ``test_a_prefill_waiting_for_blocks_held_by_leases_reclaims_them``: a
  prompt that cannot get blocks while leases hold more than
  ``lease_max_share`` makes the producer end the oldest lease, and runs at
  once (not after the leases' TTL).
- ``test_a_prefill_left_for_the_next_step_by_the_token_budget_reclaims_nothing``:
  vLLM asks about a request and leaves it for the next step for its token
  budget (chunked prefill off), blocks to spare: no lease ends. Before,
  every such step ended the oldest leases over the share.

Run in the vLLM venv (scripts/install-vllm.sh); skipped elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from engine_proc import EngineProcess  # noqa: E402
from test_vllm_rdma_pd import prefill, rdma_config  # noqa: E402
from tiny_model import BLOCK_SIZE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(240)]

SYSTEM = " ".join(["one two three four five six seven eight nine ten"] * 10)  # 100 tokens (+ BOS)
TAILS = ("red green blue yellow black white orange purple red green",
         "green blue yellow black white orange purple red green blue",
         "blue yellow black white orange purple red green blue yellow",
         "yellow black white orange purple red green blue yellow black")
PROMPTS = tuple(f"{SYSTEM} {tail} {tail}" for tail in TAILS)  # 121 tokens: 3 blocks shared, the 4th not


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


def test_leases_over_a_shared_prefix_count_its_blocks_once(model_dir: str, log_dir: Path) -> None:
    with EngineProcess("prefill-prefix", model_dir, log_dir) as producer:
        producer.start(rdma_config("kv_producer"), enable_prefix_caching=True)
        free = producer.free_blocks()
        params = prefill(producer, PROMPTS)
        shared = (101 // BLOCK_SIZE)  # whole blocks of the common prefix
        blocks = [p["remote_block_ids"] for p in params]
        assert all(b[:shared] == blocks[0][:shared] for b in blocks), blocks  # one prefix, one set of blocks
        assert len({b[shared] for b in blocks}) == len(PROMPTS), blocks
        kept = free - producer.free_blocks()  # what vLLM holds for the leases (delay_free)
        assert kept == shared + len(PROMPTS), (kept, blocks)
        assert producer.held_blocks() == kept  # before: 16, each lease's 4 blocks added up


def test_a_prefill_waiting_for_blocks_held_by_leases_reclaims_them(model_dir: str, log_dir: Path) -> None:
    """16 blocks; three prefills' leases hold 12 (TTL 200 s, nobody reads
    them); a 193-token prompt needs 7 of the 3 left. vLLM asks about it,
    cannot allocate, and the producer ends the oldest lease (down to half
    the cache): the prompt runs at once, not after the TTL."""
    from tiny_model import KV_CACHE_MEMORY_BYTES

    with EngineProcess("prefill-pressure", model_dir, log_dir, timeout_s=90.0) as producer:
        producer.start(rdma_config("kv_producer", lease_ttl_s=200.0),
                       kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES // 32)  # 16 blocks
        free = producer.free_blocks()
        prefill(producer, PROMPTS[:3])  # 121 tokens: 4 blocks each (prefix caching off): 12 held
        assert free - producer.free_blocks() == 12
        long = " ".join(["red green blue yellow black white orange purple"] * 24)  # 193 tokens: 7 blocks
        out = producer.generate([long], max_tokens=1)["outputs"][0]
        assert out["finish_reason"] == "length" and len(out["prompt_token_ids"]) > 6 * BLOCK_SIZE
        assert "ended the" in producer.log() and "oldest lease(s)" in producer.log()


def test_a_prefill_left_for_the_next_step_by_the_token_budget_reclaims_nothing(model_dir: str,
                                                                                log_dir: Path) -> None:
    """64 blocks; nine prefills' leases hold 36 (over half). Two 193-token
    prompts together: with chunked prefill off and 256 tokens a step, vLLM
    asks about the second, finds the first took the step's budget and
    leaves it for the next step. Its blocks were there (27 free, 14
    needed): no request waited for memory, and no lease may end."""
    from tiny_model import KV_CACHE_MEMORY_BYTES

    with EngineProcess("prefill-budget", model_dir, log_dir, timeout_s=90.0) as producer:
        producer.start(rdma_config("kv_producer", lease_ttl_s=200.0),
                       kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES // 8,  # 64 blocks
                       enable_chunked_prefill=False)
        free = producer.free_blocks()
        prefill(producer, PROMPTS * 2 + PROMPTS[:1])
        assert free - producer.free_blocks() == 36
        long = " ".join(["red green blue yellow black white orange purple"] * 24)  # 193 tokens: 7 blocks
        outs = producer.generate([long, long], max_tokens=1)["outputs"]
        assert [o["finish_reason"] for o in outs] == ["length", "length"]
        assert "oldest lease(s)" not in producer.log(), producer.log()[-1500:]
        assert free - producer.free_blocks() == 36  # every lease still holds its blocks
