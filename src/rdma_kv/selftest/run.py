"""``run_selftest``: every check, in order, each group under a deadline.

Order: ``ucx.library``, ``ucx.transports`` (this process), then the groups
that move data, each in a check process of its own (``supervise.py``):
``host`` (``groups.py``), ``cuda`` (``cuda.py``; skipped without a GPU
driver, saying so, before torch is imported), ``nic`` (``groups.py``;
devices from ``ucx.nic_targets``).

May import: the standard library, rdma_kv.connector (settings),
rdma_kv.selftest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.selftest.groups import profile_of
from rdma_kv.selftest.report import Check
from rdma_kv.selftest.supervise import run_group
from rdma_kv.selftest.ucx import nic_targets, ucx_checks

__all__ = ["SelftestOptions", "gpu_driver", "run_selftest"]

# A GPU driver is loaded when either exists (nvidia.ko, its control device).
GPU_DRIVER_PATHS = (Path("/proc/driver/nvidia"), Path("/dev/nvidiactl"))
GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class SelftestOptions:
    """``quick``: small reads, one repetition (seconds). ``settings``: the
    rank's connector settings (``rdma-kv selftest --config``); None: the
    defaults. ``deadline_s``: every wait of a group ends by then (the CUDA
    group: per GPU, the NIC group: per device); default 60 s quick, 300 s
    otherwise."""

    quick: bool = False
    settings: RdmaSettings | None = None
    deadline_s: float | None = None
    seed: int = 0

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else 60.0 if self.quick else 300.0


def default_settings() -> RdmaSettings:
    return RdmaSettings(side_channel_host="127.0.0.1", advertise_host="127.0.0.1", side_channel_port=0)


def gpu_driver() -> Path | None:
    """The first trace of a GPU driver on this host, or None. Checked
    without importing torch (a cold ``import torch`` reads ~1 GB)."""
    return next((p for p in GPU_DRIVER_PATHS if p.exists()), None)


def run_selftest(options: SelftestOptions | None = None,
                 on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Run every check; ``on_check`` sees each as it completes. Never
    raises for what it finds: a failure is a FAIL check (see ``report``)."""
    options = options or SelftestOptions()
    settings = options.settings or default_settings()
    checks: list[Check] = []

    def add(check: Check) -> None:
        checks.append(check)
        if on_check is not None:
            on_check(check)

    facts = ucx_checks(settings)
    for check in facts.checks:
        add(check)
    if not facts.loaded:
        for name in ("host", "cuda", "nic"):
            add(Check.skipped(name, "needs UCX, which did not load (ucx.library)"))
        return checks
    params = {"quick": options.quick, "seed": options.seed, "deadline_s": options.deadline,
              "connector": profile_of(settings)}

    def group(name: str, entry: str, scale: int = 1, **extra: object) -> None:
        run_group(f"rdma_kv.selftest.{entry}", {**params, **extra}, group=name,
                  deadline_s=options.deadline * scale, on_check=add)

    group("host", "groups:host_group")
    driver = gpu_driver()
    if driver is None:
        add(Check.skipped("cuda", f"no GPU driver on this host ({', '.join(map(str, GPU_DRIVER_PATHS))} absent): "
                          "CUDA registration, GPU reads and the pumps' CUDA context not checked"))
        add(Check.skipped("layout", "needs a CUDA device: the KV layouts are checked on real CUDA tensors"))
    else:
        gpus = len(list(GPUS.iterdir())) if GPUS.is_dir() else 1
        cuda_ipc = any(t["transport"] == "cuda_ipc" for t in facts.transports or [])
        group("cuda", "cuda:cuda_group", scale=max(1, gpus) + 1, cuda_ipc=cuda_ipc)
    targets, decided = nic_targets(facts, settings)
    for check in decided:
        add(check)
    if targets:
        group("nic", "groups:nic_group", scale=len(targets), devices=targets)
    return checks
