"""docker/: the compose file and the Kubernetes manifests parse, carry what
an RDMA engine needs (IPC_LOCK, unlimited memlock, /dev/infiniband, the
system UCX, a secret from a file), and embed kv-transfer-configs that
rdma-kv's own config check accepts. No Docker engine or cluster is needed
(nor available where this runs); the images are not built here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DOCKER = Path(__file__).resolve().parents[2] / "docker"
ENGINES = ("prefill", "decode")


def _check_kv_config(text: str, role: str) -> None:
    from rdma_kv.cli.info import Report, check_config

    config = json.loads(text)
    assert config["kv_role"] == role and config["kv_connector_module_path"] == "rdma_kv.vllm"
    assert config["kv_connector_extra_config"]["auth_secret_file"].startswith("/run/secrets/")
    report = Report(cuda="no CUDA device")
    check_config(text, report)
    # The addresses are the cluster's, not this host's: only that finding may be an error.
    errors = [f.message for f in report.findings
              if f.level == "error" and "is not an address of this host" not in f.message]
    assert not errors, errors


def test_compose_engines_have_rdma_essentials():
    compose = yaml.safe_load((DOCKER / "docker-compose.1p1d.yml").read_text())
    services = compose["services"]
    assert set(services) == {"prefill", "decode", "router"}
    for name in ENGINES:
        svc = services[name]
        assert "IPC_LOCK" in svc["cap_add"]
        assert svc["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
        assert "/dev/infiniband:/dev/infiniband" in svc["devices"]
        assert svc["network_mode"] == "host" and svc["shm_size"]
        env = svc["environment"]
        assert env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
        assert "rc" in env["UCX_TLS"].split(",") and env["UCX_NET_DEVICES"]
        assert svc["secrets"] == ["rdma_kv_secret"]
        command = svc["command"]
        text = command[command.index("--kv-transfer-config") + 1]
        text = re.sub(r"\$\{RDMA_KV_HOST_IP[^}]*\}", "10.0.0.11", text)
        _check_kv_config(text, "kv_producer" if name == "prefill" else "kv_consumer")
    assert "file" in compose["secrets"]["rdma_kv_secret"]


def test_k8s_manifests_have_rdma_essentials():
    docs = [d for d in yaml.safe_load_all((DOCKER / "k8s" / "1p1d.yaml").read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "prefill"), ("Deployment", "decode"), ("Deployment", "router"),
            ("Service", "router"), ("ConfigMap", "rdma-kv-ucx")} <= kinds
    assert not any(d["kind"] == "Secret" for d in docs)  # created by the operator, never committed
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config_map["data"]["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
    for name in ENGINES:
        dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
        pod = dep["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True
        (c,) = pod["containers"]
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/dev/shm", "/run/secrets/rdma-kv"}
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        m = re.search(r'--kv-transfer-config\s+"(.*)"\s*$', c["args"][0], re.DOTALL)
        text = m.group(1).replace('\\"', '"').replace("$POD_IP", "10.0.0.12")
        _check_kv_config(text, "kv_producer" if name == "prefill" else "kv_consumer")


def test_dockerfile_uses_system_ucx_with_verbs():
    text = (DOCKER / "Dockerfile").read_text()
    for needle in ("--with-verbs", "--with-rdmacm", "--with-cuda", "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true",
                   'RDMA_KV_UCX_PREFIX="${UCX_PREFIX}"', "ARG VLLM_VERSION=0.32.0", "ARG TORCH_VERSION=2.13.0",
                   "rdma-core", "ibverbs-utils", "FROM nvidia/cuda:"):
        assert needle in text, needle


def _run_steps(text: str) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip()[4:] for line in joined.splitlines() if line.strip().startswith("RUN ")]


def test_dockerfile_requires_mlx5_and_cuda_and_checks_the_modules():
    """mlx5 and CUDA are required at configure time and their transport
    modules checked after the build (configure's --with-verbs alone builds
    without verbs when it finds none); gdrcopy is not built, and the docs
    say exactly that."""
    text = (DOCKER / "Dockerfile").read_text()
    steps = _run_steps(text)
    configure = next(s for s in steps if "configure-release" in s)
    for flag in ("--with-verbs", "--with-mlx5", "--with-rdmacm", "--with-cuda=/usr/local/cuda", "--without-gdrcopy"):
        assert re.search(re.escape(flag) + r"(\s|$)", configure), flag
    check = next(s for s in steps if "libuct_ib_mlx5.so" in s)
    for module in ("libuct_ib.so", "libuct_ib_mlx5.so", "libuct_rdmacm.so", "libuct_cuda.so"):
        assert module in check.split("do")[0], module
    assert 'test -e "${UCX_PREFIX}/lib/ucx/${module}"' in check and "exit 1" in check
    assert steps.index(check) == steps.index(configure) + 1  # in the build stage, right after make install
    readme = (DOCKER / "README.md").read_text()
    for words in ("--with-mlx5", "--without-gdrcopy", "libuct_ib_mlx5.so", "libuct_cuda.so"):
        assert words in readme, words
    design = (DOCKER.parent / "docs" / "design.md").read_text()
    assert "gdr_copy" not in design.replace("no `gdr_copy`", "")


def test_router_forwards_prefill_params_to_decode():
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("router", DOCKER / "router.py")
    router = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(router)
    seen = []

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "p":
            return httpx.Response(200, json={"kv_transfer_params": {"remote_engine_id": "e", "do_remote_prefill": True}})
        return httpx.Response(200, json={"choices": [{"text": "hi"}]})

    real_client = httpx.AsyncClient
    # The router's upstream client talks to a mock transport instead of engines.
    router.httpx.AsyncClient = lambda **kw: real_client(transport=httpx.MockTransport(upstream), **kw)
    try:
        app = router.build_app(["http://p"], ["http://d"])
    finally:
        router.httpx.AsyncClient = real_client

    async def run() -> httpx.Response:
        async with real_client(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 5})

    response = asyncio.run(run())
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "hi"
    (_, first), (_, second) = seen
    assert first["max_tokens"] == 1 and first["kv_transfer_params"] == {"do_remote_decode": True}
    assert second["max_tokens"] == 5 and second["kv_transfer_params"]["remote_engine_id"] == "e"
