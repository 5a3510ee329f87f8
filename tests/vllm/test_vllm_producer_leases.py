"""The producer's count of the blocks its leases hold, inside real vLLM
(a producer engine alone, prefix caching on: no decode is needed).

- ``test_leases_over_a_shared_prefix_count_its_blocks_once``: vLLM's
  prefix cache gives prefills with a common prefix (a system prompt) the
  same blocks, so their leases name the same block ids. The scheduler
  counts what leases hold against ``lease_max_share`` (memory pressure
  ends the oldest leases beyond it): it must count the blocks vLLM really
  keeps, each once. Before, it added up each lease's blocks: four
  121-token prompts sharing 100 tokens counted 16 held blocks where vLLM
  kept 7, and pressure reclaimed leases (their decodes recomputed) that
  freed nothing.

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
