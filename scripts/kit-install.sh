#!/usr/bin/env bash
# On the target, without network: install the carry kit's wheels into a
# virtual environment and run `rdma-kv selftest`. Copied into the kit as
# install.sh by scripts/kit-build.sh (it installs from the folder it is in).
#
#   bash install.sh [--venv DIR] [--python PY] [--system-site-packages] [-- SELFTEST_ARGS...]
#
#   --venv DIR               where to make the venv (default ./rdma-kv-venv; reused if it exists)
#   --python PY              the Python to make it with (default python3); must be the version
#                            the kit was built for (MANIFEST.txt, "python:")
#   --system-site-packages   let the venv see the host's packages: its torch runs the CUDA checks
#   -- SELFTEST_ARGS         arguments of `rdma-kv selftest` (default: --json rdma-kv-selftest.json)
#
# pip installs with --no-index from this folder only; pip.conf and PIP_*
# settings that name an index or other folders are ignored.
# Exit status: the selftest's (0 nothing failed, 1 a check failed, 2 its
# arguments were wrong), 3 when the install itself failed.
set -euo pipefail

KIT=$(cd "$(dirname "$0")" && pwd)
VENV=$PWD/rdma-kv-venv
PY=python3
SITE=()
ARGS=(--json "$PWD/rdma-kv-selftest.json")
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
        --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
        --system-site-packages) SITE=(--system-site-packages); shift ;;
        --) shift; ARGS=("$@"); break ;;
        *) echo "install.sh: unknown option $1 (see the comment at the top of $0)" >&2; exit 3 ;;
    esac
done

fail() { echo "install.sh: $*" >&2; exit 3; }

[ -f "$KIT/MANIFEST.txt" ] || fail "no MANIFEST.txt beside $0: run the install.sh inside the kit folder"
want=$(sed -n 's/^python: //p' "$KIT/MANIFEST.txt")
have=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")') ||
    fail "cannot run $PY; name a Python with --python"
[ "$want" = "$have" ] || fail "this kit holds wheels for $want, but $PY is $have: name a $want interpreter with" \
    "--python, or rebuild the kit with one (PYTHON=... bash scripts/kit-build.sh)"
version=$(sed -n 's/^rdma-kv: //p' "$KIT/MANIFEST.txt")

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "${SITE[@]}" "$VENV" || fail "$PY -m venv $VENV failed (Debian: apt install python3-venv)"
fi
echo "install.sh: installing rdma-kv $version and its dependencies from $KIT/wheels into $VENV (no index)"
env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_CONSTRAINT \
    PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$VENV/bin/python" -m pip install --quiet --no-index --no-cache-dir --only-binary=:all: \
    --find-links "$KIT/wheels" "rdma-kv==$version" || fail "pip could not install the kit's wheels into $VENV"
"$VENV/bin/rdma-kv" --version
exec "$VENV/bin/rdma-kv" selftest "${ARGS[@]}"
