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
