"""The host-memory and NIC groups (check-process bodies), and the connector
settings every check process is sent.

- ``host``: ``host.read`` and ``host.read-notified``: two processes, the
  real ``Agent`` as shipped (progress thread, default lanes), prepared
  lists, a KV-shaped read and one that carries a notification the producer
  must receive; bit-exact, GB/s.
- ``nic``: per device, ``nic:<device>``: the same read between two
  processes with UCX restricted to that device (``NET_DEVICES``) and to its
  network transports (``rc``/``ud`` verbs where the device has them, else
  ``tcp``), so the bytes go through the NIC and back; the protocol UCX
  chose names the device.

May import: the standard library, rdma_kv.connector (settings),
rdma_kv.selftest.
"""

from __future__ import annotations

from typing import Any

from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.selftest.pair import ReadSpec, kv_workload, run_reads
from rdma_kv.selftest.supervise import Deadline, Sink, UcxLog

__all__ = ["host_group", "nic_group", "profile_of", "settings_from"]


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
                  workload, sink, Deadline(float(params["deadline_s"])), ucx_options=options,
                  lanes=settings.lanes, log=log)
