"""Child of ``test_vllm_identity.py``: what the vLLM adapter puts into the
compatibility record inside a real vLLM 0.32 engine (CPU build, tiny Llama,
in-process worker): the derived model identity and, with
``--kv-cache-dtype fp8``, the attention layers' k/v scales, read when vLLM
builds the worker's connector (after it loaded the weights). Prints one
``RESULT`` line with the record's ``dtype``, ``model_id`` and
``kv_cache_scales``.

    PYTHONPATH=$PWD/src .venv-vllm/bin/python tests/vllm/identity_child.py MODEL_DIR [fp8|auto]
"""

from __future__ import annotations

import os
import sys

from tiny_model import build_tiny_llama, vllm_env

os.environ.update(vllm_env())


def main() -> None:
    root, dtype = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "fp8"
    from tiny_model import make_llm
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    model = build_tiny_llama(os.path.join(root, "tiny-llama"))
    llm = make_llm(model, kv_cache_dtype=dtype,
                   kv_transfer_config={"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
                                       "kv_role": "kv_both", "engine_id": "E", "kv_port": 0})
    compat = get_kv_transfer_group().connector.worker._compat
    print(f"RESULT dtype={compat.dtype!r} model_id={compat.model_id!r} kv_cache_scales={compat.kv_cache_scales!r}")
    del llm


if __name__ == "__main__":
    main()
