"""The storage connector's files on disk: each block is written under a
temporary name named by its writer, then renamed into place (readers see
the old file or the whole new one), and the temporary files a crash left
behind are removed at start-up when their writer is gone.

Imports the standard library only.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time

__all__ = ["STALE_TMP_S", "remove_stale_temporaries", "write_atomic"]

logger = logging.getLogger("rdma_kv.connector.storage")

# A temporary file from another host is removed once untouched this long (a
# writer writes one block and renames it at once; one stalled longer finds
# its file gone and counts a save error, nothing is damaged).
STALE_TMP_S = 3600.0


def _pid_namespace() -> str:
    """This process's pid namespace (pids are comparable only within one)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _owner() -> tuple[str, str]:
    """``(host, pid namespace)`` with the host name made safe for a file name."""
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())
    return host or "host", _pid_namespace()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def write_atomic(path: str, tmp_dir: str, key: str, payload: bytes, fsync: bool) -> None:
    """Write ``payload`` to ``path`` through a temporary file in ``tmp_dir``
    (one file system: the rename is atomic) named by its writer (``key``,
    host, pid namespace, pid), fsynced first when ``fsync``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.makedirs(tmp_dir, exist_ok=True)
    host, pid_ns = _owner()
    tmp = os.path.join(tmp_dir, f"{key}.{host}.{pid_ns}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old name or the whole file
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def remove_stale_temporaries(tmp_dir: str) -> None:
    """Remove the temporary files of saves a crash interrupted: on this
    host and pid namespace, those whose writer's pid is gone; from
    another host, those untouched for ``STALE_TMP_S`` (whose pid cannot
    be checked from here), in ``tmp_dir``. A live writer's file is never removed here
    (a reused pid keeps a dead writer's file, which is only space)."""
    try:
        names = os.listdir(tmp_dir)
    except FileNotFoundError:
        return
    host, pid_ns = _owner()
    now = time.time()
    removed = 0
    for name in names:
        parts = name.split(".")
        if len(parts) != 6 or parts[-1] != "tmp" or not parts[3].isdigit():
            continue  # not ours
        path = os.path.join(tmp_dir, name)
        if (parts[1], parts[2]) == (host, pid_ns):
            stale = not _pid_alive(int(parts[3]))
        else:
            try:
                stale = now - os.stat(path).st_mtime > STALE_TMP_S
            except FileNotFoundError:
                continue
        if stale:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass  # another engine's start-up removed it
    if removed:
        logger.info("StorageConnector: removed %d temporary file(s) of interrupted saves "
                    "from %s", removed, tmp_dir)

