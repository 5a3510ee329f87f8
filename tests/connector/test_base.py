"""The connector contract: roles, defaults, metadata binding, types."""

from __future__ import annotations

import numpy as np
import pytest

from rdma_kv.connector import (
    KVCacheBlocks,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    Request,
    SchedulerOutput,
)
from rdma_kv.errors import ConfigError, NotInitializedError, RoleError

CONFIG = KVTransferConfig(kv_connector="Minimal", kv_role="kv_both")


class Minimal(KVConnectorBase):
    """Implements only the abstract methods; records what ran."""

    def __init__(self, *args):
        super().__init__(*args)
        self.ran: list[str] = []

    def start_load_kv(self, forward_context=None, **kwargs):
        self.ran.append("start_load_kv")

    def wait_for_layer_load(self, layer_name):
        self.ran.append("wait_for_layer_load")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs):
        self.ran.append("save_kv_layer")

    def wait_for_save(self):
        self.ran.append("wait_for_save")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.ran.append("get_num_new_matched_tokens")
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.ran.append("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output):
        self.ran.append("build_connector_meta")
        return KVConnectorMetadata()


def make(role):
    return Minimal(CONFIG, role, None)


REQUEST = Request("r1", [1, 2, 3])

WORKER_CALLS = {
    "register_kv_caches": ({},),
    "get_handshake_metadata": (),
    "unregister_kv_caches": (),
    "restore_kv_caches": (),
    "bind_connector_metadata": (KVConnectorMetadata(),),
    "clear_connector_metadata": (),
    "has_connector_metadata": (),
    "_get_connector_metadata": (),
    "start_load_kv": (None,),
    "wait_for_layer_load": ("layer",),
    "save_kv_layer": ("layer", None, None),
    "wait_for_save": (),
    "get_finished": (set(),),
    "get_block_ids_with_load_errors": (),
}
SCHEDULER_CALLS = {
    "get_num_new_matched_tokens": (REQUEST, 0),
    "update_state_after_alloc": (REQUEST, KVCacheBlocks.of([0]), 0),
    "build_connector_meta": (SchedulerOutput(),),
    "update_connector_output": (KVConnectorOutput(),),
    "request_finished": (REQUEST, [0]),
    "request_finished_all_groups": (REQUEST, ([0],)),
    "set_xfer_handshake_metadata": ({},),
}


@pytest.mark.parametrize("method", sorted(WORKER_CALLS))
def test_worker_methods_refuse_the_scheduler_role(method):
    connector = make(KVConnectorRole.SCHEDULER)
    with pytest.raises(RoleError) as info:
        getattr(connector, method)(*WORKER_CALLS[method])
    message = str(info.value)
    assert f"Minimal.{method}()" in message and "worker-side" in message and "SCHEDULER" in message
    assert connector.ran == []  # refused before the body ran


@pytest.mark.parametrize("method", sorted(SCHEDULER_CALLS))
def test_scheduler_methods_refuse_the_worker_role(method):
    connector = make(KVConnectorRole.WORKER)
    with pytest.raises(RoleError, match=f"{method}\\(\\) is a scheduler-side method.*role WORKER"):
        getattr(connector, method)(*SCHEDULER_CALLS[method])
    assert connector.ran == []


def test_every_contract_method_is_role_checked():
    assert set(WORKER_CALLS) | set(SCHEDULER_CALLS) >= {
        name for name in dir(KVConnectorBase)
        if hasattr(getattr(KVConnectorBase, name), "__kv_connector_role__")
    }


def test_methods_run_on_their_own_role_with_the_documented_defaults():
    worker = make(KVConnectorRole.WORKER)
    for method, args in WORKER_CALLS.items():
        if method == "_get_connector_metadata":
            continue
        getattr(worker, method)(*args)
    assert worker.get_finished(set()) == (set(), set())
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.get_handshake_metadata() is None
    scheduler = make(KVConnectorRole.SCHEDULER)
    for method, args in SCHEDULER_CALLS.items():
        getattr(scheduler, method)(*args)
    assert scheduler.request_finished(REQUEST, [0]) == (False, None)
    # one group: the default hands it to request_finished; several: refused, saying what to do
    assert scheduler.request_finished_all_groups(REQUEST, ([0],)) == (False, None)
    with pytest.raises(ConfigError, match="supports one KV-cache group, got block ids of 2.*hybrid"):
        scheduler.request_finished_all_groups(REQUEST, ([0], [1]))
    for either in (worker, scheduler):
        assert either.get_kv_connector_stats() is None
        assert either.shutdown() is None
    assert worker.role is KVConnectorRole.WORKER and scheduler.config is CONFIG


def test_overrides_calling_super_keep_working():
    class Derived(Minimal):
        def get_finished(self, finished_req_ids):
            done_sending, done_recving = super().get_finished(finished_req_ids)
            return done_sending | {"x"}, done_recving

    worker = Derived(CONFIG, KVConnectorRole.WORKER, None)
    assert worker.get_finished(set()) == ({"x"}, set())
    with pytest.raises(RoleError):
        Derived(CONFIG, KVConnectorRole.SCHEDULER, None).get_finished(set())


def test_missing_super_init_is_a_clear_error():
    class Broken(Minimal):
        def __init__(self, *args):
            pass

    with pytest.raises(RoleError, match="call super\\(\\).__init__\\(\\) first"):
        Broken(CONFIG, KVConnectorRole.WORKER, None).wait_for_save()


def test_metadata_binding():
    worker = make(KVConnectorRole.WORKER)
    with pytest.raises(NotInitializedError, match="bind_connector_metadata"):
        worker._get_connector_metadata()
    meta = KVConnectorMetadata()
    worker.bind_connector_metadata(meta)
    assert worker.has_connector_metadata() and worker._get_connector_metadata() is meta
    worker.clear_connector_metadata()
    assert not worker.has_connector_metadata()
    with pytest.raises(ConfigError, match="must be a KVConnectorMetadata"):
        worker.bind_connector_metadata({"not": "metadata"})


def test_abstract_methods_must_be_implemented():
    class Partial(KVConnectorBase):
        def start_load_kv(self, forward_context=None, **kwargs):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial(CONFIG, KVConnectorRole.WORKER, None)


def test_constructor_validates_its_arguments():
    with pytest.raises(ConfigError, match="role must be a KVConnectorRole"):
        Minimal(CONFIG, "worker", None)
    with pytest.raises(ConfigError, match="config must be a KVTransferConfig"):
        Minimal(CONFIG.to_dict(), KVConnectorRole.WORKER, None)
    with pytest.raises(ConfigError, match="kv_cache_config"):
        Minimal(CONFIG, KVConnectorRole.WORKER, {"num_blocks": 1})


# --- types -----------------------------------------------------------------------


def test_request_params_are_a_read_only_copy():
    params = {"do_remote_decode": True}
    request = Request("r", [5, 6, 7], params)
    params["do_remote_decode"] = False
    assert request.kv_transfer_params["do_remote_decode"] is True
    with pytest.raises(TypeError):
        request.kv_transfer_params["x"] = 1  # type: ignore[index]
    request.output_token_ids.append(9)
    assert request.num_tokens == 4 and request.num_prompt_tokens == 3
    assert request.all_token_ids == (5, 6, 7, 9)
    with pytest.raises(ConfigError, match="empty prompt"):
        Request("r", [])
    with pytest.raises(ConfigError, match="request_id"):
        Request("", [1])
    # Token ids are integers (numpy's too); a float was truncated before, a string parsed.
    assert Request("r", np.arange(3, dtype=np.int32)).prompt_token_ids == (0, 1, 2)
    for bad in ([1.5, 2], ["5"]):
        with pytest.raises(ConfigError, match="prompt token ids must be integers"):
            Request("r", bad)


def test_a_request_with_other_params_shares_its_checked_prompt_and_memo():
    request = Request("r", [5, 6, 7], {"do_remote_decode": True})
    request.memo["derived"] = 1
    request.num_computed_tokens, request.aborted = 3, True
    request.output_token_ids.append(9)
    params = {"do_remote_decode": False}
    again = request.with_params(params)
    params["do_remote_decode"] = True
    assert again.prompt_token_ids is request.prompt_token_ids and again.memo is request.memo
    assert dict(again.kv_transfer_params) == {"do_remote_decode": False}  # a read-only copy
    assert (again.num_computed_tokens, again.aborted, again.output_token_ids) == (0, False, [])
    assert dict(request.with_params(None).kv_transfer_params) == {}
    keyed = Request("r", [5], extra_keys=(("lora", "sql", "/p"),))
    assert keyed.with_params(None).extra_keys == (("lora", "sql", "/p"),)
    with pytest.raises(ConfigError, match="extra_keys must be hashable"):
        Request("r", [5], extra_keys=(["a list"],))


def test_blocks_and_outputs():
    blocks = KVCacheBlocks.of([3, 4], [7])
    assert blocks.num_groups == 2 and blocks.get_block_ids() == ([3, 4], [7])
    assert KVCacheBlocks.empty(2).get_block_ids() == ([], [])
    with pytest.raises(ConfigError, match=">= 0"):
        KVCacheBlocks.of([-1])
    with pytest.raises(ConfigError, match=">= 0"):
        KVCacheBlocks.of([5, 2, -1, 7])  # plain ints are checked in bulk
    assert KVCacheBlocks.of(np.array([2, 1])).get_block_ids() == ([2, 1],)  # numpy's, one by one
    out = KVConnectorOutput.of(["a"], None, [1, 2])
    assert out.finished_sending == {"a"} and out.invalid_block_ids == {1, 2}
    assert not out.is_empty() and KVConnectorOutput().is_empty()
    so = SchedulerOutput(num_scheduled_tokens={"a": 3}, finished_req_ids={"b"})
    with pytest.raises(TypeError):
        so.num_scheduled_tokens["a"] = 4  # type: ignore[index]
    assert so.finished_req_ids == frozenset({"b"})
