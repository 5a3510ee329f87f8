"""The selftest's record of one check, its line, its JSON and the exit status.

A :class:`Check` is what every check produces: a name, a :class:`Status`
(PASS, FAIL or SKIP), a detail that says why, and figures (GB/s, bytes,
the transport UCX chose...). A SKIP with the figure ``exercised: False``
is something configured that this host could not check (a NIC reached
only over TCP): the summary line names it. The JSON report is
``{"checks": [{"name", "status", "detail", <figures>...}, ...]}``; the exit
status is 0 when no check FAILed, 1 otherwise.

May import: the standard library and rdma_kv.errors.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from rdma_kv.errors import ConfigError

__all__ = ["Check", "Status", "exit_status", "from_wire", "render", "summary", "to_json", "write_json"]

Figure = Union[int, float, str, bool, list[str], dict[str, Any]]

# Keys a figure may not take: they are the check's own fields in the JSON.
RESERVED = ("name", "status", "detail")


class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Check:
    """One line of the selftest: ``name`` (dotted, e.g. ``host.read``,
    ``cuda:0.register``), what happened and why, and its figures."""

    name: str
    status: Status
    detail: str
    figures: Mapping[str, Figure] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert not set(self.figures) & set(RESERVED), f"check {self.name!r}: a figure named like a field"

    @classmethod
    def passed(cls, name: str, detail: str, **figures: Figure) -> Check:
        return cls(name, Status.PASS, detail, figures)

    @classmethod
    def failed(cls, name: str, detail: str, **figures: Figure) -> Check:
        return cls(name, Status.FAIL, detail, figures)

    @classmethod
    def skipped(cls, name: str, detail: str, **figures: Figure) -> Check:
        return cls(name, Status.SKIP, detail, figures)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail, **self.figures}


def from_wire(data: Mapping[str, Any]) -> Check:
    """A check sent by a check process (``to_dict``'s form), parsed once here."""
    try:
        name, status, detail = str(data["name"]), Status(data["status"]), str(data["detail"])
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"malformed check record from a check process ({exc}): {dict(data)!r}") from None
    return Check(name, status, detail, {k: v for k, v in data.items() if k not in RESERVED})


def render(check: Check) -> str:
    """``PASS  host.read                 <detail>``: one line per check."""
    return f"{check.status.value}  {check.name:<24} {check.detail}"


def summary(checks: Iterable[Check]) -> str:
    """The counts; "(nothing failed)" when nothing did; and the checks of
    something configured that could not be exercised here (figure
    ``exercised: False``, e.g. a NIC reachable only over TCP), named."""
    counts = {s: 0 for s in Status}
    unexercised = []
    for check in checks:
        counts[check.status] += 1
        if check.figures.get("exercised") is False:
            unexercised.append(check.name)
    notes = ([] if counts[Status.FAIL] else ["nothing failed"]) + (
        [f"not exercised: {', '.join(unexercised)}, see {'its line' if len(unexercised) == 1 else 'their lines'}"]
        if unexercised else [])
    return (f"selftest: {counts[Status.PASS]} PASS, {counts[Status.FAIL]} FAIL, {counts[Status.SKIP]} SKIP"
            + (f" ({'; '.join(notes)})" if notes else ""))


def to_json(checks: Iterable[Check]) -> dict[str, Any]:
    return {"checks": [c.to_dict() for c in checks]}


def write_json(checks: Iterable[Check], path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(checks), indent=2) + "\n")


def exit_status(checks: Iterable[Check]) -> int:
    """0 when no check FAILed (PASS and SKIP only), 1 otherwise."""
    return 1 if any(c.status is Status.FAIL for c in checks) else 0
