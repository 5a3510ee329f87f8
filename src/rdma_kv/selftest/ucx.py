"""The UCX checks, run in the selftest's own process, and the choice of the
NICs the ``nic`` group reads through.

- ``ucx.library``: which UCX the transport loaded (the libucx-cu12 wheel or
  a system UCX), its version and path;
- ``ucx.transports``: ``ucx_info -d``'s transports and devices by memory
  type, and the memory types a UCP context made with the rank's settings
  supports (what registration checks against). FAIL where InfiniBand
  devices exist but the loaded UCX has no verbs transport (the wheel's
  UCX has none: reads between nodes would go over TCP).

May import: the standard library, rdma_kv.errors, rdma_kv.transport
(ucxinfo, ucx, memory; lazily), rdma_kv.connector (settings),
rdma_kv.selftest.report.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.selftest.report import Check
from rdma_kv.transport.ucxinfo import (VERBS_TRANSPORTS, DeviceList, by_memory_type, network_devices, parse_ucx_info,
                                      run_ucx_info, ucx_info_binary)

__all__ = ["UcxFacts", "nic_targets", "ucx_checks"]

IB_CLASS = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class UcxFacts:
    """What the UCX checks found, for the groups after them."""

    checks: tuple[Check, ...]
    loaded: bool
    transports: list[dict[str, str]] | None  # None: ucx_info could not be run


def ucx_checks(settings: RdmaSettings) -> UcxFacts:
    from rdma_kv.transport.ucxinfo import loaded_ucx

    prefer = os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false")
    try:
        ucx = loaded_ucx()
    except Exception as exc:  # a diagnostic: report it
        return UcxFacts((Check.failed("ucx.library", f"UCX or the rdma-kv shim cannot be loaded: {exc}",
                                      prefer_system=prefer),), False, None)
    source = "the libucx-cu12 wheel" if ucx.source == "wheel" else "the system"
    library = Check.passed("ucx.library", f"UCX {ucx.version} from {source}: {ucx.library} "
                           f"(RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY={prefer})", version=ucx.version,
                           source=ucx.source, library=ucx.library)
    transports, check = _transports(ucx.library, settings)
    return UcxFacts((library, check), True, transports)


def _context_memory_types(settings: RdmaSettings) -> list[str]:
    from rdma_kv.transport.memory import kinds_in_mask
    from rdma_kv.transport.ucx import Context

    context = Context(settings.for_device("cpu").ucx_options, name="rdma-kv-selftest")
    try:
        return [k.value for k in kinds_in_mask(context.memory_types())]
    finally:
        context.close()


def _transports(library: str, settings: RdmaSettings) -> tuple[list[dict[str, str]] | None, Check]:
    """``ucx_info -d``'s transports (None when it cannot run) and the check."""
    name = "ucx.transports"
    from rdma_kv.transport.ucx import ucx_setting, ucx_setting_source

    options = settings.for_device("cpu").ucx_options
    try:
        context_types = _context_memory_types(settings)
    except Exception as exc:  # a diagnostic: report it
        asked = ", ".join(f"{key}={ucx_setting(options, key) or 'all (default)'}" for key in ("TLS", "NET_DEVICES"))
        return None, Check.failed(name, f"cannot create a UCP context with the rank's settings ({asked}): {exc}; "
                                  "an engine's agent fails the same way: name transports and devices this UCX "
                                  "has (`ucx_info -d` lists them)")
    tls = f"{ucx_setting_source(options, 'TLS')}={ucx_setting(options, 'TLS') or 'all'}"
    supports = f"a UCP context made with this environment ({tls}) supports: {', '.join(context_types)}"
    binary = ucx_info_binary(library)
    if binary is None:
        return None, Check.skipped(name, f"no ucx_info for the loaded UCX: transports not listed; {supports}",
                                   context_memory_types=context_types)
    try:
        transports, _ = parse_ucx_info(run_ucx_info(binary, library))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, Check.failed(name, f"{binary} -d failed: {exc}; {supports}",
                                  context_memory_types=context_types)
    groups = by_memory_type(transports)
    listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(groups.items())) or "none"
    if "cuda" not in groups:
        listed += "; cuda: none (no CUDA transport loaded: no GPU driver, or a UCX built without CUDA)"
    verbs = sorted({t["device"] for t in transports if t["transport"] in VERBS_TRANSPORTS})
    ib = sorted(p.name for p in IB_CLASS.iterdir()) if IB_CLASS.is_dir() else []
    figures: dict[str, Any] = {"by_memory_type": groups, "context_memory_types": context_types,
                               "verbs_devices": verbs, "ib_devices": ib}
    if ib and not verbs:
        return transports, Check.failed(name, f"InfiniBand devices {ib} exist but the loaded UCX has no verbs transport, so reads "
                            "between nodes would go over TCP: set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to load "
                            f"the system UCX (MOFED/HPC-X; docs/deploy.md section 1). {listed}; {supports}", **figures)
    return transports, Check.passed(name, f"{listed}; {supports}", **figures)


