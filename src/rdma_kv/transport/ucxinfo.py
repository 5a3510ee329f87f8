"""What the loaded UCX says about itself: which library was loaded (the
libucx wheel's or a system UCX), and what its ``ucx_info -d`` lists: memory
domains, their memory types, and the transports and devices under them.

Diagnostics only (``rdma-kv info``, ``rdma-kv selftest``), never on a
transfer path. UCX is loaded through ``_lib`` when a function here is
called, never at import.

May import: rdma_kv.transport._lib (lazily).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeviceList", "LoadedUCX", "by_memory_type", "loaded_ucx", "network_devices", "parse_ucx_info",
           "run_ucx_info", "ucx_info_binary"]

# Transports that mean RDMA hardware is usable through UCX.
VERBS_TRANSPORTS = ("rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5", "rc", "ud", "dc")

UCX_INFO_TIMEOUT_S = 60.0

# One numeric range in a device name (UCX 1.22's ucs_config_array_expand_range).
_RANGE = re.compile(r"^([^][]*)\[([0-9]+)-([0-9]+)\]([^][]*)$")


@dataclass(frozen=True)
class DeviceList:
    """A ``NET_DEVICES`` value as UCX 1.22 reads it
    (``ucs_config_sscanf_allow_list_with_ranges``, then
    ``ucp_is_resource_in_device_list``): a leading ``^`` excludes the names
    that follow; names are split on commas, empty ones dropped, no spaces
    stripped; a name with one numeric range (``mlx5_[0-3]:1``) stands for
    each name it spans; ``all`` as the first name means every device (with
    or without ``^``) and must stand alone (UCX refuses ``all,lo``; a later
    ``all`` is only a name). A device matches a name by its full name or,
    for a port, its base name (``mlx5_0`` matches ``mlx5_0:1``)."""

    every: bool
    negate: bool
    tokens: tuple[str, ...]  # as written, ranges unexpanded

    @classmethod
    def parse(cls, value: str) -> "DeviceList":
        """ValueError for what UCX refuses (``all`` first among others)."""
        negate = value.startswith("^")
        tokens = tuple(t for t in value[negate:].split(",") if t)
        if tokens and tokens[0] == "all":
            if len(tokens) > 1:
                raise ValueError(f"{value!r}: 'all' must stand alone (UCX refuses the value: Invalid parameter)")
            return cls(True, False, ())
        return cls(False, negate, tokens)

    @staticmethod
    def expand(token: str) -> list[str]:
        """The names one token stands for (itself, or its range's names, at
        most 128: UCX keeps no more names than that in a list)."""
        m = _RANGE.match(token)
        if m is None:
            return [token]
        first, last = int(m.group(2)), int(m.group(3))
        if first > last:
            return [token]
        return [f"{m.group(1)}{i}{m.group(4)}" for i in range(first, min(last, first + 127) + 1)]

    @staticmethod
    def matches(name: str, device: str) -> bool:
        return device == name or (":" in device and device.partition(":")[0] == name)

    def allows(self, device: str) -> bool:
        """Whether UCX may use network device ``device`` under this list."""
        if self.every:
            return True
        named = any(self.matches(n, device) for t in self.tokens for n in self.expand(t))
        return not named if self.negate else named

    def unmatched(self, devices: list[str] | set[str]) -> list[str]:
        """The tokens that name none of ``devices`` (a range: none of its
        names), as written: a misspelt or absent device."""
        return [t for t in self.tokens if not any(self.matches(n, d) for n in self.expand(t) for d in devices)]


@dataclass(frozen=True)
class LoadedUCX:
    """The UCX the transport loaded: version, library path and its source."""

    version: str
    library: str
    source: str  # "wheel" (libucx-cu12) | "system"


def loaded_ucx() -> LoadedUCX:
    """Load UCX (and the shim) as the transport does; UCXUnavailableError if it cannot."""
    from rdma_kv.transport._lib import library_path, load, ucx_version

    load()
    library = library_path() or ""
    # The wheel's libraries live in site-packages/libucx/lib; anything else
    # came from the system search path (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY).
    return LoadedUCX(ucx_version(), library, "wheel" if "/libucx/" in library else "system")


def ucx_info_binary(library: str) -> str | None:
    """The ucx_info of the UCX that is loaded (wheel's bin/, else PATH)."""
    lib_dir = Path(library).parent if library else None
    if lib_dir is not None:
        for candidate in (lib_dir.parent / "bin" / "ucx_info", lib_dir.parent.parent / "bin" / "ucx_info"):
            if candidate.exists():
                return str(candidate)
    return shutil.which("ucx_info")


def run_ucx_info(binary: str, library: str, timeout_s: float = UCX_INFO_TIMEOUT_S) -> str:
    """``ucx_info -d`` of the loaded UCX (its library directory first on the
    search path, as the wheel's binaries need). OSError or
    subprocess.TimeoutExpired when it cannot run."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(Path(library).parent) if library else "",
                                                           env.get("LD_LIBRARY_PATH", "")]))
    return subprocess.run([binary, "-d"], capture_output=True, text=True, timeout=timeout_s, env=env).stdout


def parse_ucx_info(text: str) -> tuple[list[dict[str, str]], set[str]]:
    """Transports from ``ucx_info -d``, each with its memory domain (``md``),
    ``device``, ``type`` and the ``memory_types`` its memory domain lists
    (comma-separated, flags dropped); and the union of those memory types."""
    transports: list[dict[str, str]] = []
    mem_types: set[str] = set()
    md, md_types = "", ""
    current: dict[str, str] | None = None
    for line in text.splitlines():
        line = line.strip("# \t")
        if m := re.match(r"Memory domain:\s*(\S+)", line):
            md, md_types, current = m.group(1), "", None
        elif m := re.match(r"memory types:\s*(.*)", line):
            # "host (access,reg,cache), cuda (reg)": commas inside the flags do not split.
            names = [t.strip().split(" ")[0] for t in re.split(r",\s*(?![^()]*\))", m.group(1)) if t.strip()]
            md_types = ",".join(names)
            mem_types.update(names)
        elif m := re.match(r"Transport:\s*(\S+)", line):
            current = {"md": md, "transport": m.group(1), "device": "", "type": "", "memory_types": md_types}
            transports.append(current)
        elif current is not None and (m := re.match(r"Device:\s*(\S+)", line)):
            current["device"] = m.group(1)
        elif current is not None and (m := re.match(r"Type:\s*(\S+)", line)):
            current["type"] = m.group(1)
    return transports, {t for t in mem_types if t}


def network_devices(transports: list[dict[str, str]]) -> list[str]:
    """The devices of ``parse_ucx_info``'s transports that reach another
    host (type ``network``, or ``tcp``'s interfaces), sorted."""
    return sorted({t["device"] for t in transports if t["type"] == "network" or t["transport"] == "tcp"})


def by_memory_type(transports: list[dict[str, str]]) -> dict[str, list[str]]:
    """``transport/device`` names per memory type. A memory domain that lists
    no memory type (tcp, cma) registers nothing: its transport moves host
    memory through the CPU, so it counts for ``host``."""
    out: dict[str, list[str]] = {}
    for t in transports:
        for kind in (t.get("memory_types") or "host").split(","):
            name = f"{t['transport']}/{t['device']}"
            if name not in out.setdefault(kind, []):
                out[kind].append(name)
    return out
