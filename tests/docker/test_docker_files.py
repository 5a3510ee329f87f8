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


def router_commands() -> dict[str, list[str]]:
    """The router's argv in the compose file and in the Kubernetes manifests."""
    compose = yaml.safe_load((DOCKER / "docker-compose.1p1d.yml").read_text())
    docs = [d for d in yaml.safe_load_all((DOCKER / "k8s" / "1p1d.yaml").read_text()) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "router")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {"compose": compose["services"]["router"]["command"], "k8s": c["command"]}


def _flag(argv: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]


def test_the_router_is_vllm_router_pinned_in_the_image_and_the_install_script():
    """The examples route with vllm-router (PyPI), the version the image
    installs and scripts/install-vllm.sh (hence the tests) pins; its P/D
    mode, one prefill and one decode, pointing at the engines' ports."""
    pin = re.search(r"^ARG VLLM_ROUTER_VERSION=(\S+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    script = (DOCKER.parent / "scripts" / "install-vllm.sh").read_text()
    assert pin and f"VLLM_ROUTER_VERSION={pin.group(1)}\n" in script, pin
    assert 'pip install "vllm-router==${VLLM_ROUTER_VERSION}"' in (DOCKER / "Dockerfile").read_text()
    for where, argv in router_commands().items():
        assert argv[0] == "vllm-router" and "--vllm-pd-disaggregation" in argv, (where, argv)
        (prefill,), (decode,) = _flag(argv, "prefill"), _flag(argv, "decode")
        assert prefill.endswith(":8100") and decode.endswith(":8200"), (where, argv)
        assert _flag(argv, "prometheus-port"), (where, argv)


def test_nothing_points_at_a_home_made_router():
    """docker/router.py is gone; no doc, example or build file names it."""
    root = DOCKER.parent
    assert not (DOCKER / "router.py").exists()
    files = [root / "README.md", *root.glob("docs/*.md"), *DOCKER.rglob("*"), *root.glob("scripts/*"),
             *root.glob("bench/*.py")]
    home_made = re.compile(r"(?<!\w)router\.py")  # not tests/vllm/test_vllm_router.py
    named = [str(f.relative_to(root)) for f in files
             if f.is_file() and home_made.search(f.read_text(errors="replace"))]
    assert not named, named
