"""Loading UCX and the compiled shim; UCS status checking.

The libraries come from libucx's loader, which honours
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` (a system UCX with verbs on IB
clusters); the shim links ``libucp.so.0`` by soname and binds to whichever
copy the loader brought in. Nothing happens at import: ``load()`` runs on
first use.

May import: rdma_kv.errors.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from rdma_kv.errors import UCXError, UCXUnavailableError

_lock = threading.Lock()
_loaded: tuple[Any, Any] | None = None


def load() -> tuple[Any, Any]:
    """Return ``(ffi, lib)`` of the shim, loading UCX on first call."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                import libucx

                libucx.load_library()
            except ImportError as exc:
                raise UCXUnavailableError(
                    f"cannot load the UCX libraries ({exc}); install the "
                    "libucx-cu12 wheel or a system UCX and set "
                    "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true"
                ) from exc
            try:
                # The cffi-compiled extension (built by _build.py): no
                # stubs, so its ffi and lib are Any to the type checker.
                _ucp = importlib.import_module("rdma_kv.transport._ucp")
            except ImportError as exc:
                raise UCXUnavailableError(
                    f"the rdma-kv UCP shim is not built or does not load ({exc}); "
                    "reinstall rdma-kv with `pip install .` so that cffi compiles it"
                ) from exc
            _loaded = (_ucp.ffi, _ucp.lib)
    return _loaded


def status_name(status: int) -> str:
    ffi, lib = load()
    return str(ffi.string(lib.ucs_status_string(status)).decode())


def check_status(status: int, what: str) -> None:
    """Raise ``UCXError`` naming ``what`` unless ``status`` is UCS_OK."""
    if status != 0:
        name = status_name(status)
        raise UCXError(f"{what} failed: {name} (UCS status {status})", status, name)


def ucx_version() -> str:
    ffi, lib = load()
    return str(ffi.string(lib.ucp_get_version_string()).decode())


def library_path() -> str | None:
    """Path of the libucp actually loaded (wheel or system), if known."""
    load()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libucp.so" in line:
                    return line.split()[-1]
    except OSError:
        return None
    return None
