"""``NixlConnector``: ``RdmaKVConnector`` under the name P/D frameworks key on.

NVIDIA Dynamo (1.6, ``dynamo/vllm/kv_connector_protocols.py``) picks the
request protocol of a vLLM prefill worker from
``kv_transfer_config.kv_connector`` and refuses any name it does not know;
SMG's gRPC servicer reports the same field to its router. rdma-kv speaks
NIXL's request protocol (``{"do_remote_decode": true}`` on the prefill leg,
the returned ``kv_transfer_params`` verbatim on the decode leg), so under
those frameworks it is configured as

    {"kv_connector": "NixlConnector", "kv_connector_module_path": "rdma_kv.vllm", ...}

vLLM loads the class from ``kv_connector_module_path`` (the module path
wins over its built-in registry), so this is rdma-kv's connector, not
vLLM's. vLLM 0.32 itself branches on the name "NixlConnector" (it refuses
``--enable-return-routed-experts``, asserts a decode-context-parallel size
of 1 or the TP size, pins ``cp_kv_cache_interleave_size`` to the block size
with DCP, and selects the DS Mamba conv-state layout on CPU): none of these
touch what rdma-kv relies on (tests/vllm/test_vllm_frameworks.py runs a P/D
pair under this name). Both engines of a pair must name the same module:
rdma-kv's params in a vLLM NixlConnector decode (or the reverse) fail the
load, and the request is recomputed or fails per
``kv_load_failure_policy``. See docs/deploy.md, "Routers".

Imports what ``rdma_kv.vllm.connector`` imports (vLLM's connector base).
"""

from __future__ import annotations

from rdma_kv.vllm.connector import RdmaKVConnector

__all__ = ["NixlConnector"]


class NixlConnector(RdmaKVConnector):
    """``RdmaKVConnector``, named for frameworks that select the NIXL request
    protocol by connector name (Dynamo, SMG over gRPC). Same behaviour, same
    ``kv_connector_extra_config`` keys; load it with
    ``kv_connector_module_path="rdma_kv.vllm"``.

    Its class name is ``RdmaKVConnector``: vLLM's ``MultiConnector`` keys
    each child's stats by the class name and rebuilds them in the API server
    from vLLM's connector registry, where "NixlConnector" is vLLM's own
    (whose stats class raised ``KeyError`` on rdma-kv's, stopping the
    server's output handler); only frameworks read the config's name."""


NixlConnector.__name__ = RdmaKVConnector.__name__  # (not __qualname__: pickle finds the class by that)
