"""``rdma-kv info``: what rdma-kv will use on this host, and a check of a
kv-transfer config, before an engine is started.

Reports the UCX version and the library actually loaded (the libucx wheel or
a system UCX), the transports, devices and memory types UCX sees (parsed
from ``ucx_info -d`` of the UCX in use), whether InfiniBand verbs are
usable, and findings for ``--config`` (JSON text or a file). ``--json``
prints one JSON object for scripts.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Transports that mean RDMA hardware is usable through UCX.
VERBS_TRANSPORTS = ("rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5", "rc", "ud", "dc")


@dataclass
class Finding:
    level: str  # "ok" | "warning" | "error"
    message: str


@dataclass
class Report:
    ucx_version: str = ""
    ucx_library: str = ""
    ucx_source: str = ""  # "wheel" | "system" | "unavailable"
    prefer_system: str = ""
    shim: str = ""
    transports: list[dict[str, str]] = field(default_factory=list)
    memory_types: list[str] = field(default_factory=list)
    ib_devices: list[str] = field(default_factory=list)
    verbs: bool = False
    cuda: str = ""
    findings: list[Finding] = field(default_factory=list)
    # CUDA memory support: what a UCP context made with this environment's
    # UCX_* settings supports (see cuda_memory_support below).
    context_memory_types: list[str] = field(default_factory=list)
    cuda_memory: str = ""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("info", help="show the UCX, transports and devices rdma-kv will use; check a config",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="JSON_OR_FILE", help="a kv-transfer-config to check (JSON text or path)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def ucx_info_binary(library: str) -> str | None:
    """The ucx_info of the UCX that is loaded (wheel's bin/, else PATH)."""
    lib_dir = Path(library).parent if library else None
    if lib_dir is not None:
        for candidate in (lib_dir.parent / "bin" / "ucx_info", lib_dir.parent.parent / "bin" / "ucx_info"):
            if candidate.exists():
                return str(candidate)
    return shutil.which("ucx_info")


def parse_ucx_info(text: str) -> tuple[list[dict[str, str]], set[str]]:
    """Transports/devices and host/device memory types from ``ucx_info -d``."""
    transports: list[dict[str, str]] = []
    mem_types: set[str] = set()
    md = ""
    current: dict[str, str] | None = None
    for line in text.splitlines():
        line = line.strip("# \t")
        if m := re.match(r"Memory domain:\s*(\S+)", line):
            md, current = m.group(1), None
        elif m := re.match(r"memory types:\s*(.*)", line):
            mem_types.update(t.split(" ")[0] for t in re.split(r",\s*(?![^()]*\))", m.group(1)) if t.strip())
        elif m := re.match(r"Transport:\s*(\S+)", line):
            current = {"md": md, "transport": m.group(1), "device": "", "type": ""}
            transports.append(current)
        elif current is not None and (m := re.match(r"Device:\s*(\S+)", line)):
            current["device"] = m.group(1)
        elif current is not None and (m := re.match(r"Type:\s*(\S+)", line)):
            current["type"] = m.group(1)
    return transports, {t for t in mem_types if t}


def probe() -> Report:
    report = Report(prefer_system=os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false"))
    try:
        from rdma_kv.transport._lib import library_path, load, ucx_version

        load()
        report.shim = "loaded"
        report.ucx_version = ucx_version()
        report.ucx_library = library_path() or ""
        report.ucx_source = "wheel" if "/libucx/" in report.ucx_library else "system"
    except Exception as exc:  # report, do not crash: this is a diagnostic tool
        report.ucx_source = "unavailable"
        report.shim = f"not loadable: {exc}"
        report.findings.append(Finding("error", f"UCX or the rdma-kv shim cannot be loaded: {exc}"))
        return report
    binary = ucx_info_binary(report.ucx_library)
    if binary:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(Path(report.ucx_library).parent),
                                                               env.get("LD_LIBRARY_PATH", "")]))
        try:
            out = subprocess.run([binary, "-d"], capture_output=True, text=True, timeout=60, env=env).stdout
            transports, mem_types = parse_ucx_info(out)
            report.transports, report.memory_types = transports, sorted(mem_types)
        except (OSError, subprocess.TimeoutExpired) as exc:
            report.findings.append(Finding("warning", f"{binary} -d failed ({exc}); transports not listed"))
    else:
        report.findings.append(Finding("warning", "no ucx_info found for the loaded UCX; transports not listed"))
    ib = Path("/sys/class/infiniband")
    report.ib_devices = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    names = {t["transport"] for t in report.transports}
    report.verbs = any(t in names for t in VERBS_TRANSPORTS)
    if report.ib_devices and not report.verbs:
        report.findings.append(Finding(
            "warning", f"InfiniBand devices {report.ib_devices} exist but the loaded UCX has no verbs "
            "transport; set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to use the system UCX (MOFED/HPC-X)"))
    report.cuda = _cuda_state(names)
    cuda_memory_support(report)
    return report


