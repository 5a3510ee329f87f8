"""Fixtures for the transport tests (``rng`` comes from tests/conftest.py): an
agent factory that closes every Agent a test made and fails loudly when
teardown leaks, a guard against progress threads left running, and two
connected agents in one process.

Every agent made here uses ``NET_DEVICES=lo``: UCX otherwise also stripes
TCP traffic over eth0's address, and these tests keep to 127.0.0.1.
Tests marked ``ucx`` are skipped when the UCX libraries or the shim cannot
load; everything else runs anywhere.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator

import pytest

from rdma_kv.errors import UCXUnavailableError
from transport_helpers import LOOPBACK, Pair, connect, progress_threads, teardown_problems

_ucx_problem: str | None = None
_ucx_checked = False


def ucx_problem() -> str | None:
    """Why UCX cannot be used here, or None when it loads."""
    global _ucx_checked, _ucx_problem
    if not _ucx_checked:
        _ucx_checked = True
        try:
            from rdma_kv.transport._lib import load

            load()
        except UCXUnavailableError as exc:
            _ucx_problem = str(exc)
    return _ucx_problem


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("ucx") is not None and ucx_problem() is not None:
        pytest.skip(f"UCX unavailable: {ucx_problem()}")



@pytest.fixture(autouse=True)
def no_leaked_progress_threads() -> Iterator[None]:
    """Fail a test that leaves a progress thread running (an Agent made
    outside ``make_agent`` and never closed)."""
    before = progress_threads()
    yield
    leaked = sorted(t.name for t in progress_threads() - before if t.is_alive())
    if leaked:
        pytest.fail(f"test leaked running agents (progress threads {leaked}); close every Agent it creates")


@pytest.fixture(scope="session", autouse=True)
def no_open_agents_at_exit() -> Iterator[None]:
    """Backstop for poll-mode agents, which have no thread to notice."""
    yield
    if "rdma_kv.transport.agent" not in sys.modules:
        return
    from rdma_kv.transport.agent import Agent

    gc.collect()
    open_agents = [repr(o) for o in gc.get_objects() if type(o) is Agent and not o.closed]
    assert not open_agents, f"agents left open after the transport tests: {open_agents}"


AgentFactory = Callable[..., object]  # makes an rdma_kv.transport.Agent


@pytest.fixture
def make_agent() -> Iterator[AgentFactory]:
    """``make_agent(name, **AgentConfig fields)``: an Agent closed after the
    test. ``ucx_options`` default to loopback-only; pass ``TCP`` for TCP."""
    from rdma_kv.transport import Agent, AgentConfig

    created: list[Agent] = []

    def make(name: str, **config) -> Agent:
        options = dict(LOOPBACK)
        options.update(config.pop("ucx_options", {}))
        agent = Agent(name, AgentConfig(ucx_options=options, **config))
        created.append(agent)
        return agent

    yield make
    problems = teardown_problems(created)
    if problems:
        pytest.fail("agent teardown leaked:\n  " + "\n  ".join(problems))


@pytest.fixture
def pair(make_agent: AgentFactory) -> Pair:
    """Agents ``a`` and ``b`` (progress threads), peers of each other; ``a``'s
    buffer holds seeded random bytes, ``b``'s zeros."""
    return connect(make_agent)
