"""Every deployment example's kv-transfer-config starts: each one embedded in
docker/docker-compose*.yml, docker/k8s/*.yaml and the docs (``vllm serve
--kv-transfer-config '...'`` and JSON code blocks) is loaded into vLLM's
real ``KVTransferConfig`` (which rejects unknown fields such as ``kv_ip``),
then through the adapter into the connector's settings. No engine starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-vllm.sh)")
yaml = pytest.importorskip("yaml")

from vllm.config import KVTransferConfig as VllmKVTransferConfig  # noqa: E402

from rdma_kv.connector.rdma.settings import RdmaSettings  # noqa: E402
from rdma_kv.vllm import translate  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
FLAG = "--kv-transfer-config"


def _fill(text: str) -> str:
    """Shell/compose variables as a deployment would expand them."""
    text = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?[-?][^}]*)?\}", "10.0.0.11", text)
    return re.sub(r"\$[A-Za-z_][A-Za-z0-9_]*", "10.0.0.12", text)


def _from_compose(path: Path) -> list[tuple[str, str]]:
    out = []
    for name, svc in (yaml.safe_load(path.read_text()).get("services") or {}).items():
        command = svc.get("command") or []
        if isinstance(command, list) and FLAG in command:
            out.append((f"{path.name}:{name}", command[command.index(FLAG) + 1]))
    return out


def _from_k8s(path: Path) -> list[tuple[str, str]]:
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        pod = ((doc or {}).get("spec", {}).get("template", {}) or {}).get("spec", {})
        for c in pod.get("containers", []):
            for arg in [*(c.get("command") or []), *(c.get("args") or [])]:
                m = re.search(re.escape(FLAG) + r'\s+"(.*)"\s*$', arg, re.DOTALL)
                if m:
                    out.append((f"{path.name}:{doc['metadata']['name']}", m.group(1).replace('\\"', '"')))
    return out


def _from_markdown(path: Path) -> list[tuple[str, str]]:
    text = path.read_text()
    found = [m.group(1) for m in re.finditer(re.escape(FLAG) + r"\s+'(\{.*?\})'", text, re.DOTALL)]
    found += [m.group(1) for m in re.finditer(r"```json\n(.*?)```", text, re.DOTALL) if '"kv_role"' in m.group(1)]
    return [(f"{path.relative_to(ROOT)}#{i}", t) for i, t in enumerate(found)]


def examples() -> list[tuple[str, str]]:
    docker = ROOT / "docker"
    out = [e for p in sorted(docker.glob("docker-compose*.yml")) for e in _from_compose(p)]
    out += [e for p in sorted((docker / "k8s").glob("*.yaml")) for e in _from_k8s(p)]
    for md in sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md", docker / "README.md"]):
        out += _from_markdown(md)
    return out


EXAMPLES = examples()


def test_the_examples_are_found():
    where = {name.split(":")[0].split("#")[0] for name, _ in EXAMPLES}
    assert {"docker-compose.1p1d.yml", "1p1d.yaml", "docs/vllm.md"} <= where, where


@pytest.mark.parametrize("text", [t for _, t in EXAMPLES], ids=[n for n, _ in EXAMPLES])
def test_example_loads_into_vllm_and_the_connector(text):
    raw = json.loads(_fill(text))
    config = VllmKVTransferConfig(**raw)  # unknown fields (kv_ip) raise here
    ours = translate.transfer_config(config, tp_rank=0, tp_size=1)
    RdmaSettings.from_config(ours)  # unknown extra keys raise here


def _router_argvs() -> dict[str, list[str]]:
    compose = yaml.safe_load((ROOT / "docker" / "docker-compose.1p1d.yml").read_text())
    docs = [d for d in yaml.safe_load_all((ROOT / "docker" / "k8s" / "1p1d.yaml").read_text()) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "router")
    return {"compose": compose["services"]["router"]["command"],
            "k8s": dep["spec"]["template"]["spec"]["containers"][0]["command"]}


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_router_command_parses_with_vllm_router(where):
    """The examples' router command, parsed by the installed vllm-router's
    own argument parser: vLLM P/D mode, one prefill and one decode, NIXL's
    protocol (kv_transfer_params relayed verbatim), retries on."""
    launch = pytest.importorskip("vllm_router.launch_router")
    argv = _router_argvs()[where]
    assert argv[0] == "vllm-router"
    args = launch.parse_router_args(argv[1:])
    assert args.vllm_pd_disaggregation and args.kv_connector == "nixl"
    assert [u for u, _ in args.prefill_urls] == [a.split("=", 1)[1] for a in argv if a.startswith("--prefill=")]
    assert len(args.decode_urls) == 1 and args.retry_max_retries > 1 and not args.disable_retries
