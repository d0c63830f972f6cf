"""The worker side of the connector (one per rank): vLLM's KV tensors, step
metadata and stream as the native worker's arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvshim import events as kv_events
from kvshim import native
from kvshim.vllm.config import kv_groups, logger
from kvshim.vllm.stats import KVShimMetadata, KVShimStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _raw(name: str, t: torch.Tensor) -> dict[str, Any]:
    """A KV tensor's facts as torch reports them; how it lies in memory is
    decided from them in Go (kvshim_vllm_tensors, shim/vllmtensors.go)."""
    storage = t.untyped_storage()
    return {"layer": name, "device": str(t.device), "data_ptr": t.data_ptr(), "dtype_size": t.element_size(),
            "shape": list(t.shape), "strides": list(t.stride()), "storage_ptr": storage.data_ptr(),
            "storage_bytes": storage.nbytes()}


class KVShimWorker:
    """The worker side of the connector (one per rank): vLLM's KV tensors,
    step metadata and stream as the native worker's arguments."""

    def __init__(self, worker: native.Worker, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                 timeout_ms: int, layerwise: bool = False, by_request: bool = False, sync_load: bool = False) -> None:
        self.native = worker
        self._layerwise = layerwise
        self._sync = sync_load  # loads in the step that computes them (layer-wise ones too)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._timeout_ms = timeout_ms
        self._bound: KVShimMetadata | None = None
        self._cpu_caches = False  # every KV tensor on the CPU: no stream event (_stream_event)
        self._load_errors: set[int] = set()
        # Go decides it (several KV-cache groups, whose block ids are unique
        # only within a group, or a windowed or Mamba one that cannot recompute
        # from a failed block): a failed load is reported by request
        # (failed_recving), and vLLM recomputes it all.
        self._by_request = by_request
        self._failed: set[str] = set()
        self.events: bool = kv_events.enabled(vllm_config)  # --kv-events-config: report saves
        if self.events:
            worker.take_save_reports()  # Go records from now on

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Go decides each layer's group, which layers sharing a tensor are
        # registered, the backend, kernel-block and Mamba state views.
        descs = native.vllm_tensors({"block_size": self._vllm_config.cache_config.block_size,
                                     "groups": kv_groups(self._kv_cache_config),
                                     "tensors": [_raw(name, t) for name, t in kv_caches.items()]})
        self.native.register(descs)
        self._cpu_caches = all(t.device.type == "cpu" for t in kv_caches.values())

    def bind(self, meta: KVConnectorMetadata) -> None:
        """Binds a step's metadata once (handle_preemptions and
        bind_connector_metadata both pass it)."""
        if meta is self._bound or not isinstance(meta, KVShimMetadata):
            return
        self.native.bind(meta.data, self._timeout_ms)
        self._bound = meta

    def clear(self) -> None:
        self._bound = None

    def start_load_kv(self, idle: bool = False) -> None:
        if self._bound is None:
            return
        if self._sync:
            # In layer order; each layer waits for its own (kvshim.layerwise) or
            # all before the forward pass, which then has the CPU to itself.
            self.native.start_loads_layered()
            if not self._layerwise:
                self._wait_layers()
        else:
            # No forward pass this step (vLLM's no-forward step): its loads are waited for
            # briefly, so this step reports them and vLLM computes the request in the next
            # step, not after one more empty step and its 1 ms sleep (docs/e2e.md).
            self.native.start_loads(wait_ms=min(self._timeout_ms, 20) if idle else 0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: returns once this layer's copies of the step ended."""
        if self._layerwise and self._bound is not None and not self.native.wait_layer(layer_name, self._timeout_ms):
            logger.warning("kvshim: layer %s not loaded after %d ms; its blocks are load errors", layer_name,
                           self._timeout_ms)

    def _wait_layers(self) -> None:
        """Synchronous loads: ended, failures reported (before the step's output)."""
        if self._sync and not self.native.wait_layers(self._timeout_ms):
            logger.warning("kvshim: the step's layer-wise loads still run after %d ms", self._timeout_ms)

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer-wise: this layer of the bound step is written; its save
        starts now (wait_for_save's start_saves ends the step)."""
        if self._bound is None or not self._layerwise:
            return
        ev = self._stream_event()
        self.native.save_layer(layer_name, int(ev.cuda_event) if ev is not None else 0)

    def wait_for_save(self) -> None:
        if self._bound is None:
            return
        # The event only has to live through the call: the library enqueues
        # the save stream's wait on it before returning.
        ev = self._stream_event()
        self.native.start_saves(int(ev.cuda_event) if ev is not None else 0)

    def _stream_event(self) -> Any:
        """A torch.cuda.Event recorded on vLLM's current stream after the
        forward pass, for the save stream to wait on; None when the KV cache
        is on the CPU (the forward pass is done). Known at registration: in
        vLLM's CPU worker torch.cuda.is_available() took ~0.45 ms a step."""
        import torch

        if self._cpu_caches or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._wait_layers()
        done = self.native.poll()
        if self._by_request:
            self._failed.update(done.failed)
        else:
            self._load_errors.update(done.error_blocks)
        return set(done.sending) or None, set(done.recving) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def take_failed_recving(self) -> set[str]:
        """Requests whose loads failed since the last call (several KV-cache
        groups only; reported with or before their finished_recving)."""
        failed, self._failed = self._failed, set()
        return failed

    def get_stats(self) -> KVShimStats | None:
        """The counters since the last report, and the job durations for
        vLLM's /metrics (kvshim.prom), by metric name."""
        st = KVShimStats(data=self.native.take_step_stats())
        return None if st.is_empty() else st

    def stats(self) -> native.WorkerStats:
        return self.native.stats()

    def shutdown(self) -> None:
        self.native.close()

