"""Which transport UCX chose for a read, from its ``PROTO_INFO`` tables.

With ``UCX_PROTO_INFO=y`` (here: ``PROTO_INFO`` in the agent's own UCX
options) UCX prints, at the first use of each protocol, a table such as::

    | a intra-node cfg#0                                               |
    | remote memory read by ucp_get*(multi) into host memory from host |
    | Range  | Description |                  Config                   |
    | 0..inf | zero-copy   | cma/memory                                |

``read_protocols`` finds the ``remote memory read`` tables in a check
process's captured stdout and returns, per (local, remote) memory type,
what each range of sizes goes through (``zero-copy cma/memory``,
``zero-copy cuda_ipc/cuda``, ``zero-copy rc_mlx5/mlx5_0:1``). Best
effort: a UCX that prints another format gives nothing, never an error.

May import: the standard library only.
"""

from __future__ import annotations

import re

__all__ = ["PROTO_INFO", "read_protocols"]

PROTO_INFO = {"PROTO_INFO": "y"}

_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")  # "[1795647200.934] [vm:6126 :0]"
# "into host memory from host", "into cuda/GPU0 from cuda/dev[0]" (UCX names
# device memory by type/device): the memory type is what precedes " memory" or "/".
_READ = re.compile(r"remote memory read by ucp_get\S*\s+into\s+([\w-]+)(?:\s+memory|/\S+)\s+from\s+([\w-]+)")
_RANGE = re.compile(r"^\d+(\.\.(\d+|inf))?$")


def read_protocols(text: str) -> dict[tuple[str, str], list[str]]:
    """``{(into, from): ["<range> <description> <config>", ...]}`` of every
    read table in ``text`` (UCX's captured stdout), duplicates dropped."""
    out: dict[tuple[str, str], list[str]] = {}
    key: tuple[str, str] | None = None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if m := _READ.search(line):
            key = (m.group(1), m.group(2))
            out.setdefault(key, [])
            continue
        if key is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and _RANGE.match(cells[0]):
            row = f"{cells[0]} {cells[1]} {cells[2]}" if cells[0] != "0..inf" else f"{cells[1]} {cells[2]}"
            if row not in out[key]:
                out[key].append(row)
        elif len(cells) == 1 and cells[0] and not cells[0].startswith("+"):
            key = None  # the next table's title
    return out