def nic_targets(facts: UcxFacts, settings: RdmaSettings) -> tuple[list[dict[str, str]], list[Check]]:
    """The devices to read through, each with the TLS that keeps the read on
    it, and the checks already decided (unknown devices FAIL; nothing to
    check SKIPs). The devices are those the rank's ``NET_DEVICES`` allows,
    read as UCX reads it (``DeviceList``: ``mlx5_0`` is each of its ports,
    ``^`` excludes, ranges expand): its ``ucx_net_devices`` (its KV cache
    on ``cuda:<rank>``), else ``NET_DEVICES`` from its ``ucx_options`` or
    ``UCX_NET_DEVICES``; a list that excludes, or none (``all``), leaves
    every device with a verbs transport that it does not exclude."""
    transports = facts.transports
    if transports is None:
        return [], [Check.skipped("nic", "no device list from ucx_info (see ucx.transports): NICs not checked")]
    named = settings.for_device(f"cuda:{settings.tp_rank}").ucx_options.get("NET_DEVICES")
    source = f"ucx_net_devices/NET_DEVICES of rank {settings.tp_rank}"
    if named is None and "UCX_NET_DEVICES" in os.environ:
        named, source = os.environ["UCX_NET_DEVICES"], "UCX_NET_DEVICES"
    network = network_devices(transports)
    try:
        allowed = DeviceList.parse("all" if named is None else named)
    except ValueError as exc:
        return [], [Check.failed("nic", f"{source}: {exc}; name the devices, or give all alone", source=source)]
    present = sorted({t["device"] for t in transports})
    unknown = allowed.unmatched(present)
    if allowed.every or allowed.negate:
        verbs = sorted({t["device"] for t in transports if t["transport"] in VERBS_TRANSPORTS})
        devices = [d for d in verbs if allowed.allows(d)]
        if not devices and not unknown:
            ib = sorted(p.name for p in IB_CLASS.iterdir()) if IB_CLASS.is_dir() else []
            if allowed.negate:
                why = f"no RDMA NIC that {source}={named} leaves: UCX reports no rc/ud/dc transport on such a device"
            else:
                why = "no RDMA NIC: UCX reports no rc/ud/dc transport on any device"
            unset = "" if allowed.negate else ", and no ucx_net_devices is configured (--config)"
            return [], [Check.skipped("nic", f"{why} ({IB_CLASS}: {', '.join(ib) or 'none'}){unset}; "
                                      f"network devices UCX reports: {', '.join(network)}")]
        if allowed.every:
            source = "every device with a verbs transport"
    else:
        devices = [d for d in present if allowed.allows(d)]
    targets, decided = [], []
    for token in unknown:
        decided.append(Check.failed(f"nic:{token}", f"{source} names {token!r}, but UCX reports no such device "
                                    f"(network devices: {', '.join(network) or 'none'}); fix the device name "
                                    "(`ucx_info -d` lists them, ports as mlx5_0:1)", source=source))
    for device in devices:
        names = sorted({t["transport"] for t in transports if t["device"] == device})
        tls = ",".join(kind for kind in ("rc", "ud", "dc") if any(n.startswith(kind) for n in names))
        if not tls and "tcp" in names:
            tls = "tcp"
        if not tls:
            decided.append(Check.failed(f"nic:{device}", f"{source} names {device!r}, which is no network device "
                                        f"(its transports: {', '.join(names)})", source=source))
        else:
            targets.append({"device": device, "tls": tls, "source": source})
    return targets, decided
