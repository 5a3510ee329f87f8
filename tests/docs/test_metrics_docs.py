"""The docs' metric lists and the vLLM settings table against the code:
every series ``PrometheusMetrics`` registers is named in docs/deploy.md
section 7 and in docs/vllm.md's Prometheus paragraph, every event the
events counter can carry is a counter that exists, and every key a vLLM user
may set is in docs/vllm.md's ``kv_connector_extra_config`` table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rdma_kv.connector.rdma.settings import USER_KEYS
from rdma_kv.connector.rdma.stats import ConsumerCounters, LeaseCounters, PushCounters

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _series() -> set[str]:
    prometheus_client = pytest.importorskip("prometheus_client")
    from rdma_kv.connector.rdma.metrics import PrometheusMetrics

    registry = prometheus_client.CollectorRegistry()
    PrometheusMetrics(registry=registry)
    return {m.name for m in registry.collect()}  # counters without their _total


def _named(text: str) -> set[str]:
    """Series named in ``text``: `rdma_kv_x...` in full, or `_x` after one (deploy.md's shorthand)."""
    names = {"rdma_kv" + n if n.startswith("_") else n for n in re.findall(r"`(rdma_kv\w*|_[a-z]\w*)", text)}
    return {re.sub(r"_total$", "", n) for n in names}


def _deploy_section_7() -> str:
    return (DOCS / "deploy.md").read_text().split("## 7. Watching it run")[1].split("## 8.")[0]


def test_deploy_guide_names_every_series() -> None:
    missing = sorted(_series() - _named(_deploy_section_7()))
    assert not missing, f"docs/deploy.md section 7 omits series {missing}"


def test_vllm_guide_names_every_series() -> None:
    text = (DOCS / "vllm.md").read_text()
    paragraph = text[text.index("Prometheus: `RdmaKVConnector.build_prom_metrics`"):].split("\n\n")[0]
    missing = sorted(_series() - _named(paragraph))
    assert not missing, f"docs/vllm.md's Prometheus paragraph omits series {missing}"


def test_the_events_named_are_counters_that_exist() -> None:
    section = _deploy_section_7()
    start = section.index("(", section.index("`rdma_kv_events_total{event}`"))
    depth, end = 0, start
    for end, char in enumerate(section[start:], start):  # the parenthesis after the name, to its match
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
    events = section[start:end]
    assert not re.search(r"confirm\W+(release\W+)?RPCs|confirm_rpcs", events), (
        f"deploy.md: events_total counts CONFIRM calls, but no counter does: {events!r}")
    named = set(re.findall(r"`([a-z_]+)`", events))
    known = ConsumerCounters.names() | LeaseCounters.names() | PushCounters.names()
    assert named and not named - known, f"deploy.md names events no counter counts: {sorted(named - known)}"


def test_vllm_settings_table_lists_every_key_a_user_may_set() -> None:
    text = (DOCS / "vllm.md").read_text()
    start = text.index("`kv_connector_extra_config` (unknown keys are rejected")
    keys: set[str] = set()
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            keys |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
        elif keys:
            break
    # attention_backend, kv_cache_dtype, kv_cache_scales: set by the adapter from vLLM; push_layerwise:
    # described in the mode row
    missing = sorted(set(USER_KEYS) - {"attention_backend", "kv_cache_dtype", "kv_cache_scales", "push_layerwise"}
                     - keys)
    assert not missing, f"docs/vllm.md's settings table lacks {missing}"
