"""KVShimConnector: kvshim as a vLLM v1 KV connector.

Select it with::

    --kv-transfer-config '{"kv_connector": "KVShimConnector",
                           "kv_connector_module_path": "kvshim.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvshim.l1_size_gb": 16}}'

This module only translates vLLM objects into flat arrays and JSON and calls
libkvshim.so once per vLLM call; chunk keys, lookups, planning, the protocol
and the copies happen in Go (shim/, ipc/, layout/, cuda/). Importing it loads
nothing native: the library is loaded in the constructor, after vLLM has
forked its worker processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvshim import events as kv_events
from kvshim import native
from kvshim.vllm.config import connector_config, logger, required_layout
from kvshim.vllm.scheduler import KVShimScheduler
from kvshim.vllm.stats import KVShimStats
from kvshim.vllm.worker import KVShimWorker

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVShimConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector API on top of libkvshim.so (see the module doc): each
    call goes to the object of this connector's role, connector_scheduler or
    connector_worker (as vLLM's OffloadingConnector does).

    SupportsHMA: vLLM's hybrid KV-cache manager stays on (models with sliding
    windows or chunked local attention keep their smaller KV caches); every
    KV-cache group is saved and restored by its own protocol
    (shim/groups.go)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        # The base declares kv_cache_config required; kvshim also runs without
        # one (one KV-cache group, the layout from vllm_config).
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        conf = connector_config(vllm_config, kv_cache_config, role)
        cfg, open_cfg = conf["settings"], conf["open"]
        for w in conf["warnings"]:
            logger.warning("%s", w)
        self.connector_scheduler: KVShimScheduler | None = None
        self.connector_worker: KVShimWorker | None = None
        # The first native call of this process: after vLLM's fork.
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVShimScheduler(native.Scheduler(open_cfg), cfg["kvshim.chunk_size"], conf["sync_load"])
            if kv_events.enabled(vllm_config):
                self.connector_scheduler.events = kv_events.EventSource(self.connector_scheduler.native, open_cfg["block_size"])
        else:
            self.connector_worker = KVShimWorker(native.Worker(open_cfg), vllm_config, kv_cache_config, cfg["kvshim.timeout_ms"],
                                                 conf["layerwise"], conf["by_request"], conf["sync_load"])
        # One line that says kvshim is active, and with what.
        logger.info("kvshim %s active: %s", native.version(), conf["summary"])

    @property
    def scheduler(self) -> KVShimScheduler:
        """The scheduler side; an error in a worker-role connector."""
        if self.connector_scheduler is None:
            raise RuntimeError(f"a scheduler-side call on a {self.role.name} connector")
        return self.connector_scheduler

    @property
    def worker(self) -> KVShimWorker:
        """The worker side; an error in a scheduler-role connector."""
        if self.connector_worker is None:
            raise RuntimeError(f"a worker-side call on a {self.role.name} connector")
        return self.connector_worker

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # A wish: vLLM drops it, with a warning, if a backend cannot use it.
        tc = vllm_config.kv_transfer_config
        return required_layout(dict(tc.kv_connector_extra_config or {}) if tc else {})

    # ---------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler.has_pending_block_frees()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: every KV-cache group's blocks (vLLM 0.33 calls this
        # instead of request_finished, scheduler.py _connector_finished).
        return self.scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Waits for the copies of preempted requests before vLLM reuses their blocks.
        self.worker.bind(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # No attention metadata: a step without a forward pass (kv_connector_no_forward).
        self.worker.start_load_kv(idle=getattr(forward_context, "attn_metadata", None) is None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Only kvshim.layerwise's loads wait here (per layer): asynchronous ones
        # were reported done, kvshim.sync_load's waited for in start_load_kv.
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Saves start in wait_for_save; with kvshim.layerwise per layer as written.
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self.worker.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # -------------------------------------------------------------------- both

    def get_kv_connector_stats(self) -> KVShimStats | None:
        if self.connector_scheduler is not None:
            return self.connector_scheduler.get_stats()
        return self.worker.get_stats()

    # ----------------------------------------------------------- vLLM's controls

    def take_events(self) -> Iterable[KVCacheEvent]:
        ev = self.scheduler.events
        return ev.take() if ev is not None else ()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        w = self.worker
        return kv_events.worker_meta(w.native) if w.events else None

    def reset_cache(self) -> bool | None:
        # Scheduler.reset_prefix_cache(reset_connector=True), POST /reset_prefix_cache.
        if self.connector_scheduler is None:
            return None
        return self.connector_scheduler.reset()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.hit_sources(request, num_external_tokens)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        # kvshim's stats in vLLM's own /metrics, labelled per engine (kvshim.prom).
        from kvshim.prom import KVShimPromMetrics

        return KVShimPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVShimStats:
        return KVShimStats(data=dict(data or {}))

    def shutdown(self) -> None:
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.shutdown()

