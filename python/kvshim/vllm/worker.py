"""The worker side of the connector (one per rank): vLLM's KV tensors, step
metadata and stream as the native worker's arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvshim import events as kv_events
from kvshim import native
from kvshim.vllm.config import logger
from kvshim.vllm.stats import KVShimMetadata, KVShimStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _tensor_desc(name: str, t: torch.Tensor, group: int) -> dict[str, Any]:
    """How a KV tensor lies in memory, read from the tensor itself."""
    shape, esize = list(t.shape), t.element_size()
    if len(shape) == 4:
        backend = "paged"  # vLLM >= 0.33: (blocks, heads, block_size, K|V content), any stride order
    elif len(shape) == 3:
        backend = "mla"
    elif len(shape) == 5 and shape[0] == 2:
        backend = "flash_attn"
    elif len(shape) == 5 and shape[1] == 2:
        backend = "flashinfer"
    else:
        raise ValueError(f"KV tensor {name}: unsupported shape {shape} (want vLLM 0.33's (blocks, heads, block_size, content) "
                         "view, FlashAttention, FlashInfer or MLA)")
    device = str(t.device)
    if device == "cuda":
        device = f"cuda:{t.device.index or 0}"
    storage = t.untyped_storage()
    return {
        "layer": name,
        "group": group,
        "backend": backend,
        "device": device,
        "data_ptr": t.data_ptr(),
        "dtype_size": esize,
        "shape": shape,
        "stride_bytes": [s * esize for s in t.stride()],
        "storage_ptr": storage.data_ptr(),
        "storage_bytes": storage.nbytes(),
    }


def _kernel_split_desc(name: str, t: torch.Tensor, block_size: int, group: int) -> dict[str, Any]:
    """The descriptor of a (blocks, heads, kernel block, content) view whose
    blocks vLLM split into kernel blocks (v1/worker/utils.py
    prepare_kernel_block_sizes and allocate_kv_cache: dim 0 counts kernel
    blocks, k of them per block, in order), in the whole blocks the
    scheduler's block ids index. When a kernel block's tokens continue where
    the previous one's end (token-major per-layer pages: LBNHC), the same
    memory is a (blocks, heads, block_size, content) view: one run of tokens
    a block. Otherwise (heads outside the tokens: LBHNC, ...) a
    kernel_blocks dimension says that a block is k kernel blocks
    (layout.DimKernelBlocks)."""
    kbs = t.shape[2]
    if block_size % kbs or t.shape[0] % (block_size // kbs):
        raise ValueError(f"KV tensor {name}: kernel blocks of {kbs} tokens do not divide vLLM's {block_size}-token blocks")
    k = block_size // kbs
    s0, s1, s2, s3 = t.stride()
    if s0 == kbs * s2:
        return _tensor_desc(name, t.as_strided((t.shape[0] // k, t.shape[1], block_size, t.shape[3]), (k * s0, s1, s2, s3)), group)
    d = _tensor_desc(name, t, group)
    esize = t.element_size()
    d["shape"] = [t.shape[0] // k, k, t.shape[1], kbs, t.shape[3]]
    d["stride_bytes"] = [x * esize for x in (k * s0, s0, s1, s2, s3)]
    d["dims"] = ["blocks", "kernel_blocks", "heads", "block_size", "head"]
    return d


def _state_desc(name: str, t: torch.Tensor, block_size: int, group: int) -> dict[str, Any]:
    """The descriptor of a Mamba/SSM layer's page view: vLLM 0.33 views it
    as (blocks, num_heads, states, state bytes) int8 (kv_cache_interface.py
    create_kv_cache_views and compute_layer_kv_cache_shape_bytes: one state
    a block, page_size_padded left outside the view). The block still
    stands for block_size tokens of the block table (layout.TensorDesc
    BlockTokens): kvshim copies the whole state."""
    if t.dim() != 4 or t.shape[2] != 1:
        raise ValueError(f"Mamba state tensor {name}: shape {list(t.shape)}, want vLLM 0.33's (blocks, heads, 1, state bytes) view")
    return _tensor_desc(name, t, group) | {"block_tokens": block_size}



class KVShimWorker:
    """The worker side of the connector (one per rank): vLLM's KV tensors,
    step metadata and stream as the native worker's arguments."""

    def __init__(self, worker: native.Worker, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                 timeout_ms: int, layerwise: bool = False, by_request: bool = False) -> None:
        self.native = worker
        self._layerwise = layerwise
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._timeout_ms = timeout_ms
        self._bound: KVShimMetadata | None = None
        self._cpu_caches = False  # every KV tensor on the CPU: no stream event (_stream_event)
        self._load_errors: set[int] = set()
        # Several KV-cache groups: block ids are unique only within a group,
        # and vLLM raises on invalid_block_ids (Scheduler._handle_invalid_blocks);
        # a lone windowed or Mamba group cannot recompute from a failed block
        # (the window before it, or the state, is gone). A failed load is
        # reported by request (failed_recving) instead: vLLM recomputes it all.
        self._by_request = by_request  # Go: the namespace names the groups
        self._failed: set[str] = set()
        self._reported: dict[str, int] = {}  # counters already in a stats report
        self.events: bool = kv_events.enabled(vllm_config)  # --kv-events-config: report saves
        if self.events:
            worker.take_save_reports()  # Go records from now on

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group_of: dict[str, int] = {}
        block_of: dict[str, int | None] = {}
        state_layers: set[str] = set()
        if self._kv_cache_config is not None:
            from vllm.v1.kv_cache_interface import MambaSpec

            for i, grp in enumerate(self._kv_cache_config.kv_cache_groups):
                group_of |= dict.fromkeys(grp.layer_names, i)
                block_of |= dict.fromkeys(grp.layer_names, getattr(grp.kv_cache_spec, "block_size", None))
                if isinstance(grp.kv_cache_spec, MambaSpec):
                    state_layers.update(grp.layer_names)
        descs: list[dict[str, Any]] = []
        seen: set[tuple[int | None, int]] = set()
        # Layers of a group first: with several KV-cache groups, the i-th
        # layers of all groups view one tensor (vLLM's hybrid allocator),
        # and each group copies its blocks through its own layers. A layer
        # in no group reads another's KV (KV sharing): copied once, with it.
        for name, t in sorted(kv_caches.items(), key=lambda kv: kv[0] not in group_of):
            g = group_of.get(name)
            if (g, t.data_ptr()) in seen or (g is None and any(p == t.data_ptr() for _, p in seen)):
                continue  # layers that share one KV tensor (KV sharing) are copied once
            seen.add((g, t.data_ptr()))
            block_size = block_of.get(name) or self._vllm_config.cache_config.block_size
            if name in state_layers:
                descs.append(_state_desc(name, t, block_size, g or 0))
            elif t.dim() == 4 and t.shape[2] != block_size:
                descs.append(_kernel_split_desc(name, t, block_size, g or 0))
            else:
                descs.append(_tensor_desc(name, t, g or 0))
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
        if self._layerwise:
            self.native.start_loads_layered()
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
        """Layer-wise: the step's loads ended, their failures reported
        (before the step's output, which reads them)."""
        if self._layerwise and not self.native.wait_layers(self._timeout_ms):
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
        if self._cpu_caches:
            return None
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
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
        """The counters since the last report, as metric names."""
        # Populate* describe the start-up's L1 mapping (a gauge among them),
        # not a step's work: not reported as vLLM's per-step counters.
        now = {k: v for k, v in self.native.stats().counters.items() if not k.startswith("Populate")}
        delta: dict[str, Any] = {_snake(k): v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        lat = self.native.take_latencies()  # job durations for vLLM's /metrics (kvshim.prom)
        for kind in ("load", "save"):
            if lat.get(kind):
                delta[f"{kind}_seconds"] = lat[kind]
        st = KVShimStats(data=delta)
        return None if st.is_empty() else st

    def stats(self) -> native.WorkerStats:
        return self.native.stats()

    def shutdown(self) -> None:
        self.native.close()


def _snake(name: str) -> str:
    """Go's field names (SavedChunks) as metric names (saved_chunks)."""
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))

