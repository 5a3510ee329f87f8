"""Every code block of README.md and docs/ runs as written or is marked a
fragment (``snippets.py`` says how blocks are marked), and the runnable
ones run here: the README's transport example and the ``rdma-kv info``
and ``rdma-kv selftest`` examples. The vLLM guide's offline example runs in tests/vllm
(``test_vllm_docs.py``), inside vLLM; the deploy guide's Dynamo config in
``test_vllm_frameworks.py`` and its Ray Serve recipe in ``test_vllm_ray.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import Block, all_blocks, snippet

RUN_HERE = ("readme-transport", "readme-info", "deploy-info", "deploy-selftest")
RUN_IN_VLLM = ("vllm-offline/decode.py", "vllm-offline/prefill.py", "vllm-offline/run",
               "deploy-dynamo-config", "deploy-ray-recipe")
TIMEOUT_S = 120


def test_every_code_block_is_a_snippet_or_a_fragment() -> None:
    blocks = all_blocks()
    assert blocks, "no code blocks found: is the parser broken?"
    unmarked = [b.where for b in blocks if b.kind is None]
    assert not unmarked, (f"code blocks without a marker line above them: {unmarked}; add "
                          "<!-- snippet: NAME --> (and run it in a test) or <!-- fragment: WHY -->")
    assert all(b.label for b in blocks), [b.where for b in blocks if not b.label]


def test_every_snippet_is_run_by_a_test() -> None:
    names = [b.label for b in all_blocks() if b.kind == "snippet"]
    assert sorted(names) == sorted(RUN_HERE + RUN_IN_VLLM), names


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The documented runs had no UCX_NET_DEVICES; `rdma-kv demo`, run by an
    # earlier test in this process, pins it to lo (and the selftest would
    # then check that NIC).
    env.pop("UCX_NET_DEVICES", None)
    # the interpreter running the tests, and its rdma-kv command, come first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run(argv: list[str], block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.where} did not finish within {TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")


def _shown_output(block: Block) -> str:
    """The output block printed right after ``block`` in its document."""
    text = block.path.read_text()
    start = text.index(block.code)
    after = text[start + len(block.code):]
    m = re.search(r"\n```\n(.*?)\n```", after, re.S)
    assert m, f"{block.where}: no output block after it"
    return m.group(1)


@pytest.mark.ucx
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_readme_transport_example(tmp_path: Path) -> None:
    block = snippet("readme-transport")
    result = _run([sys.executable, "-c", block.code], block, tmp_path)
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout}\n{result.stderr}"
    assert "2 ops" in result.stdout and "payload=b'req-42'" in result.stdout, result.stdout


@pytest.mark.ucx
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_readme_info_example(tmp_path: Path) -> None:
    block = snippet("readme-info")
    result = _run(["bash", "-euo", "pipefail", "-c", block.code], block, tmp_path)
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout}\n{result.stderr}"
    assert '"level": "ok"' in result.stdout and '"level": "error"' not in result.stdout


@pytest.mark.ucx
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_deploy_info_example_prints_what_the_guide_shows(tmp_path: Path) -> None:
    block = snippet("deploy-info")
    result = _run(["bash", "-c", block.code], block, tmp_path)
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout}\n{result.stderr}"
    shown = [line for line in _shown_output(block).splitlines()
             if line.startswith("  [") or line.startswith("exit status")]
    assert shown, f"{block.where}: the output block shows no findings"
    got = [line for line in result.stdout.splitlines()
           if line.startswith("  [") or line.startswith("exit status")]
    assert got == shown, f"{block.where}: the guide shows\n" + "\n".join(shown) + "\nbut it printed\n" \
        + result.stdout


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_deploy_selftest_example_prints_the_checks_the_guide_shows(tmp_path: Path) -> None:
    """The same checks with the same status, in the same order (details hold
    paths and GB/s, which differ run to run); and the JSON it wrote."""
    block = snippet("deploy-selftest")
    result = _run(["bash", "-c", block.code], block, tmp_path)
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout}\n{result.stderr}"

    def checks(text: str) -> list[str]:
        return [" ".join(line.split()[:2]) for line in text.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]

    shown = checks(_shown_output(block))
    assert shown, f"{block.where}: the output block shows no checks"
    assert checks(result.stdout) == shown, f"{block.where}: the guide shows {shown} but it printed\n{result.stdout}"
    written = json.loads((tmp_path / "selftest.json").read_text())["checks"]
    assert [f"{c['status']} {c['name']}" for c in written] == shown
