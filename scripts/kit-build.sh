#!/usr/bin/env bash
# The carry kit, built on a machine with network access: the wheels that
# `rdma-kv selftest` needs on a machine without one, in one folder under
# 64 MiB, with the one command that installs them there and runs the
# selftest (install.sh, a copy of scripts/kit-install.sh).
#
#   bash scripts/kit-build.sh [OUT_DIR]          # make kit: OUT_DIR = dist/rdma-kv-kit
#   bash scripts/kit-build.sh --check-size DIR   # only the size check (what the build ends with)
#
# Wheels: rdma-kv itself (its cffi shim compiled here), libucx-cu12, cffi and
# pycparser, msgspec, numpy: everything rdma-kv imports at run time. Never
# torch: the CUDA checks use the target's own torch (install.sh
# --system-site-packages). Versions: those installed for $PYTHON (its `pip
# freeze` as constraints: what the test suite ran against), pip's choice
# within pyproject's ranges for the rest. The wheels are for $PYTHON's
# version and platform: the target needs the same Python minor version
# (install.sh checks).
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3),
# RDMA_KV_KIT_LIMIT_MIB (default 64).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
LIMIT_MIB=${RDMA_KV_KIT_LIMIT_MIB:-64}

# Fail, clearly, when DIR holds more than LIMIT_MIB MiB; list what takes the room.
check_size() {
    local dir=$1 bytes limit
    bytes=$(du -sb "$dir" | cut -f1)
    limit=$((LIMIT_MIB * 1024 * 1024))
    if [ "$bytes" -gt "$limit" ]; then
        echo "kit-build: $dir is $(mib "$bytes") MiB, over the ${LIMIT_MIB} MiB limit; largest files:" >&2
        find "$dir" -type f -printf '%s %P\n' | sort -rn | head -8 |
            while read -r size name; do echo "  $(mib "$size") MiB  $name" >&2; done
        echo "kit-build: drop what the target does not need, or raise RDMA_KV_KIT_LIMIT_MIB if its carrier allows" >&2
        return 1
    fi
    echo "kit-build: $dir is $(mib "$bytes") MiB (limit ${LIMIT_MIB} MiB)"
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

if [ "${1:-}" = "--check-size" ]; then
    check_size "${2:?usage: kit-build.sh --check-size DIR}"
    exit
fi

OUT=${1:-$ROOT/dist/rdma-kv-kit}
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
TAG=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
PLATFORM=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_platform())')
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

rm -rf "$OUT"
mkdir -p "$OUT/wheels"
# Pins from what $PYTHON has installed (editable and direct-URL lines are not constraints).
"$PYTHON" -m pip freeze --exclude-editable | grep -v ' @ ' > "$TMP/constraints.txt" || true
# With the build requirements at hand, build against them (no download for the build).
isolation=()
if "$PYTHON" -c 'import setuptools, cffi, libucx' 2>/dev/null; then isolation=(--no-build-isolation); fi
echo "kit-build: wheels for $TAG $PLATFORM with $PYTHON into $OUT"
"$PYTHON" -m pip wheel --quiet --prefer-binary "${isolation[@]}" --constraint "$TMP/constraints.txt" \
    --wheel-dir "$OUT/wheels" "$ROOT"

for name in rdma_kv libucx_cu12 cffi pycparser msgspec numpy; do
    compgen -G "$OUT/wheels/${name}-*.whl" > /dev/null ||
        { echo "kit-build: no $name wheel in $OUT/wheels; the kit would not install" >&2; exit 1; }
done
if compgen -G "$OUT/wheels/torch-*.whl" > /dev/null; then
    echo "kit-build: a torch wheel got into the kit (rdma-kv does not depend on it); remove what pulled it" >&2
    exit 1
fi

cp "$ROOT/scripts/kit-install.sh" "$OUT/install.sh"
VERSION=$("$PYTHON" -c 'import tomllib, sys; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "$ROOT/pyproject.toml" 2>/dev/null || echo unknown)
{
    echo "python: $TAG"
    echo "platform: $PLATFORM"
    echo "rdma-kv: $VERSION"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "wheels (bytes, sha256):"
    for whl in "$OUT"/wheels/*.whl; do
        echo "  $(basename "$whl") $(stat -c %s "$whl") $(sha256sum "$whl" | cut -d' ' -f1)"
    done
    echo "install and run on the target: bash install.sh [--venv DIR] [--python PY] [--system-site-packages] [-- SELFTEST_ARGS]"
} > "$OUT/MANIFEST.txt"

ls -l "$OUT/wheels" | awk 'NR > 1 { printf "  %8.1f MiB  %s\n", $5 / 1048576, $9 }'
check_size "$OUT"
echo "kit-build: carry $OUT; on the target: bash $(basename "$OUT")/install.sh"
