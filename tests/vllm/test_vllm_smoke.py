"""Smoke test against real vLLM: the tiny model runs one greedy batch through
``RecordingConnector`` (loaded by ``kv_connector_module_path``), and the
calls vLLM 0.32 made are checked against the contract rdma-kv relies on
(docs/vllm-notes.md).

Skipped where vLLM is not installed (the main test venv); run it in the
vLLM venv made by scripts/install-vllm.sh:

    .venv-vllm/bin/python -m pytest tests/vllm -q                 # ~50 s
    .venv-vllm/bin/python -m pytest tests/vllm -q -m "not slow"   # ~20 s

The in-process run (multiprocessing off) is shared by the tests through a
module fixture; the ``slow`` test repeats it with multiprocessing on, in a
child process.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    # vLLM imports the connector by module name; spawned engine processes
    # inherit sys.path from this one.
    sys.path.insert(0, str(HERE))

from tiny_model import (  # noqa: E402
    PROMPTS,
    UNSET_ENV,
    build_tiny_llama,
    generate_greedy,
    vllm_env,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run (multiprocessing off): outputs and the recorded calls."""
    from recording_connector import read_records

    tmp = tmp_path_factory.mktemp("vllm")
    record_path = tmp / "calls.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in vllm_env(multiprocessing=False).items():
            mp.setenv(key, value)
        for key in UNSET_ENV:
            mp.delenv(key, raising=False)
        model = build_tiny_llama(tmp / "model")
        outputs = generate_greedy(
            model,
            PROMPTS,
            max_tokens=MAX_TOKENS,
            kv_transfer_config={
                "kv_connector": "RecordingConnector",
                "kv_connector_module_path": "recording_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"record_path": str(record_path)},
            },
            kv_transfer_params=[{"do_remote_decode": True}] + [None] * (len(PROMPTS) - 1),
        )
    return {"outputs": outputs, "calls": read_records(record_path)}


def _engine_request_ids(recorded: dict) -> list[str]:
    """The engine-side request id of each output, as the connector saw it
    (RecordingConnector.request_finished returns it in the params)."""
    return [o["kv_transfer_params"]["recorded_request_id"] for o in recorded["outputs"]]


def _methods(calls: list[dict], role: str) -> list[str]:
    return [c["method"] for c in calls if c["role"] == role]


def test_outputs_and_params_flow(recorded: dict) -> None:
    outputs = recorded["outputs"]
    assert [len(o["token_ids"]) for o in outputs] == [MAX_TOKENS] * len(PROMPTS)
    # request_finished's params reach RequestOutput.kv_transfer_params; the
    # connector sees the engine's request id, "<user id>-<8 random chars>".
    ids = _engine_request_ids(recorded)
    for o, rid in zip(outputs, ids):
        assert rid.startswith(o["request_id"] + "-") and len(rid) == len(o["request_id"]) + 9
    # The prefill-style params travelled in through SamplingParams.extra_args.
    first = [c for c in recorded["calls"] if c["method"] == "get_num_new_matched_tokens"]
    seen = {c["args"][0]["request_id"]: c["args"][0]["kv_transfer_params"] for c in first}
    assert seen[ids[0]] == {"do_remote_decode": True}
    assert seen[ids[1]] is None


def test_one_instance_per_role_in_one_process(recorded: dict) -> None:
    inits = [c for c in recorded["calls"] if c["method"] == "__init__"]
    assert sorted(c["role"] for c in inits) == ["SCHEDULER", "WORKER"]
    assert len({c["pid"] for c in recorded["calls"]}) == 1  # multiprocessing off


def test_register_kv_caches_cpu_layout(recorded: dict) -> None:
    (reg,) = [c for c in recorded["calls"] if c["method"] == "register_kv_caches"]
    caches = reg["args"][0]
    assert list(caches) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    # [num_blocks, num_kv_heads, block_size, 2 * head_dim], fp32, contiguous,
    # every layer a view of one allocation, layer-outermost.
    storages = {t["storage_ptr"] for t in caches.values()}
    assert len(storages) == 1
    offsets = []
    for t in caches.values():
        num_blocks, kv_heads, block_size, two_head = t["shape"]
        assert (kv_heads, block_size, two_head) == (2, 32, 64)
        assert t["dtype"] == "torch.float32" and t["contiguous"]
        offsets.append(t["storage_offset"] * 4)
    layer_nbytes = caches["model.layers.0.self_attn.attn"]["nbytes"]
    assert offsets == [0, layer_nbytes]
    assert reg["args"][0]["model.layers.0.self_attn.attn"]["storage_nbytes"] == 2 * layer_nbytes


