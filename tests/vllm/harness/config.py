"""The tiny model, vLLM configs and KV-cache configs (one group, hybrid) the tests run on."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

EOS_TOKEN_ID = 2
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16

# A tiny Llama: enough for ModelConfig (architecture, sizes, max length).
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": NUM_KV_HEADS * 2 * HEAD_SIZE,
    "intermediate_size": 128,
    "num_attention_heads": NUM_KV_HEADS * 2,
    "num_key_value_heads": NUM_KV_HEADS,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float16",
}


def write_tiny_model_dir(path: str | os.PathLike[str]) -> Path:
    """Write the tiny Llama config.json into ``path``; return the directory."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=1))
    return d


def layer_names(num_layers: int = NUM_LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_vllm_config(
    model_dir: str | os.PathLike[str],
    *,
    kv_connector: str = "KVShimConnector",
    kv_connector_module_path: str | None = "kvshim.vllm",
    kv_role: Literal["kv_producer", "kv_both", "kv_consumer"] = "kv_both",
    kv_connector_extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute",
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    disable_hybrid_kv_cache_manager: bool | None = None,
    async_scheduling: bool | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    rank: int = 0,
    engine_id: str | None = None,
) -> VllmConfig:
    """A real VllmConfig for a CPU-only machine (no hub access, no tokenizer).

    ``async_scheduling=None`` lets vLLM decide, as in production: with the
    "uni" executor it turns it on, so the harness gets vLLM's AsyncScheduler
    (max_concurrent_batches == 2); ``False`` gives the plain Scheduler.

    ``tensor_parallel_size``/``pipeline_parallel_size``/
    ``decode_context_parallel_size``/``rank`` build the ParallelConfig of one
    rank (``rank`` is vLLM's global rank, pp_rank * TP + tp_rank; vLLM picks
    the "mp" executor for a world size > 1); ``engine_id`` fixes
    KVTransferConfig.engine_id (else vLLM makes a uuid4), so processes that
    build their own config agree on it as vLLM's broadcast makes them do."""
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float16",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector=kv_connector,
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        kv_connector_extra_config=dict(kv_connector_extra_config or {}),
        kv_load_failure_policy=kv_load_failure_policy,
        engine_id=engine_id or None,  # None: vLLM makes a uuid4
    )
    return VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            decode_context_parallel_size=decode_context_parallel_size,
            rank=rank,
        ),
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


def make_kv_cache_config(
    num_blocks: int = 256,
    block_size: int = 16,
    *,
    num_layers: int = NUM_LAYERS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_size: int = HEAD_SIZE,
    dtype: torch.dtype = torch.float16,
) -> KVCacheConfig:
    """One full-attention KV-cache group holding every layer (no tensors:
    the scheduler needs none)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names(num_layers),
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=num_kv_heads,
                    head_size=head_size,
                    dtype=dtype,
                ),
            )
        ],
    )


def resolve_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """The KV cache layout, resolved as the engine core does before it builds
    the scheduler (v1/engine/core.py, resolve_kv_cache_layout): FlashAttention
    declares no layouts, so the candidates are vLLM's default preference, and
    a connector's wish (get_required_kvcache_layout) is taken when it is one
    of them. A layout already set on the cache config wins, as in vLLM."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    supported = [m.name for m in get_supported_kv_cache_layouts([])]
    resolve_kv_cache_layout(vllm_config, [supported], specs)


# ---- kvshim's connector config ----


CHUNK = 64  # kvshim.chunk_size in the connector tests: 4 blocks of 16 tokens


def kvshim_config(
    model_dir: str | os.PathLike[str], *, server: str = "embedded", timeout_ms: int = 2000, **kw: Any
) -> VllmConfig:
    """A VllmConfig selecting KVShimConnector with a small L1 and 64-token
    chunks; keyword arguments go to make_vllm_config."""
    extra = {
        "kvshim.server": server,
        "kvshim.chunk_size": CHUNK,
        "kvshim.l1_size_gb": 0.125,
        "kvshim.timeout_ms": timeout_ms,
    }
    extra.update(kw.pop("kv_connector_extra_config", None) or {})
    return make_vllm_config(model_dir, kv_connector_extra_config=extra, **kw)


# ---- hybrid models (several KV-cache groups): one rank's model runner ----------


# Per-layer attention kinds of hybrid models, (kind, window) a layer:
# Gemma-3 (5 sliding-window layers, then a global one; a 40-token window is
# smaller than a chunk) and Llama-4 (chunked local attention, every fourth
# layer global).
GEMMA3_LAYERS: list[tuple[str, int]] = [("sliding_window", 40)] * 5 + [("full", 0)]
LLAMA4_LAYERS: list[tuple[str, int]] = [("chunked_local", 2 * 64)] * 3 + [("full", 0)]


def hybrid_layer_specs(kinds: Sequence[tuple[str, int]], num_kv_heads: int = NUM_KV_HEADS,
                       block_size: int = 16) -> dict[str, AttentionSpec]:
    """vLLM's per-layer KV-cache specs for layers of the given (kind,
    window) kinds: "full", "sliding_window" (window tokens) or
    "chunked_local" (attention chunks of window tokens)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    kw: dict[str, Any] = {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_size": HEAD_SIZE,
                          "dtype": torch.float16}
    specs: dict[str, AttentionSpec] = {}
    for name, (kind, window) in zip(layer_names(len(kinds)), kinds):
        if kind == "full":
            specs[name] = FullAttentionSpec(**kw)
        elif kind == "sliding_window":
            specs[name] = SlidingWindowSpec(sliding_window=window, **kw)
        else:
            assert kind == "chunked_local", kind
            specs[name] = ChunkedLocalAttentionSpec(attention_chunk_size=window, **kw)
    return specs


def skipped_tokens(spec: Any, n: int) -> int:
    """The leading tokens a KV-cache group no longer needs once n tokens are
    computed (vLLM's get_num_skipped_tokens of its manager; a hit of n
    tokens gets null blocks there)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec):
        return max(0, n - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return n // spec.attention_chunk_size * spec.attention_chunk_size
    return 0


def hybrid_kv_cache_config(vllm_config: VllmConfig, specs: dict[str, Any], num_blocks: int,
                           layout: str = "LBNHC") -> KVCacheConfig:
    """Turns vLLM's hybrid KV-cache manager on (this machine's platform turns
    it off: tests/vllm/NOTES.md, "Hybrid models") and returns vLLM's own
    KVCacheConfig for the per-layer specs: groups by get_kv_cache_groups,
    tensors by get_kv_cache_config_from_groups, num_blocks blocks."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on a GPU platform
    vllm_config.cache_config.kv_cache_layout = layout
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    assert len(groups) > 1, groups
    kvc = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 40)
    assert kvc.num_blocks == num_blocks
    return kvc
