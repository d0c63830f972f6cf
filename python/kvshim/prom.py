"""kvshim's per-step stats in vLLM's own /metrics (build_prom_metrics).

vLLM's PrometheusStatLogger builds one KVConnectorPromMetrics per engine
process from the connector class and calls observe() with each step's
aggregated KVConnectorStats data (KVShimStats: the workers' counters and
latencies summed with the scheduler's hits). Counters are
``vllm:kvshim_<key>_total`` and the latency histograms
``vllm:kvshim_{load,save}_seconds``, labelled like vLLM's own metrics
(model_name, engine), as OffloadingConnector's OffloadPromMetrics does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# KVShimStats keys exported as counters, and what they count.
COUNTERS: dict[str, str] = {
    "hit_tokens": "Prompt tokens kvshim loaded instead of vLLM computing them.",
    "hit_requests": "Requests with a kvshim hit.",
    "loaded_chunks": "Chunks loaded from kvshim into the KV cache (every rank).",
    "loaded_bytes": "Bytes loaded from kvshim into the KV cache (every rank).",
    "failed_loads": "Chunks whose load failed (vLLM recomputes them).",
    "saved_chunks": "Chunks saved to kvshim (every rank).",
    "saved_bytes": "Bytes saved to kvshim (every rank).",
    "failed_saves": "Chunks whose save failed.",
    "skipped_chunks": "Chunks not saved: already stored, or no space.",
    "layerwise_loads": "Loads run layer by layer (kvshim.layerwise), one per request and step.",
    "layerwise_saves": "Saves run layer by layer (kvshim.layerwise), one per request and step.",
}

# KVShimStats keys holding job durations in seconds, exported as histograms.
HISTOGRAMS: dict[str, str] = {
    "load_seconds": "Duration of a kvshim load job (retrieve, checks, copies into the KV cache, release).",
    "save_seconds": "Duration of a kvshim save job (allocate, copies out of the KV cache, commit).",
}

# 100 µs ... 10 s: a chunk's host copy is ~0.1-1 ms, a slow L2 fill seconds.
BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class KVShimPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        self._counters = {
            key: per_engine(self._counter_cls(name=f"vllm:kvshim_{key}", documentation=doc, labelnames=labelnames))
            for key, doc in COUNTERS.items()
        }
        histogram: Any = self._histogram_cls  # prometheus_client's Histogram (or vLLM's Ray wrapper): takes buckets
        self._histograms = {
            key: per_engine(histogram(name=f"vllm:kvshim_{key}", documentation=doc, buckets=BUCKETS, labelnames=labelnames))
            for key, doc in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per in self._counters.items():
            v = transfer_stats_data.get(key)
            if v:
                per[engine_idx].inc(v)
        for key, per in self._histograms.items():
            for x in transfer_stats_data.get(key) or ():
                per[engine_idx].observe(x)
