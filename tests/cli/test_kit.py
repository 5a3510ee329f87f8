"""The carry kit's two scripts, the parts that need no network: the size
check the build ends with, and the install's refusals (another Python's
kit, an unknown option) before it touches anything. The whole kit, built
and installed offline from a fresh clone, is run by hand: docs/deploy.md
has the commands and what they printed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD, INSTALL = ROOT / "scripts" / "kit-build.sh", ROOT / "scripts" / "kit-install.sh"

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("bash") is None, reason="the kit's scripts are bash")]


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env})


def test_a_kit_under_the_limit_passes_the_size_check(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "small.whl").write_bytes(b"x" * 1000)
    proc = run(BUILD, "--check-size", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"kit-build: {tmp_path} is 0.0 MiB (limit 64 MiB)" in proc.stdout


def test_a_kit_over_the_limit_fails_naming_its_size_and_largest_files(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "big.whl").write_bytes(b"x" * (3 << 20))
    (tmp_path / "install.sh").write_text("true\n")
    proc = run(BUILD, "--check-size", tmp_path, RDMA_KV_KIT_LIMIT_MIB="2")
    assert proc.returncode == 1
    assert f"kit-build: {tmp_path} is 3.0 MiB, over the 2 MiB limit; largest files:" in proc.stderr
    assert "  3.0 MiB  wheels/big.whl" in proc.stderr


def kit(tmp_path: Path, python_tag: str) -> Path:
    folder = tmp_path / "kit"
    (folder / "wheels").mkdir(parents=True)
    shutil.copy(INSTALL, folder / "install.sh")
    (folder / "MANIFEST.txt").write_text(f"python: {python_tag}\nrdma-kv: 0.1.0\n")
    return folder


def test_install_refuses_a_kit_built_for_another_python_before_making_anything(tmp_path):
    folder = kit(tmp_path, "cp27")
    proc = subprocess.run(["bash", str(folder / "install.sh"), "--venv", str(tmp_path / "venv")],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 3
    assert "this kit holds wheels for cp27, but python3 is cp3" in proc.stderr and "--python" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_install_refuses_an_unknown_option(tmp_path):
    proc = run(kit(tmp_path, "cp311") / "install.sh", "--vnev", "x")
    assert proc.returncode == 3 and "unknown option --vnev" in proc.stderr