def _cuda_state(transports: set[str]) -> str:
    ucx_cuda = "cuda_copy" in transports
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = None
    if gpu:
        return "available" + ("" if ucx_cuda else " to torch, but UCX has no cuda transport")
    return "no CUDA device" + (" (torch not installed)" if gpu is None else "")


# --- CUDA memory support ------------------------------------------------------


def cuda_memory_support(report: Report) -> None:
    """Whether the loaded UCX, with the transports this environment enables
    (``UCX_TLS``...), can register CUDA memory as CUDA memory: the memory
    types of a UCP context made as the agent makes its own
    (``ucp_context_attr_t.memory_types``: host, plus the types of the memory
    domains whose transports stayed enabled). Without ``cuda`` there, the
    agent refuses a CUDA KV cache (UCX would map it as host memory)."""
    try:
        from rdma_kv.transport.memory import MemoryKind, kinds_in_mask
        from rdma_kv.transport.ucx import Context

        context = Context(name="rdma-kv-info")
        try:
            kinds = kinds_in_mask(context.memory_types())
        finally:
            context.close()
    except Exception as exc:  # a diagnostic: report it, do not crash
        report.cuda_memory = f"unknown (no UCP context: {exc})"
        report.findings.append(Finding("warning", f"cannot create a UCP context to query memory types: {exc}"))
        return
    report.context_memory_types = [k.value for k in kinds]
    tls = os.environ.get("UCX_TLS", "all (default)")
    if MemoryKind.CUDA in kinds:
        report.cuda_memory = f"supported (context memory types: {', '.join(report.context_memory_types)})"
        return
    cuda_built = any(t["transport"].startswith("cuda") for t in report.transports)
    why = ("UCX has CUDA transports but UCX_TLS leaves them out; add cuda_copy" if cuda_built
           else "this UCX has no usable CUDA transport (no GPU driver here, or UCX built without CUDA)")
    report.cuda_memory = f"not supported: {why} (UCX_TLS={tls})"
    if report.cuda.startswith("available"):
        report.findings.append(Finding("error", f"a GPU is present but UCX cannot register CUDA memory as CUDA: "
                                       f"{why}; a CUDA KV cache would be refused at register_kv_caches"))


def check_config(text: str, report: Report) -> None:
    from rdma_kv.connector.config import KVTransferConfig

    path = Path(text)
    try:
        raw = path.read_text() if not text.lstrip().startswith("{") and path.exists() else text
    except OSError as exc:
        report.findings.append(Finding("error", f"cannot read config {text!r}: {exc}"))
        return
    try:
        config = KVTransferConfig.from_json(raw)
    except ValueError as exc:
        report.findings.append(Finding("error", f"config rejected: {exc}"))
        return
    report.findings.append(Finding("ok", f"config parses: role {config.kv_role.value}, connector {config.kv_connector}"))
    if config.kv_ip in ("0.0.0.0", "::"):
        report.findings.append(Finding("warning", f"kv_ip {config.kv_ip} binds every interface; the side channel "
                                       "hands out remote keys to whoever reaches it: bind the interface facing "
                                       "the peer engines"))
    else:
        try:
            with socket.socket(socket.AF_INET6 if ":" in config.kv_ip else socket.AF_INET) as s:
                s.bind((config.kv_ip, config.kv_port))
            report.findings.append(Finding("ok", f"{config.kv_ip}:{config.kv_port} is free to bind"))
        except OSError as exc:
            level = "error"
            why = {errno.EADDRINUSE: "the port is in use", errno.EADDRNOTAVAIL: "the address is not on this host"}
            report.findings.append(Finding(level, f"cannot bind {config.kv_ip}:{config.kv_port}: "
                                           f"{why.get(exc.errno, exc.strerror)}"))
    if config.kv_buffer_device.value == "cuda" and not report.cuda.startswith("available"):
        report.findings.append(Finding("warning", f"kv_buffer_device is cuda but {report.cuda}; rdma-kv "
                                       "registers the KV cache where the engine allocates it (host memory here)"))


def render(report: Report) -> str:
    lines = [
        f"UCX           {report.ucx_version or '-'} ({report.ucx_source}) {report.ucx_library}",
        f"prefer system RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY={report.prefer_system}",
        f"shim          {report.shim}",
        f"memory types  {', '.join(report.memory_types) or '-'}",
        f"IB verbs      {'yes' if report.verbs else 'no'}; IB devices: {', '.join(report.ib_devices) or 'none'}",
        f"CUDA          {report.cuda}",
        f"CUDA memory   {report.cuda_memory or '-'}",
        "transports:",
    ]
    lines += [f"  {t['transport']:<12} {t['device']:<12} {t['type']}" for t in report.transports] or ["  -"]
    if report.findings:
        lines.append("findings:")
        lines += [f"  [{f.level}] {f.message}" for f in report.findings]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = probe()
    if args.config:
        check_config(args.config, report)
    print(json.dumps(asdict(report), indent=2) if args.json else render(report))
    return 1 if any(f.level == "error" for f in report.findings) else 0