def test_call_order(recorded: dict) -> None:
    calls = recorded["calls"]
    order = [(c["role"], c["method"]) for c in calls]
    first = {key: order.index(key) for key in reversed(order)}
    w, s = "WORKER", "SCHEDULER"
    # Worker registration and the handshake-metadata exchange precede the
    # first step.
    assert first[w, "register_kv_caches"] < first[s, "build_connector_meta"]
    assert first[w, "get_handshake_metadata"] < first[s, "set_xfer_handshake_metadata"]
    assert first[s, "set_xfer_handshake_metadata"] < first[s, "build_connector_meta"]

    worker = _methods(calls, "WORKER")
    scheduler = _methods(calls, "SCHEDULER")
    steps = scheduler.count("build_connector_meta")
    assert steps >= MAX_TOKENS
    for name in ("bind_connector_metadata", "start_load_kv", "wait_for_save",
                 "get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata"):
        assert worker.count(name) == steps, name
    assert scheduler.count("update_connector_output") >= steps

    # One worker step, as 0.32 calls it with no synchronous load: the layer
    # hooks run inside the forward, start_load_kv only after it.
    end = worker.index("clear_connector_metadata")
    step = worker[worker.index("bind_connector_metadata"):end + 1]
    core = [m for m in step if m in {
        "bind_connector_metadata", "wait_for_layer_load", "save_kv_layer", "start_load_kv",
        "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
        "clear_connector_metadata"}]
    assert core == [
        "bind_connector_metadata",
        "wait_for_layer_load", "save_kv_layer",
        "wait_for_layer_load", "save_kv_layer",
        "start_load_kv", "wait_for_save", "get_finished",
        "get_block_ids_with_load_errors", "clear_connector_metadata",
    ]


def test_admission_and_finish_per_request(recorded: dict) -> None:
    calls = recorded["calls"]
    ids = _engine_request_ids(recorded)

    def by_request(method: str) -> Counter:
        return Counter(c["args"][0]["request_id"] for c in calls if c["method"] == method)

    assert by_request("request_finished") == Counter(ids)  # exactly once each
    assert by_request("update_state_after_alloc") == Counter(ids)
    for c in calls:
        if c["method"] == "update_state_after_alloc":
            request, blocks, num_external = c["args"]
            assert num_external == 0
            assert len(blocks["block_ids"][0]) == -(-request["num_prompt_tokens"] // 32)
    for rid in ids:
        admitted = [i for i, c in enumerate(calls) if c["method"] == "get_num_new_matched_tokens"
                    and c["args"][0]["request_id"] == rid]
        allocated = [i for i, c in enumerate(calls) if c["method"] == "update_state_after_alloc"
                     and c["args"][0]["request_id"] == rid]
        finished = [i for i, c in enumerate(calls) if c["method"] == "request_finished"
                    and c["args"][0]["request_id"] == rid]
        assert admitted[0] < allocated[0] < finished[0]
    # Shutdown reaches both instances, last.
    assert [c["role"] for c in calls if c["method"] == "shutdown"] == ["WORKER", "SCHEDULER"]


_MP_SCRIPT = """
import json, os, sys
if __name__ == "__main__":
    # Only the launching process gets the sys.path entry; spawned engine
    # processes must inherit it (multiprocessing passes sys.path to them).
    sys.path.insert(0, sys.argv[1])
    from tiny_model import PROMPTS, apply_vllm_env, generate_greedy
    apply_vllm_env(multiprocessing=True)
    out = generate_greedy(sys.argv[2], PROMPTS, max_tokens=int(sys.argv[4]),
        kv_transfer_config={"kv_connector": "RecordingConnector",
                            "kv_connector_module_path": "recording_connector",
                            "kv_role": "kv_both",
                            "kv_connector_extra_config": {"record_path": sys.argv[3]}})
    print(json.dumps({"pid": os.getpid(), "token_ids": [o["token_ids"] for o in out]}))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multiprocessing_on_loads_connector_in_every_process(
    recorded: dict, tmp_path: Path
) -> None:
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: front end, EngineCore and Worker are
    three processes (spawned); the connector module, importable through a
    sys.path entry of the launcher only, loads in the two that use it, and
    the output equals the in-process run. About 30 s."""
    import json
    import subprocess

    from recording_connector import read_records

    model = build_tiny_llama(tmp_path / "model")
    record_path = tmp_path / "calls.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", _MP_SCRIPT, str(HERE), model, str(record_path), str(MAX_TOKENS)],
        capture_output=True, text=True, timeout=170,
        env={k: v for k, v in os.environ.items() if k not in UNSET_ENV},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # vLLM logs to stdout too: take our line, wherever it is.
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"pid": ')]
    result = json.loads(line)
    assert result["token_ids"] == [o["token_ids"] for o in recorded["outputs"]]

    calls = read_records(record_path)
    roles_by_pid: dict[int, set] = {}
    for c in calls:
        roles_by_pid.setdefault(c["pid"], set()).add(c["role"])
    assert sorted(map(sorted, roles_by_pid.values())) == [["SCHEDULER"], ["WORKER"]]
    assert result["pid"] not in roles_by_pid  # the front end holds no connector
