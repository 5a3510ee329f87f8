"""Reading the stats' boundary form back: the dict ``WorkerStats.to_dict``
writes (what ``get_kv_connector_stats()`` returns and vLLM carries as
``KVConnectorStats.data``), parsed into ``rdma.stats``' typed records.

Strict: a key it does not know is a ``ValueError`` listing the valid ones,
and a value of the wrong type a ``TypeError`` naming the field. No
coercion, so ``"ok": "false"`` is not a success and a counter ``"7"`` or
``2.9`` is not a count: the dict crosses processes, and a wrong type there
is a bug upstream. An absent key reads as its default (0, empty, None).

Imports the standard library and the connector's ``rdma.stats``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from rdma_kv.connector.rdma.stats import (MEASURES, TOTAL_NUMBERS, ConsumerCounters, Counters, LeaseCounters,
                                         LoadRecord, PushCounters, PushRecord, Totals, WorkerStats)

__all__ = ["parse_counters", "parse_load_record", "parse_push_record", "parse_totals", "parse_worker_stats"]

C = TypeVar("C", bound=Counters)


def _int(where: str, value: Any) -> int:
    """``value`` if it is an int (not a bool); else a ``TypeError`` naming ``where``.
    The dict form crosses processes: a string or a fraction there is a bug upstream, never coerced."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    return value


def _float(where: str, value: Any) -> float:
    """``value`` as a float if it is a real number (an int or a float, not a bool); else a ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _str(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected a str, got {type(value).__name__} {value!r}")
    return value


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _list(where: str, value: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
    return value


_INT_MEASURES = frozenset({"num_blocks", "block_runs", "nbytes", "num_descs", "ops_posted", "nbytes_skipped"})
_RECORD_KEYS = frozenset(f.name for f in dataclasses.fields(LoadRecord))
_PUSH_KEYS = frozenset(f.name for f in dataclasses.fields(PushRecord))
_FLOATS = frozenset(f.name for f in dataclasses.fields(Totals) if isinstance(f.default, float))
_TOTAL_KEYS = frozenset(TOTAL_NUMBERS) | ConsumerCounters.names() | LeaseCounters.names() | PushCounters.names()


def parse_load_record(data: Mapping[str, Any]) -> LoadRecord:
    unknown = set(data) - _RECORD_KEYS
    if unknown:
        raise ValueError(f"unknown load record key(s) {sorted(unknown)}; valid: {sorted(_RECORD_KEYS)}")
    measured: dict[str, Any] = {
        name: (_int if name in _INT_MEASURES else _float)(f"load record {name}", data[name])
        for name in MEASURES if data.get(name) is not None}
    error = data.get("error")
    return LoadRecord(request_id=_str("load record request_id", data.get("request_id", "")),
                      ok=_bool("load record ok", data.get("ok", False)),
                      total_s=_float("load record total_s", data.get("total_s", 0.0)),
                      error=None if error is None else _str("load record error", error) or None, **measured)


def parse_push_record(data: Mapping[str, Any]) -> PushRecord:
    unknown = set(data) - _PUSH_KEYS
    if unknown:
        raise ValueError(f"unknown push record key(s) {sorted(unknown)}; valid: {sorted(_PUSH_KEYS)}")
    return PushRecord(request_id=_str("push record request_id", data.get("request_id", "")),
                      outcome=_str("push record outcome", data.get("outcome", "")),
                      nbytes=_int("push record nbytes", data.get("nbytes", 0)),
                      overlapped_nbytes=_int("push record overlapped_nbytes", data.get("overlapped_nbytes", 0)),
                      total_s=_float("push record total_s", data.get("total_s", 0.0)))


def parse_counters(kind: type[C], data: Mapping[str, Any]) -> C:
    """The counters of ``kind`` among ``data``'s flat names (absent ones are 0)."""
    return kind(*(_int(f"totals {kind.PREFIX + f.name}", data.get(kind.PREFIX + f.name, 0))
                  for f in dataclasses.fields(kind)))


def parse_totals(data: Mapping[str, Any]) -> Totals:
    """``Totals.to_dict``'s form: the numbers and every owner's counters by their flat names."""
    unknown = set(data) - _TOTAL_KEYS
    if unknown:
        raise ValueError(f"unknown totals key(s) {sorted(unknown)}; valid: {sorted(_TOTAL_KEYS)}")
    numbers: dict[str, Any] = {name: (_float if name in _FLOATS else _int)(f"totals {name}", data.get(name, 0))
                               for name in TOTAL_NUMBERS}
    return Totals(**numbers, consumer=parse_counters(ConsumerCounters, data),
                  leases=parse_counters(LeaseCounters, data), push=parse_counters(PushCounters, data))


def parse_worker_stats(data: Mapping[str, Any]) -> WorkerStats:
    """``WorkerStats.to_dict``'s form (``get_kv_connector_stats()``)."""
    resources = data.get("resources")
    by_rank = data.get("by_rank")
    incarnations = data.get("incarnations")
    return WorkerStats(tuple(parse_load_record(_mapping("load record", r))
                             for r in _list("requests", data.get("requests", ()))),
                       parse_totals(_mapping("totals", data.get("totals") or {})),
                       _int("leases_held", data.get("leases_held", 0)),
                       None if resources is None else {_str("resources key", k): _int(f"resources {k}", v)
                                                       for k, v in _mapping("resources", resources).items()},
                       tuple(parse_push_record(_mapping("push record", p))
                             for p in _list("pushes", data.get("pushes", ()))),
                       None if by_rank is None else {_rank(k): _gauges(f"by_rank {k}", v)
                                                     for k, v in _mapping("by_rank", by_rank).items()},
                       None if incarnations is None else {_rank(k): _str(f"incarnations {k}", v)
                                                          for k, v in _mapping("incarnations", incarnations).items()})


def _rank(key: Any) -> int:
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return _int("by_rank key", key)


def _gauges(where: str, value: Any) -> dict[str, int]:
    return {_str(f"{where} key", k): _int(f"{where} {k}", v) for k, v in _mapping(where, value).items()}
