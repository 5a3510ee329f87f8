"""A child forked from a ``multiprocessing`` fork server that behaves as a
spawned one: it takes the parent's environment, working directory and file
descriptors as they are when *it* starts, not as they were when the fork
server started. Used by :mod:`rdma_kv.harness.process` and by the vLLM
tests' engine processes (``tests/vllm/engine_proc.py``).

Imports the standard library only.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from multiprocessing import reduction
from typing import Any

__all__ = ["ParentFd", "adopt"]


class ParentFd:
    """One of the parent's file descriptors, as a ``Process`` argument: the
    child receives its own copy, an ``int``, handed over as ``multiprocessing``
    hands a ``Pipe`` to a child of the fork server (``reduction.DupFd``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return int(dup.detach())


def adopt(env: Mapping[str, str], cwd: str, fds: Mapping[int, int]) -> None:
    """In the child: the parent's environment and directory (UCX reads its
    configuration from the environment; ``tempfile`` looks at ``$TMPDIR``
    again), and each received descriptor moved onto its target
    (``{target: received}``, e.g. ``{1: out, 2: err}``; one received
    descriptor may serve several targets)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    tempfile.tempdir = None
    for target, fd in fds.items():
        os.dup2(fd, target)
    for fd in set(fds.values()) - set(fds):
        os.close(fd)
