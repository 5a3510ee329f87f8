"""The host-memory and NIC groups (check-process bodies), and the connector
settings every check process is sent.

- ``host``: ``host.read`` and ``host.read-notified``: two processes, the
  real ``Agent`` as shipped (progress thread, default lanes), prepared
  lists, a KV-shaped read and one that carries a notification the producer
  must receive; bit-exact, GB/s.
- ``nic``: per device, ``nic:<device>``: the same read between two
  processes with UCX restricted to that device (``NET_DEVICES``) and to its
  network transports (``rc``/``ud`` verbs where the device has them, else
  ``tcp``); the protocol UCX chose names the device. What that loopback
  proves depends on the transport (``nic_verdict``): over verbs the HCA
  carries the read and loops it back itself (the HCA, its driver, UCX's
  verbs transport; not the link, cable or switch: PASS, saying so); over
  ``tcp`` the reader connects to the device's own address, which the
  kernel routes over the loopback device, so not one byte crosses the NIC
  (a NIC with its link down reads the same): SKIP, "not exercised", with
  the interfaces' transmit counters during the read as evidence. A read
  that fails is a FAIL either way; ``tcp`` on the loopback device itself
  (``lo``) is what it says and PASSes.

May import: the standard library, rdma_kv.connector (settings),
rdma_kv.selftest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.selftest.pair import ReadSpec, kv_workload, run_reads
from rdma_kv.selftest.report import Check, Status
from rdma_kv.selftest.supervise import Deadline, Sink, UcxLog

__all__ = ["host_group", "loopback_interfaces", "nic_group", "nic_verdict", "profile_of", "settings_from",
           "tx_bytes"]

NET_CLASS = Path("/sys/class/net")
IFF_LOOPBACK = 0x8


def profile_of(settings: RdmaSettings) -> dict[str, Any]:
    """What a check process needs of the rank's connector settings, as JSON."""
    devices = settings.ucx_net_devices
    return {"tp_rank": settings.tp_rank, "tp_size": settings.tp_size, "ucx_options": dict(settings.ucx_options),
            "ucx_net_devices": dict(devices) if devices is not None and not isinstance(devices, str) else devices,
            "lanes": settings.lanes}


def settings_from(profile: dict[str, Any]) -> RdmaSettings:
    """The connector settings a check process was sent (``profile_of``)."""
    devices = profile.get("ucx_net_devices")
    if isinstance(devices, dict):  # JSON keys are strings
        devices = {int(k): v for k, v in devices.items()}
    return RdmaSettings(side_channel_host="127.0.0.1", advertise_host="127.0.0.1", side_channel_port=0,
                        tp_rank=int(profile["tp_rank"]), tp_size=int(profile["tp_size"]),
                        ucx_options=dict(profile["ucx_options"]), ucx_net_devices=devices,
                        lanes=int(profile["lanes"]))


def host_group(params: dict[str, Any], sink: Sink) -> None:
    settings = settings_from(params["connector"]).for_device("cpu")
    run_reads([ReadSpec("host.read", "host", "host"), ReadSpec("host.read-notified", "host", "host", notify=True)],
              kv_workload(bool(params["quick"]), int(params["seed"])), sink, Deadline(float(params["deadline_s"])),
              ucx_options=dict(settings.ucx_options), lanes=settings.lanes, log=UcxLog(params["ucx_log"]))


def nic_group(params: dict[str, Any], sink: Sink) -> None:
    """``params["devices"]``: ``[{"device": "mlx5_0:1", "tls": "rc,ud"}, ...]``."""
    settings = settings_from(params["connector"])
    workload = kv_workload(bool(params["quick"]), int(params["seed"]))
    log = UcxLog(params["ucx_log"])
    for target in params["devices"]:
        device, tls = str(target["device"]), str(target["tls"])
        options = {**settings.ucx_options, "NET_DEVICES": device, "TLS": tls}
        run_reads([ReadSpec(f"nic:{device}", "host", "host", label=f"loopback through {device} (TLS={tls})")],
                  workload, _Judged(sink, device, tls), Deadline(float(params["deadline_s"])), ucx_options=options,
                  lanes=settings.lanes, log=log)


def loopback_interfaces() -> list[str]:
    """This host's loopback network interfaces (``IFF_LOOPBACK``): ``lo``."""
    found = []
    for path in sorted(NET_CLASS.glob("*")):
        try:
            if int((path / "flags").read_text(), 16) & IFF_LOOPBACK:
                found.append(path.name)
        except (OSError, ValueError):
            continue
    return found


def tx_bytes(interfaces: list[str]) -> dict[str, int]:
    """Each interface's transmit counter (bytes); an unreadable one is left out."""
    counters = {}
    for name in interfaces:
        try:
            counters[name] = int((NET_CLASS / name / "statistics" / "tx_bytes").read_text())
        except (OSError, ValueError):
            continue
    return counters


class _Judged:
    """The NIC group's sink: each read's check goes out as ``nic_verdict``
    judges it, with the interfaces' transmit counters over the read."""

    def __init__(self, sink: Sink, device: str, tls: str) -> None:
        self._sink, self._device, self._tls = sink, device, tls
        self._loopback = loopback_interfaces()
        self._watched = sorted({device, *self._loopback}) if tls == "tcp" else []
        self._before: dict[str, int] = {}

    def begin(self, name: str) -> None:
        self._before = tx_bytes(self._watched)
        self._sink.begin(name)

    def add(self, check: Check) -> None:
        after = tx_bytes(self._watched)
        sent = {k: after[k] - v for k, v in self._before.items() if k in after}
        self._sink.add(nic_verdict(check, self._device, self._tls, self._loopback, sent))


def nic_verdict(check: Check, device: str, tls: str, loopback: list[str], sent: dict[str, int]) -> Check:
    """What a bit-exact loopback read through ``device`` proves (``check``
    is the read's own verdict; a FAIL stays one). ``loopback``: this host's
    loopback interfaces; ``sent``: bytes each interface transmitted during
    the read (figures only: the verdict follows from the transport)."""
    if check.status is not Status.PASS:
        return check
    if tls != "tcp":
        return Check(check.name, Status.PASS, f"{check.detail}; the HCA looped the read back itself: this proves "
                     f"{device}, its driver and UCX's verbs transport, not its link, cable or switch (check those "
                     "between two hosts: ib_read_bw, ucx_perftest; docs/deploy.md section 5)", check.figures)
    if device in loopback:
        return check  # the loopback device was asked for, and carried the read
    counters = ", ".join(f"{name} sent {n:,}" for name, n in sorted(sent.items()))
    during = f" (during the read {counters} bytes)" if counters else ""
    return Check(check.name, Status.SKIP,
                 f"NIC not exercised: over tcp the reader connects to {device}'s own address, which the kernel "
                 f"routes over the loopback device{during}: a dead link would read the same. It shows UCX opens "
                 f"tcp on {device}: {check.detail}. Check {device} between two hosts: ucx_perftest -t ucp_get with "
                 f"UCX_TLS=tcp UCX_NET_DEVICES={device} (docs/deploy.md section 5)",
                 {**check.figures, "exercised": False, "tx_bytes_during_read": sent})
