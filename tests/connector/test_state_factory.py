"""The factory (names, module paths, lazy imports, errors) and the
process-wide transfer group."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import kv_harness
import rdma_kv
from rdma_kv.connector import (
    KVConnectorFactory,
    KVConnectorRole,
    KVTransferConfig,
    MultiConnector,
    StorageConnector,
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
    has_kv_transfer_group,
    is_v1_kv_transfer_group,
    reset_kv_transfer_state,
)
from rdma_kv.errors import ConfigError, ConnectorLoadError, NotInitializedError


def fake_config(**extra):
    return KVTransferConfig(
        kv_connector="FakeConnector",
        kv_connector_module_path="kv_harness",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def test_builtins_are_registered():
    names = KVConnectorFactory.registered_names()
    assert {"MultiConnector", "StorageConnector", "RdmaKVConnector"} <= set(names)


def test_importing_the_package_loads_no_connector_module_torch_or_vllm():
    code = (
        "import sys, rdma_kv.connector\n"
        "bad = [m for m in ('torch', 'vllm', 'safetensors', 'rdma_kv.transport',"
        " 'rdma_kv.connector.rdma') if m in sys.modules]\n"
        "print(bad)\n"
    )
    src = os.path.dirname(os.path.dirname(rdma_kv.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, env=env)
    assert out.stdout.strip() == "[]"


def test_registered_names_are_imported_lazily(tmp_path, monkeypatch):
    module = tmp_path / "lazy_conn_mod.py"
    module.write_text(
        "from kv_harness import FakeConnector\n"
        "class LazyConnector(FakeConnector):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    KVConnectorFactory.register_connector("Lazy", "lazy_conn_mod", "LazyConnector")
    try:
        assert "lazy_conn_mod" not in sys.modules
        cls = KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="Lazy", kv_role="kv_both")
        )
        assert cls.__name__ == "LazyConnector" and "lazy_conn_mod" in sys.modules
    finally:
        KVConnectorFactory.unregister_connector("Lazy")
        sys.modules.pop("lazy_conn_mod", None)


def test_create_by_name_and_by_module_path(tmp_path):
    storage = KVConnectorFactory.create_connector(
        kv_harness.storage_config(tmp_path), KVConnectorRole.SCHEDULER,
        kv_harness.cpu_kv_caches()[1],
    )
    assert isinstance(storage, StorageConnector) and storage.role is KVConnectorRole.SCHEDULER
    fake = KVConnectorFactory.create_connector(fake_config(), KVConnectorRole.WORKER)
    assert type(fake) is kv_harness.FakeConnector


def test_module_path_wins_over_the_registry():
    cfg = KVTransferConfig(kv_connector="MultiConnector", kv_connector_module_path="kv_harness",
                           kv_role="kv_both")
    with pytest.raises(ConnectorLoadError, match="module 'kv_harness' has no attribute 'MultiConnector'"):
        KVConnectorFactory.get_connector_class(cfg)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"kv_connector": "NoSuch"},
         r"unknown connector 'NoSuch'; registered connectors are \[.*'MultiConnector'.*\]"),
        ({"kv_connector": "X", "kv_connector_module_path": "no_such_pkg.mod"},
         "module 'no_such_pkg.mod' not found"),
        ({"kv_connector": "Missing", "kv_connector_module_path": "kv_harness"},
         "has no attribute 'Missing'"),
        ({"kv_connector": "NotAConnector", "kv_connector_module_path": "kv_harness"},
         "is not a KVConnectorBase subclass"),
        ({"kv_connector": "AbstractConnector", "kv_connector_module_path": "kv_harness"},
         r"is abstract; it does not implement \['build_connector_meta'"),
    ],
)
def test_load_errors_are_clear(kwargs, pattern):
    cfg = KVTransferConfig(kv_role="kv_both", **kwargs)
    with pytest.raises(ConnectorLoadError, match=pattern) as info:
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER)
    assert isinstance(info.value, ImportError)


def test_a_module_that_fails_to_import_is_a_load_error(tmp_path, monkeypatch):
    (tmp_path / "broken_conn_mod.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising_conn_mod.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConnectorLoadError, match="needs the missing module 'no_such_dependency_xyz'"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="X", kv_connector_module_path="broken_conn_mod",
                             kv_role="kv_both"))
    with pytest.raises(ConnectorLoadError, match="raised RuntimeError: boom"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="X", kv_connector_module_path="raising_conn_mod",
                             kv_role="kv_both"))


def test_registration_errors():
    with pytest.raises(ConfigError, match="already registered as rdma_kv.connector.multi.MultiConnector"):
        KVConnectorFactory.register_connector("MultiConnector", "x", "Y")
    with pytest.raises(ConfigError, match="not registered"):
        KVConnectorFactory.unregister_connector("NeverRegistered")
    with pytest.raises(ConfigError, match="module_path must be a non-empty string"):
        KVConnectorFactory.register_connector("N", "", "Y")
    with pytest.raises(ConfigError, match="kv_connector and kv_role must both be set"):
        KVConnectorFactory.create_connector(KVTransferConfig(), KVConnectorRole.WORKER)


# --- transfer state -------------------------------------------------------------------


def test_group_is_not_initialized_until_ensured():
    assert not has_kv_transfer_group()
    with pytest.raises(NotInitializedError, match="ensure_kv_transfer_initialized"):
        get_kv_transfer_group()
    assert ensure_kv_transfer_initialized(None) is None
    assert ensure_kv_transfer_initialized(KVTransferConfig()) is None
    assert not has_kv_transfer_group() and not is_v1_kv_transfer_group()


def test_ensure_creates_one_worker_connector_and_reuses_it():
    cfg = fake_config()
    group = ensure_kv_transfer_initialized(cfg)
    assert group is get_kv_transfer_group() and group.role is KVConnectorRole.WORKER
    assert ensure_kv_transfer_initialized(cfg) is group
    assert has_kv_transfer_group() and is_v1_kv_transfer_group()
    assert is_v1_kv_transfer_group(group) and not is_v1_kv_transfer_group(object())
    with pytest.raises(ConfigError, match="already initialized with a different config"):
        ensure_kv_transfer_initialized(fake_config(other=1))
    ensure_kv_transfer_shutdown()
    assert not has_kv_transfer_group()
    assert group.names("shutdown") == [("shutdown",)]


def test_reset_shuts_down_unless_told_not_to():
    group = ensure_kv_transfer_initialized(fake_config())
    reset_kv_transfer_state(shutdown=False)
    assert group.names("shutdown") == [] and not has_kv_transfer_group()


def test_concurrent_initialisation_creates_one_connector(monkeypatch):
    created = []
    original = kv_harness.FakeConnector.__init__

    def counting_init(self, *args):
        created.append(self)
        original(self, *args)

    monkeypatch.setattr(kv_harness.FakeConnector, "__init__", counting_init)
    cfg = fake_config()
    barrier = threading.Barrier(8)
    results = []

    def worker():
        barrier.wait()
        results.append(ensure_kv_transfer_initialized(cfg))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(created) == 1 and len(results) == 8
    assert all(r is created[0] for r in results)
    reset_kv_transfer_state()


def test_ensure_builds_a_multi_connector_from_config(tmp_path):
    cfg = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both",
        kv_connector_extra_config={"connectors": [kv_harness.fake_child()]},
    )
    group = ensure_kv_transfer_initialized(cfg, kv_harness.cpu_kv_caches()[1])
    assert isinstance(group, MultiConnector) and len(group.children) == 1
    reset_kv_transfer_state()
