"""Small KV connectors used to exercise the harness and vLLM's connector
contract. They are loaded the way kvshim is, through
``kv_connector_module_path="kvshim_test_connectors"`` (tests/vllm is on
sys.path, see conftest.py). They are plug-ins, not stand-ins for vLLM.

Extra config keys (kv_connector_extra_config):
  ``hit_tokens``   tokens an external cache "has" for every prompt (0 = miss)
  ``defers``       times get_num_new_matched_tokens answers None (pending)
                   before it answers
  ``delay_free``   request_finished returns True; the worker reports the
                   request in finished_sending one step later
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    # req_id -> block ids (group 0) the worker should load into.
    loads: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> (num_computed_tokens, num_scheduled_tokens) of this step.
    scheduled: dict[str, tuple[int, int]] = field(default_factory=dict)
    # requests whose blocks the worker must "save" before they are freed.
    saves: set[str] = field(default_factory=set)


class RecordingConnector(KVConnectorBase_V1):
    """Answers from extra config; records every scheduler-side call in
    ``self.calls`` as (method, details) tuples."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.hit_tokens = int(extra.get("hit_tokens", 0))
        self.defers = int(extra.get("defers", 0))
        self.delay_free = bool(extra.get("delay_free", False))
        self.calls: list[tuple[str, Any]] = []
        self._defers_left: dict[str, int] = {}
        self._pending_loads: dict[str, list[int]] = {}
        self._pending_saves: set[str] = set()
        # worker side
        self._recving: set[str] = set()
        self._sending: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a lost save is a future miss

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        left = self._defers_left.setdefault(rid, self.defers)
        self.calls.append(("get_num_new_matched_tokens", (rid, num_computed_tokens)))
        if left > 0:
            self._defers_left[rid] = left - 1
            return None, False
        # Never the whole prompt: vLLM must compute at least one token.
        hit = min(self.hit_tokens, request.num_tokens - 1)
        n = max(0, hit - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()
        self.calls.append(
            (
                "update_state_after_alloc",
                (request.request_id, [list(g) for g in block_ids], num_external_tokens),
            )
        )
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = list(block_ids[0])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RecordingMetadata(loads=self._pending_loads, saves=self._pending_saves)
        self._pending_loads, self._pending_saves = {}, set()
        for nr in scheduler_output.scheduled_new_reqs:
            meta.scheduled[nr.req_id] = (
                nr.num_computed_tokens,
                scheduler_output.num_scheduled_tokens[nr.req_id],
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            meta.scheduled[rid] = (
                cached.num_computed_tokens[i],
                scheduler_output.num_scheduled_tokens[rid],
            )
        self.calls.append(("build_connector_meta", meta))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", (request.request_id, list(block_ids))))
        if self.delay_free:
            self._pending_saves.add(request.request_id)
        return self.delay_free, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append(("update_connector_output", connector_output))

    # ---- worker side: transfers "complete" one step after they start ----
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RecordingMetadata)
        self._recving.update(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RecordingMetadata)
        self._sending.update(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, self._sending = self._sending, set()
        recving, self._recving = self._recving, set()
        return (sending or None), (recving or None)


class TwoArgConnector(KVConnectorBase_V1):
    """Old-style 2-argument constructor: vLLM 0.33 refuses it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        raise AssertionError("must not be constructed")

    start_load_kv = wait_for_layer_load = save_kv_layer = wait_for_save = None  # type: ignore[assignment]
    get_num_new_matched_tokens = update_state_after_alloc = None  # type: ignore[assignment]
    build_connector_meta = None  # type: ignore[assignment]
