"""Timestamps of a KV connector's calls inside one offline vLLM engine, for
``bench/vllm_pd.py``'s breakdown of a decode request's first-token time.

:class:`ConnectorTrace` wraps, on the instances (multiprocessing off, so
the scheduler and the worker share this process), the engine's
``Scheduler.schedule`` and the connector calls that mark a remote load's
life: admission (``get_num_new_matched_tokens`` answering asynchronously),
the step metadata (``build_connector_meta``), the worker's
``start_load_kv`` and ``get_finished`` (when a request first appears in
``finished_recving``), and the worker's ``get_kv_connector_stats`` (its
per-load records, kept, then handed to vLLM unchanged). ``close``
restores every method. Any connector works; the records are the
connector's own (rdma-kv: ``LoadRecord`` fields).

Imports only the standard library at module level (vLLM is imported lazily).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class ConnectorTrace:
    def __init__(self, scheduler: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.steps: list[float] = []
        self.metas: list[float] = []
        self.start_loads: list[float] = []
        self.admitted: dict[str, float] = {}
        self.recving: dict[str, float] = {}
        self.records: list[dict[str, Any]] = []
        self._restore: list[tuple[Any, str]] = []
        sched_conn, worker_conn = scheduler.connector, get_kv_transfer_group()
        self._wrap(scheduler, "schedule", lambda r, *a: self.steps.append(time.monotonic()))
        self._wrap(sched_conn, "build_connector_meta", lambda r, *a: self.metas.append(time.monotonic()))
        self._wrap(sched_conn, "get_num_new_matched_tokens", self._on_matched)
        self._wrap(worker_conn, "start_load_kv", lambda r, *a: self.start_loads.append(time.monotonic()))
        self._wrap(worker_conn, "get_finished", self._on_finished)
        self._wrap(worker_conn, "get_kv_connector_stats", self._on_stats)

    def _wrap(self, obj: Any, name: str, after: Callable[..., None]) -> None:
        original = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            after(result, *args)
            return result

        setattr(obj, name, wrapper)
        self._restore.append((obj, name))

    def _on_matched(self, result: Any, request: Any, *rest: Any) -> None:
        if isinstance(result, tuple) and len(result) == 2 and result[1]:
            self.admitted.setdefault(request.request_id, time.monotonic())

    def _on_finished(self, result: Any, *args: Any) -> None:
        now = time.monotonic()
        for rid in (result[1] if result else None) or ():
            self.recving.setdefault(rid, now)

    def _on_stats(self, result: Any, *args: Any) -> None:
        data = getattr(result, "data", None)
        if isinstance(data, dict):
            self.records.extend(r for r in data.get("requests", ()) if isinstance(r, dict))

    def close(self) -> None:
        for obj, name in reversed(self._restore):
            delattr(obj, name)  # the instance attribute; the class method shows through again
        self._restore = []

    def result(self, t0: float) -> dict[str, Any]:
        """Everything, in seconds after ``t0`` (``time.monotonic``)."""
        def rel(xs: list[float]) -> list[float]:
            return [x - t0 for x in xs]
        return {"steps": rel(self.steps), "metas": rel(self.metas), "start_loads": rel(self.start_loads),
                "admitted": {k: v - t0 for k, v in self.admitted.items()},
                "recving": {k: v - t0 for k, v in self.recving.items()}, "records": self.records}
