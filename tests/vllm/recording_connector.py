"""``RecordingConnector``: a vLLM KV connector that moves nothing and records
every call vLLM makes to it, as JSON lines.

Load it out of tree::

    kv_transfer_config={
        "kv_connector": "RecordingConnector",
        "kv_connector_module_path": "recording_connector",   # module on sys.path
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"record_path": "/tmp/calls.jsonl"},
    }

Each line is one call: ``seq`` (per process), ``pid``, ``role``
(``SCHEDULER``/``WORKER``, or null for class methods), ``method``, ``args``
(a JSON summary: tensors by shape/dtype/stride/storage, vLLM objects by the
fields a connector reads), ``result`` (summary of what it returned) and
``caller`` (the vLLM frame that called it). Several processes append to the
same file (O_APPEND, one write per line).

Every public method of ``KVConnectorBase_V1`` is recorded, the defaults
included (they are wrapped at class creation), so the log shows what vLLM
0.32 really calls and in which order. The abstract methods do the minimum:
no external tokens, no loads, no saves. ``request_finished`` returns
``(False, {"recorded_request_id": ...})`` so the test can see connector
params reach ``RequestOutput.kv_transfer_params``.

This is a test tool: it imports vLLM and torch at import time.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import os
import sys
import threading
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

__all__ = ["RecordingConnector", "RecordingMetadata", "read_records"]

RECORD_PATH_KEY = "record_path"
RECORD_PATH_ENV = "RECORDING_CONNECTOR_PATH"

# Properties are read, not called, and would only add noise; methods whose
# name starts with "_" are vLLM-internal helpers and are not wrapped either.
_SKIP = {"role", "requires_kv_delivery", "supports_divergent_local_hybrid_hits"}


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSONL file, in call order within each process
    (sorted by ``(pid, seq)``; processes in order of first appearance)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    first: dict[int, int] = {}
    for i, r in enumerate(records):
        first.setdefault(r["pid"], i)
    return sorted(records, key=lambda r: (first[r["pid"]], r["seq"]))


# --- summaries -------------------------------------------------------------


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    storage = t.untyped_storage()
    return {
        "type": "Tensor",
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "stride": list(t.stride()),
        "contiguous": t.is_contiguous(),
        "data_ptr": t.data_ptr(),
        "storage_ptr": storage.data_ptr(),
        "storage_nbytes": storage.nbytes(),
        "storage_offset": t.storage_offset(),
        "nbytes": t.numel() * t.element_size(),
    }


def _request(r: Any) -> dict[str, Any]:
    return {
        "type": type(r).__name__,
        "request_id": r.request_id,
        "num_prompt_tokens": r.num_prompt_tokens,
        "num_tokens": r.num_tokens,
        "num_computed_tokens": r.num_computed_tokens,
        "num_output_tokens": len(r.output_token_ids),
        "status": str(r.status),
        "kv_transfer_params": _summary(r.kv_transfer_params),
    }


def _summary(x: Any, depth: int = 0) -> Any:
    """A JSON-able description of ``x``: types, shapes and the fields a
    connector would read, not the data. Never raises: a recorder must not
    change what it observes."""
    try:
        return _summary_unchecked(x, depth)
    except Exception as e:  # noqa: BLE001 - see docstring
        return {"type": type(x).__name__, "summary_error": repr(e)}


def _summary_unchecked(x: Any, depth: int) -> Any:
    if depth > 4:
        return type(x).__name__
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return _tensor(x)
    name = type(x).__name__
    if name == "Request" and hasattr(x, "request_id"):
        return _request(x)
    if name == "KVCacheBlocks":
        return {"type": name, "block_ids": [list(g) for g in x.get_block_ids()]}
    if name == "SchedulerOutput":
        cached = x.scheduled_cached_reqs
        return {
            "type": name,
            "scheduled_new_reqs": [
                {"req_id": n.req_id, "block_ids": [list(g) for g in n.block_ids],
                 "num_computed_tokens": n.num_computed_tokens, "prompt_len": n.prompt_len}
                for n in x.scheduled_new_reqs
            ],
            "scheduled_cached_reqs": {
                "req_ids": list(cached.req_ids),
                "resumed_req_ids": sorted(cached.resumed_req_ids),
                "new_block_ids": [None if b is None else [list(g) for g in b]
                                  for b in cached.new_block_ids],
                "num_computed_tokens": list(cached.num_computed_tokens),
                "num_output_tokens": list(cached.num_output_tokens),
            },
            "num_scheduled_tokens": dict(x.num_scheduled_tokens),
            "total_num_scheduled_tokens": x.total_num_scheduled_tokens,
            "finished_req_ids": sorted(x.finished_req_ids),
            "preempted_req_ids": None if x.preempted_req_ids is None
            else sorted(x.preempted_req_ids),
            "has_sync_kv_loads": x.has_sync_kv_loads,
            "new_block_ids_to_zero": x.new_block_ids_to_zero,
            "kv_connector_block_state": None if x.kv_connector_block_state is None
            else sorted(x.kv_connector_block_state.req_ids),
        }
    if name == "KVConnectorOutput":
        return {
            "type": name,
            "finished_sending": _summary(x.finished_sending, depth + 1),
            "finished_recving": _summary(x.finished_recving, depth + 1),
            "invalid_block_ids": sorted(x.invalid_block_ids),
            "failed_recving": sorted(x.failed_recving),
            "kv_connector_stats": _summary(x.kv_connector_stats, depth + 1),
            "kv_connector_worker_meta": type(x.kv_connector_worker_meta).__name__,
            "expected_finished_count": x.expected_finished_count,
        }
    if name == "ForwardContext":
        return {
            "type": name,
            "attn_metadata": type(x.attn_metadata).__name__,
            "no_compile_layers": len(getattr(x, "no_compile_layers", {}) or {}),
            "virtual_engine": getattr(x, "virtual_engine", None),
        }
    if name == "VllmConfig":
        kv = x.kv_transfer_config
        return {"type": name, "kv_transfer_config": _summary(
            {f: getattr(kv, f) for f in kv.__dataclass_fields__}, depth + 1)}
    if name == "KVCacheConfig":
        return {
            "type": name,
            "num_blocks": x.num_blocks,
            "kv_cache_tensors": [
                {f: _summary(getattr(t, f), depth + 1) for f in t.__dataclass_fields__}
                for t in x.kv_cache_tensors
            ],
            "kv_cache_layout": x.kv_cache_layout,
            "kv_cache_groups": [
                {"layer_names": list(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
                 "block_size": g.kv_cache_spec.block_size,
                 "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                 "spec_fields": {k: str(v) for k, v in vars(g.kv_cache_spec).items()}}
                for g in x.kv_cache_groups
            ],
        }
    if isinstance(x, KVConnectorRole):
        return x.name
    if isinstance(x, dict):
        return {str(k): _summary(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x, key=str) if isinstance(x, (set, frozenset)) else x
        return {"type": type(x).__name__, "items": [_summary(v, depth + 1) for v in items]}
    return {"type": f"{type(x).__module__}.{name}"}


def _caller() -> str:
    """The first frame outside this module: who in vLLM made the call."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    path = path.split("site-packages/")[-1]
    return f"{path}:{frame.f_lineno}:{frame.f_code.co_name}"


