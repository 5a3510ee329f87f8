"""docs/vllm.md's offline example, run as written: its ``decode.py`` and
``prefill.py`` blocks saved under those names, then its run block
(``python decode.py "$MODEL"``) with the tiny model, multiprocessing on
(vLLM's default, so the ``__main__`` guards matter).

One P/D pair, about three minutes on 2 cores. The outputs must all finish
normally, and the KV must really have been loaded: under the example's
``kv_load_failure_policy: "recompute"`` a failed load still produces the
same output, and a decode request whose params were lost computes the
prompt itself without a word. So vLLM logs at DEBUG (set in the
environment; the scripts are untouched) and the test counts the decode
scheduler's ``Finished recving KV transfer`` lines, one per prompt, and
requires that rdma-kv logged no failed load.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")

import rdma_kv  # noqa: E402
from tiny_model import PrivateTmp, build_tiny_llama, vllm_env  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
from snippets import snippet  # noqa: E402

pytestmark = pytest.mark.vllm
TIMEOUT_S = 600


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_offline_example_runs_as_written(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    for name in ("decode.py", "prefill.py"):
        (tmp_path / name).write_text(snippet(f"vllm-offline/{name}").code)
    run = snippet("vllm-offline/run")
    env = dict(os.environ, **vllm_env(multiprocessing=True), MODEL=model,
               VLLM_CPU_KVCACHE_SPACE="1",  # GiB per engine; the default is more than a test needs
               VLLM_LOGGING_LEVEL="DEBUG")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # the rdma-kv under test, in every vLLM process
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(rdma_kv.__file__).parents[1]),
                                                      env.get("PYTHONPATH")]))
    private = PrivateTmp("docs-offline")  # vLLM's IPC sockets, gone even if the engines are killed
    env.update(private.env)
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", run.code], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # decode.py, prefill.py and their engine cores
        out, _ = proc.communicate()
        pytest.fail(f"{run.where} did not finish within {TIMEOUT_S} s:\n{out[-6000:]}")
    finally:
        private.remove()
    assert proc.returncode == 0, f"{run.where} failed ({proc.returncode}):\n{out[-6000:]}"
    finished = re.findall(r"^(\w+): '.*'$", out, re.M)
    assert finished == ["length", "length"], out[-6000:]
    assert "KV load failed" not in out, out[-6000:]
    loads = re.findall(r"Finished recving KV transfer for request", out)
    assert len(loads) == len(finished), f"{len(loads)} loads for {len(finished)} prompts:\n{out[-6000:]}"
