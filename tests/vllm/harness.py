"""Drive vLLM's real v1 Scheduler and a KV connector on a machine without a GPU.

Nothing of vLLM is replaced: the VllmConfig is built from a local directory that
holds only a tiny Llama ``config.json`` (no Hugging Face download, no tokenizer),
the connector is created by vLLM's own ``KVConnectorFactory`` (inside
``Scheduler.__init__`` for the SCHEDULER role; directly for the WORKER role),
requests are real ``vllm.v1.request.Request`` objects with vLLM's block hasher,
and each step runs ``schedule()`` (which calls ``build_connector_meta``) and
``update_from_output()``. Only the model is absent: the model-runner output
carries one fake sampled token per request that finished its prefill.

The recipe follows vLLM's own unit-test helpers in
tests/v1/kv_connector/unit/utils.py of the vllm-project/vllm repository
(create_vllm_config, create_scheduler, create_request,
create_model_runner_output); this is a rewrite for kvshim's needs: no hub
download, connectors loaded by module path, an optional worker-role connector
driven in the order of vllm/v1/worker/kv_connector_model_runner_mixin.py, and
leak checks.

Typical use::

    cfg = make_vllm_config(model_dir, kv_connector="KVShimConnector",
                           kv_connector_module_path="kvshim.vllm")
    h = SchedulerHarness(cfg, num_blocks=256, with_worker=True)
    req = h.add_request(h.make_request(list(range(100)), max_tokens=4))
    h.run_until_idle()
    h.assert_no_leaks()
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

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


def write_tiny_model_dir(path: str | os.PathLike) -> Path:
    """Write the tiny Llama config.json into ``path``; return the directory."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=1))
    return d


