"""rdma-kv under NVIDIA Dynamo's own P/D protocol code, inside real vLLM.

Dynamo 1.6.1 (``ai-dynamo``, installed ``--no-deps`` by
scripts/install-vllm.sh) picks the request protocol of a vLLM prefill
worker with ``make_kv_connector_protocol(vllm_config)``
(``dynamo/vllm/kv_connector_protocols.py``), keyed on
``kv_transfer_config.kv_connector``; any name it does not know is a
``ValueError``. The documented config (docs/deploy.md, snippet
``deploy-dynamo-config``) names ``NixlConnector`` from
``kv_connector_module_path: rdma_kv.vllm`` (``rdma_kv.vllm.compat``).

The test runs Dynamo's released code on a real ``VllmConfig`` built from
that config, then real vLLM engines (offline, ``engine_proc``) loaded from
the same config: the prefill gets Dynamo's prefill params, the decode gets
what Dynamo's protocol derives from the prefill's output, and its greedy
tokens equal a plain engine's, every load read over rdma-kv (the worker's
stats), with the connector rdma-kv's (its start-up line) and not vLLM's
NixlConnector (no NIXL agent). The same config under its own name,
``RdmaKVConnector``, is refused by Dynamo: the reason the compatibility
name exists.
"""

from __future__ import annotations

import copy
import json
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "docs"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from engine_proc import EngineProcess  # noqa: E402
from snippets import snippet  # noqa: E402
from tiny_model import PROMPTS  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(300)]

MAX_TOKENS = 8


def documented(role: str, secret_file: Path) -> dict[str, Any]:
    """The documented Dynamo config for ``role``, on this host: side channel
    on loopback, any free port, the secret in a file of the test's."""
    config = copy.deepcopy(json.loads(snippet("deploy-dynamo-config").code))
    assert config["kv_connector"] == "NixlConnector"
    assert config["kv_connector_module_path"] == "rdma_kv.vllm"
    config.update(kv_role=role, kv_port=0, kv_load_failure_policy="fail")
    extra = config["kv_connector_extra_config"]
    extra.update(side_channel_host="127.0.0.1", auth_secret_file=str(secret_file))
    extra.pop("advertise_host", None)
    return config


def test_dynamo_protocol_drives_rdma_kv_in_vllm(tmp_path: Path) -> None:
    kcp = pytest.importorskip("dynamo.vllm.kv_connector_protocols",
                              reason="ai-dynamo not installed (scripts/install-vllm.sh)")
    assert version("ai-dynamo") == "1.6.1"
    from vllm.config import KVTransferConfig, VllmConfig

    secret = tmp_path / "secret"
    secret.write_text("9f" * 32)
    secret.chmod(0o600)
    prefill_config = documented("kv_producer", secret)
    decode_config = documented("kv_consumer", secret)

    # Dynamo's own resolution, on vLLM's own config object.
    vllm_config = VllmConfig(kv_transfer_config=KVTransferConfig(**prefill_config))
    protocols = [kcp.make_kv_connector_protocol(vllm_config) for _ in PROMPTS]  # one per request
    assert all(type(p) is kcp.NixlConnectorProtocol for p in protocols)
    renamed = VllmConfig(kv_transfer_config=KVTransferConfig(**{**prefill_config,
                                                                "kv_connector": "RdmaKVConnector"}))
    with pytest.raises(ValueError, match="Unsupported kv_connector='RdmaKVConnector'"):
        kcp.make_kv_connector_protocol(renamed)

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    model_dir = str(tmp_path / "model")
    with EngineProcess("dynamo-plain", model_dir, log_dir) as plain:
        plain.start()
        want = [o["token_ids"] for o in plain.generate(PROMPTS, max_tokens=MAX_TOKENS)["outputs"]]
    with EngineProcess("dynamo-prefill", model_dir, log_dir) as prefill, \
            EngineProcess("dynamo-decode", model_dir, log_dir) as decode:
        prefill.begin_start(prefill_config)
        decode.begin_start(decode_config)
        prefill.wait_started()
        decode.wait_started()
        first = prefill.generate(PROMPTS, max_tokens=1, kv_transfer_params=[
            p.prefill_request_kv_transfer_params() for p in protocols])["outputs"]
        params = [p.decode_request_kv_transfer_params(SimpleNamespace(**o))
                  for p, o in zip(protocols, first)]
        assert all(q and q["do_remote_prefill"] for q in params), params
        got = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)["outputs"]
        assert [o["token_ids"] for o in got] == want
        stats = decode.kv_stats()
        assert stats is not None and stats["totals"]["loads_ok"] == len(PROMPTS), stats
        assert "KV load failed" not in decode.log()
        for engine in (prefill, decode):
            log = engine.log()
            assert "rdma-kv worker" in log, log[-3000:]      # rdma-kv's connector started ...
            assert "nixl_agent" not in log.lower() and "NIXL is available" not in log  # ... not vLLM's
