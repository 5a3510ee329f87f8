"""cffi build script (API mode) for ``rdma_kv.transport._ucp``.

Compiles ``csrc/core.c``, ``csrc/post.c``, ``csrc/pump.c`` and the cffi wrappers of ``csrc/ucp.cdef`` against
the UCP headers of the libucx wheel -- or of a system UCX when
``RDMA_KV_UCX_PREFIX`` names its install prefix (e.g. ``/opt/hpcx/ucx``).
The extension links libucp by soname without an rpath: at run time
``rdma_kv.transport._lib`` first lets libucx's loader bring in the
libraries (the wheel's, or the system's with
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true``), and the dynamic linker then
resolves ``libucp.so.0`` to the copy already loaded.

Imported only by setuptools at build time.
"""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
CSRC = HERE / "csrc"


def ucx_prefix() -> tuple[str, str]:
    """Return (include_dir, lib_dir) of the UCX to compile against."""
    prefix = os.environ.get("RDMA_KV_UCX_PREFIX")
    if prefix:
        root = pathlib.Path(prefix)
        lib = root / "lib64" if (root / "lib64" / "libucp.so").exists() else root / "lib"
        return str(root / "include"), str(lib)
    import libucx  # build requirement (pyproject.toml)

    root = pathlib.Path(libucx.__file__).resolve().parent
    return str(root / "include"), str(root / "lib")


def make_ffi() -> FFI:
    include_dir, lib_dir = ucx_prefix()
    if not pathlib.Path(include_dir, "ucp", "api", "ucp.h").exists():
        raise RuntimeError(
            f"UCP headers not found under {include_dir}: install libucx-cu12 "
            "or set RDMA_KV_UCX_PREFIX to a UCX install prefix"
        )
    shim_h = (CSRC / "shim.h").read_text()
    ffi = FFI()
    ffi.cdef((CSRC / "ucp.cdef").read_text())
    ffi.cdef(shim_h)
    ffi.set_source(
        "rdma_kv.transport._ucp",
        '#include <stdio.h>\n#include <stdlib.h>\n#include <ucp/api/ucp.h>\n#include "shim.h"\n',
        # setuptools wants sources relative to the project root (cwd).
        sources=[os.path.relpath(CSRC / name) for name in ("core.c", "post.c", "pump.c")],
        include_dirs=[str(CSRC)],
        library_dirs=[lib_dir],
        libraries=["ucp", "uct", "ucs"],
        # -isystem: warnings are errors for our code, not for UCX's headers.
        extra_compile_args=["-isystem", include_dir, "-O2", "-pthread", "-Wall", "-Wextra",
                            "-Werror", "-Wno-unused-parameter"],
        extra_link_args=["-pthread"],
    )
    return ffi


ffibuilder = make_ffi()

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parents[2] / "build" / "cffi"), verbose=True)