def layer_names(num_layers: int = NUM_LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_vllm_config(
    model_dir: str | os.PathLike,
    *,
    kv_connector: str = "KVShimConnector",
    kv_connector_module_path: str | None = "kvshim.vllm",
    kv_role: str = "kv_both",
    kv_connector_extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "recompute",
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    disable_hybrid_kv_cache_manager: bool | None = None,
    async_scheduling: bool | None = None,
) -> VllmConfig:
    """A real VllmConfig for a CPU-only machine (no hub access, no tokenizer).

    ``async_scheduling=None`` lets vLLM decide, as in production: with the
    "uni" executor it turns it on, so the harness gets vLLM's AsyncScheduler
    (max_concurrent_batches == 2); ``False`` gives the plain Scheduler."""
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
    )
    return VllmConfig(
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


@dataclass
class StepResult:
    scheduler_output: SchedulerOutput
    model_runner_output: ModelRunnerOutput
    # client index -> EngineCoreOutputs, as returned by update_from_output.
    engine_core_outputs: dict[int, Any]
    kv_connector_output: KVConnectorOutput | None = None
    finished: dict[str, Any] = field(default_factory=dict)  # req_id -> reason

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return self.scheduler_output.num_scheduled_tokens

    @property
    def connector_meta(self) -> Any:
        return self.scheduler_output.kv_connector_metadata


class SchedulerHarness:
    """vLLM's real Scheduler (+ optionally a WORKER-role connector), no GPU.

    Attributes: ``scheduler`` (vllm.v1.core.sched.scheduler.Scheduler),
    ``connector`` (the SCHEDULER-role connector the Scheduler built through
    KVConnectorFactory), ``worker_connector`` (WORKER role, or None),
    ``vllm_config``, ``kv_cache_config``, ``requests`` (req_id -> Request),
    ``outputs`` (req_id -> list of sampled token ids), ``steps``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        num_blocks: int = 256,
        with_worker: bool = False,
        log_stats: bool = True,
    ) -> None:
        cache_config = vllm_config.cache_config
        if kv_cache_config is None:
            kv_cache_config = make_kv_cache_config(num_blocks, cache_config.block_size)
        # The engine core sets these before it builds the scheduler
        # (EngineCore._initialize_kv_caches and resolve_kv_cache_layout).
        cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        if cache_config.kv_cache_layout is None:
            cache_config.kv_cache_layout = "LBNHC"
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config

        # Same construction as EngineCore.__init__ (vllm/v1/engine/core.py).
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config
        )
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(
            hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens
        )
        scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            log_stats=log_stats,
        )
        self.connector: KVConnectorBase_V1 | None = self.scheduler.connector
        self.worker_connector: KVConnectorBase_V1 | None = None
        if with_worker:
            self.worker_connector = KVConnectorFactory.create_connector(
                vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.steps: list[StepResult] = []
        self._next_id = 0

    # ---- requests ---------------------------------------------------------

    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int = 8,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
        mm_features: list[Any] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Request:
        """A real Request hashed with the engine's block hasher."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            mm_features=mm_features,
            lora_request=lora_request,
            cache_salt=cache_salt,
            block_hasher=self._block_hasher,
        )
        req.kv_transfer_params = kv_transfer_params
        return req

    def add_request(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request
        self.outputs.setdefault(request.request_id, [])
        return request

    def abort(self, *req_ids: str) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    # ---- one engine step --------------------------------------------------

    def worker_step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """Run the worker-role connector in the model runner's order
        (vllm/v1/worker/kv_connector_model_runner_mixin.py,
        _get_kv_connector_output) around an absent forward pass."""
        wc = self.worker_connector
        assert wc is not None, "SchedulerHarness(with_worker=True) needed"
        out = KVConnectorOutput()
        meta = scheduler_output.kv_connector_metadata
        assert meta is not None
        with set_forward_context(None, self.vllm_config):
            wc.handle_preemptions(meta)  # model runner v2 calls this first
            wc.bind_connector_metadata(meta)
            sync = scheduler_output.has_sync_kv_loads
            if sync:
                wc.start_load_kv(get_forward_context())
            # (forward pass: attention layers would call wait_for_layer_load
            # and save_kv_layer here)
            if not sync:
                wc.start_load_kv(get_forward_context())
            wc.wait_for_save()
            results = wc.get_transfer_results(scheduler_output.finished_req_ids)
            out.finished_sending = results.finished_sending
            out.finished_recving = results.finished_recving
            out.failed_recving = results.failed_recving
            out.invalid_block_ids = wc.get_block_ids_with_load_errors()
            out.kv_connector_stats = wc.get_kv_connector_stats()
            out.kv_cache_events = wc.get_kv_connector_kv_cache_events()
            out.kv_connector_worker_meta = wc.build_connector_worker_meta()
            wc.clear_connector_metadata()
        return out

    def model_runner_output(
        self,
        scheduler_output: SchedulerOutput,
        *,
        sampled_token: int = 7,
        eos_req_ids: Iterable[str] = (),
        kv_connector_output: KVConnectorOutput | None = None,
    ) -> ModelRunnerOutput:
        """Fake model output: one token per scheduled request whose prefill is
        complete (a non-final prefill chunk samples nothing, as on a GPU)."""
        eos = set(eos_req_ids)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = self.scheduler.requests.get(rid)
            if req is not None and req.is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([EOS_TOKEN_ID if rid in eos else sampled_token])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_connector_output,
        )

    def execute(
        self,
        scheduler_output: SchedulerOutput,
        *,
        sampled_token: int = 7,
        eos_req_ids: Iterable[str] = (),
        finished_sending: set[str] | None = None,
        finished_recving: set[str] | None = None,
        invalid_block_ids: set[int] | None = None,
        worker_meta: KVConnectorWorkerMetadata | None = None,
    ) -> ModelRunnerOutput:
        """What the executor does with one SchedulerOutput: the worker
        connector (if any), then a fake model output. The keyword KV fields
        are merged into the connector output, so a test without a worker
        connector can play the worker's part."""
        kvo = (
            self.worker_step(scheduler_output)
            if self.worker_connector is not None
            else None
        )
        extra = (finished_sending, finished_recving, invalid_block_ids, worker_meta)
        if any(x is not None for x in extra):
            kvo = kvo or KVConnectorOutput()
            kvo.finished_sending = set(kvo.finished_sending or ()) | set(
                finished_sending or ()
            )
            kvo.finished_recving = set(kvo.finished_recving or ()) | set(
                finished_recving or ()
            )
            kvo.invalid_block_ids = set(kvo.invalid_block_ids) | set(
                invalid_block_ids or ()
            )
            if worker_meta is not None:
                kvo.kv_connector_worker_meta = (
                    worker_meta
                    if kvo.kv_connector_worker_meta is None
                    else kvo.kv_connector_worker_meta.aggregate(worker_meta)
                )
        return self.model_runner_output(
            scheduler_output,
            sampled_token=sampled_token,
            eos_req_ids=eos_req_ids,
            kv_connector_output=kvo,
        )

    def finish(
        self, scheduler_output: SchedulerOutput, mro: ModelRunnerOutput
    ) -> StepResult:
        """update_from_output() and bookkeeping of sampled tokens."""
        eco = self.scheduler.update_from_output(scheduler_output, mro)
        result = StepResult(scheduler_output, mro, eco, mro.kv_connector_output)
        for client_outputs in eco.values():
            for o in client_outputs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    result.finished[o.request_id] = o.finish_reason
        self.steps.append(result)
        return result

    def step(self, **execute_kwargs: Any) -> StepResult:
        """One serial engine step (EngineCore.step): schedule() -> execute ->
        update_from_output()."""
        so = self.scheduler.schedule()
        return self.finish(so, self.execute(so, **execute_kwargs))

    def run_until_idle(
        self, max_steps: int = 200, *, pipelined: bool = False, **execute_kwargs: Any
    ) -> list[StepResult]:
        """Step until the scheduler has no requests left (including finished
        ones whose blocks a connector still holds); raise after ``max_steps``
        update_from_output calls.

        ``pipelined=True`` overlaps steps like EngineCore.step_with_batch_queue
        (used when max_concurrent_batches > 1, e.g. async scheduling): batch
        N+1 is scheduled and executed before update_from_output of batch N."""
        results: list[StepResult] = []
        depth = self.vllm_config.max_concurrent_batches if pipelined else 1
        queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        while len(results) < max_steps:
            if self.scheduler.has_requests():
                so = self.scheduler.schedule()
                queue.appendleft((so, self.execute(so, **execute_kwargs)))
                if len(queue) < depth and (
                    so.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()
                ):
                    continue
            elif not queue:
                return results
            so, mro = queue.pop()
            results.append(self.finish(so, mro))
        raise AssertionError(
            f"scheduler not idle after {max_steps} steps: "
            f"{ {r: q.status.name for r, q in self.scheduler.requests.items()} }"
        )

    # ---- checks ------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def assert_no_leaks(self) -> None:
        """Every request gone and every KV block back in the pool (block 0 is
        vLLM's reserved null block)."""
        s = self.scheduler
        assert not s.requests, f"requests left: {list(s.requests)}"
        assert len(s.waiting) == 0 and len(s.running) == 0
        assert not s.finished_recving_kv_req_ids
        pool = s.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