# --- the connector -----------------------------------------------------------


class RecordingMetadata(KVConnectorMetadata):
    """What build_connector_meta hands the worker: the step number only."""

    def __init__(self, step: int) -> None:
        self.step = step


_SEQ = itertools.count(1)
"""Per-process call number, taken when a call *starts* and shared by every
instance in the process, so ``(pid, seq)`` orders calls even across roles
and even though a record is written when its call returns."""


class _Recorder:
    def __init__(self, path: str | None) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps(record, default=str) + "\n"
        # One os.write per line on an O_APPEND descriptor: lines from several
        # processes do not interleave.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


_CLASS_RECORDER = _Recorder(os.environ.get(RECORD_PATH_ENV))


def _record_call(self_or_cls: Any, seq: int, method: str, args: tuple, kwargs: dict,
                 result: Any, error: BaseException | None, t0: float) -> None:
    recorder = getattr(self_or_cls, "_recorder", None)
    if not isinstance(recorder, _Recorder):
        recorder = _CLASS_RECORDER
    role = getattr(self_or_cls, "_role", None)
    recorder.write({
        "seq": seq,
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        "role": role.name if isinstance(role, KVConnectorRole) else None,
        "method": method,
        "args": [_summary(a) for a in args],
        "kwargs": {k: _summary(v) for k, v in kwargs.items()},
        "result": _summary(result),
        "error": None if error is None else repr(error),
        "t": t0,
        "duration_s": time.monotonic() - t0,
        "caller": _caller(),
    })


def _wrap(fn: Any, name: str) -> Any:
    @functools.wraps(fn)
    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        seq, t0 = next(_SEQ), time.monotonic()
        try:
            result = fn(self, *args, **kwargs)
        except BaseException as e:
            _record_call(self, seq, name, args, kwargs, None, e, t0)
            raise
        _record_call(self, seq, name, args, kwargs, result, None, t0)
        return result

    return recorded


class RecordingConnector(KVConnectorBase_V1):
    """Records vLLM's calls; transfers nothing. See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        seq, t0 = next(_SEQ), time.monotonic()
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._recorder = _Recorder(extra.get(RECORD_PATH_KEY) or os.environ.get(RECORD_PATH_ENV))
        self._step = 0
        _record_call(self, seq, "__init__", (vllm_config, role, kv_cache_config), {}, None, None,
                     t0)

    # --- abstract: worker side -------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # --- abstract: scheduler side ----------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._step += 1
        return RecordingMetadata(self._step)

    # --- defaults with a visible result ---------------------------------------

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, {"recorded_request_id": request.request_id,
                       "recorded_num_blocks": len(block_ids)}


def _install_recording() -> None:
    """Wrap every public method of KVConnectorBase_V1 (defaults and the
    overrides above) so that each call is recorded."""
    for name, member in inspect.getmembers(KVConnectorBase_V1):
        if name.startswith("_") or name in _SKIP:
            continue
        raw = inspect.getattr_static(KVConnectorBase_V1, name)
        own = RecordingConnector.__dict__.get(name)
        if isinstance(raw, property):
            continue
        if isinstance(raw, classmethod):
            fn = (own.__func__ if isinstance(own, classmethod) else raw.__func__)
            setattr(RecordingConnector, name, classmethod(_wrap(fn, name)))
        elif isinstance(raw, staticmethod):
            continue
        elif callable(raw):
            setattr(RecordingConnector, name, _wrap(own if own is not None else raw, name))
    RecordingConnector.__abstractmethods__ = frozenset()


_install_recording()
