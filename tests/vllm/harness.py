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

KV bytes without a GPU: ``ModelRunner`` plays one rank's GPU model runner.
Its KV cache is made by vLLM's own ``allocate_kv_cache`` on the CPU
(standing in for GPU memory): one buffer viewed as ``(num_blocks, kv_heads,
block_size, K|V)`` per layer in the resolved ``KVCacheLayout``, exactly what
vLLM 0.33's GPU model runner registers with a WORKER-role connector through
``register_kv_caches``. Its "forward pass" writes, for every scheduled token,
KV bytes that are a deterministic function of the token prefix up to it
(``KVModel``), so a restored block can be checked byte for byte. Pass
``SchedulerHarness(..., runners=[ModelRunner(...), ...])``; with more than one
runner (TP) their outputs are combined by vLLM's own KVOutputAggregator.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvshim.native import meta_json
from kvshim.vllm import KVShimConnector, KVShimMetadata

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


def collect_worker_output(wc: KVConnectorBase_V1, finished_req_ids: set[str], out: KVConnectorOutput) -> None:
    """The end of a worker step, in the model runner's order: transfer
    results, load errors, stats, events, worker metadata, then clear."""
    results = wc.get_transfer_results(finished_req_ids)
    out.finished_sending = results.finished_sending
    out.finished_recving = results.finished_recving
    out.failed_recving = results.failed_recving
    out.invalid_block_ids = wc.get_block_ids_with_load_errors()
    out.kv_connector_stats = wc.get_kv_connector_stats()
    out.kv_cache_events = wc.get_kv_connector_kv_cache_events()
    out.kv_connector_worker_meta = wc.build_connector_worker_meta()
    wc.clear_connector_metadata()


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
        runners: Sequence[Any] | None = None,
        log_stats: bool = True,
    ) -> None:
        cache_config = vllm_config.cache_config
        if kv_cache_config is None:
            kv_cache_config = make_kv_cache_config(num_blocks, cache_config.block_size)
        # The engine core sets these before it builds the scheduler
        # (EngineCore._initialize_kv_caches and resolve_kv_cache_layout).
        cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        resolve_layout(vllm_config, kv_cache_config)
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
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            log_stats=log_stats,
        )
        # Scheduler or AsyncScheduler: the harness reads their state
        # (requests, queues, the block pool) that SchedulerInterface leaves out.
        assert isinstance(scheduler, Scheduler), scheduler_cls
        self.scheduler = scheduler
        self.connector: KVConnectorBase_V1 | None = self.scheduler.connector
        self.worker_connector: KVConnectorBase_V1 | None = None
        if with_worker:
            self.worker_connector = KVConnectorFactory.create_connector(
                vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
        self._worker = None if self.worker_connector is None else ConnectorStepDriver(vllm_config, self.worker_connector)
        # Model runners with KV tensors (ModelRunner, or anything with
        # execute(scheduler_output) -> KVConnectorOutput, e.g. a proxy of a
        # runner in another process). They replace worker_connector.
        self.runners: list[Any] = list(runners or ())
        self._aggregator: KVOutputAggregator | None = None
        if len(self.runners) > 1:
            self._aggregator = KVOutputAggregator(len(self.runners))
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
        assert self._worker is not None, "SchedulerHarness(with_worker=True) needed"
        return self._worker.execute(scheduler_output)

    def runners_step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """Every runner executes the step; with TP their connector outputs
        are combined as vLLM's executor does (KVOutputAggregator: a request
        is finished only when every rank reported it)."""
        outs: list[KVConnectorOutput] = [r.execute(scheduler_output) for r in self.runners]
        if self._aggregator is None:
            return outs[0]
        mros: list[ModelRunnerOutput | None] = [
            self.model_runner_output(scheduler_output, kv_connector_output=o)
            for o in outs
        ]
        agg = self._aggregator.aggregate(mros)
        assert agg is not None
        return agg.kv_connector_output or KVConnectorOutput()

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
        if self.runners:
            kvo = self.runners_step(scheduler_output)
        elif self.worker_connector is not None:
            kvo = self.worker_step(scheduler_output)
        else:
            kvo = None
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

    def close(self) -> None:
        """Shut the connectors down (runners first: the scheduler connector
        owns the embedded server)."""
        for r in self.runners:
            r.close()
        if self.worker_connector is not None:
            self.worker_connector.shutdown()
        if self.connector is not None:
            self.connector.shutdown()

    def settle(
        self,
        timeout_s: float = 10.0,
        *,
        until: Any = None,
        pipelined: bool = False,
        **execute_kwargs: Any,
    ) -> list[StepResult]:
        """Steps until the scheduler is idle, or until ``until(step)`` is
        true for a finished step (with ``pipelined`` the batch already in
        flight is finished too). Transfers complete on their own threads,
        so an engine with nothing to compute spins like EngineCore's busy
        loop: here with a 1 ms pause after every step that scheduled no
        token. ``pipelined=True`` overlaps steps as run_until_idle does
        (EngineCore.step_with_batch_queue). Raises after ``timeout_s``."""
        import time

        results: list[StepResult] = []
        depth = self.vllm_config.max_concurrent_batches if pipelined else 1
        queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        deadline = time.monotonic() + timeout_s
        done = False
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not settled after {timeout_s}s ({len(results)} steps): "
                    f"{ {r: q.status.name for r, q in self.scheduler.requests.items()} }"
                )
            if not done and (self.scheduler.has_requests() or until is not None):
                so = self.scheduler.schedule()
                queue.appendleft((so, self.execute(so, **execute_kwargs)))
                if so.total_num_scheduled_tokens == 0:
                    time.sleep(0.001)
                if len(queue) < depth:
                    continue
            elif not queue:
                return results
            so, mro = queue.pop()
            results.append(self.finish(so, mro))
            if until is not None and until(results[-1]):
                done = True

    # ---- checks ------------------------------------------------------------

    @property
    def kvshim(self) -> KVShimConnector:
        """The scheduler-role connector, checked to be kvshim's (for its own
        API: scheduler.stats())."""
        return as_kvshim(self.connector)

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


# ---- KV bytes: a deterministic "model" and one rank's model runner -------------

_MASK64 = (1 << 64) - 1


class KVModel:
    """What the "model" computes: the KV of token position p (every layer,
    K and V, every KV head) is a function of tokens[0..p] only — a running
    64-bit hash of the prefix mixed with per-(layer, K/V, head, dim, rank)
    constants — written as int16 bit patterns into the float16 cache (byte
    comparisons only, so NaN patterns do not matter)."""

    def __init__(
        self,
        num_layers: int = NUM_LAYERS,
        num_kv_heads: int = NUM_KV_HEADS,
        head_size: int = HEAD_SIZE,
        rank: int = 0,
    ) -> None:
        import numpy as np

        self.shape = (2, num_kv_heads, head_size)
        rng = np.random.default_rng(1000 + rank)  # each TP rank its own bytes
        n = 2 * num_kv_heads * head_size
        self._mult = [
            rng.integers(1, 1 << 62, n, dtype=np.uint64) | np.uint64(1)
            for _ in range(num_layers)
        ]

    @staticmethod
    def prefix_hashes(tokens: Sequence[int]) -> list[int]:
        h, out = 0x9E3779B97F4A7C15, []
        for t in tokens:
            h = ((h ^ (int(t) + 1)) * 0x100000001B3) & _MASK64
            h ^= h >> 29
            out.append(h)
        return out

    def kv(self, hashes: Sequence[int], layer: int) -> torch.Tensor:
        """int16 (2, len(hashes), kv_heads, head_size) for those positions."""
        import numpy as np

        H = np.asarray(hashes, dtype=np.uint64)[:, None]
        with np.errstate(over="ignore"):
            x = H * self._mult[layer][None, :]
            x ^= x >> np.uint64(31)
            x = x * np.uint64(0xBF58476D1CE4E5B9)
        v = (x >> np.uint64(48)).astype(np.uint16).view(np.int16)
        v = v.reshape(len(hashes), *self.shape).transpose(1, 0, 2, 3)
        return torch.from_numpy(np.ascontiguousarray(v))


@dataclass
class _RunnerReq:
    tokens: list[int]
    hashes: list[int]
    blocks: list[int]


@dataclass
class _HybridReq:
    tokens: list[int]
    hashes: list[int]
    blocks: list[list[int]]  # per KV-cache group (0: vLLM's null block)
    # (n, {group: wrong block indices}) when first scheduled with n tokens it
    # did not compute (test_hma's HybridRunner records it here)
    first_check: tuple[int, dict[int, list[int]]] | None = None


R = TypeVar("R", _RunnerReq, _HybridReq)


class WorkerStepDriver(Generic[R]):
    """The one worker-step driver: a WORKER-role connector driven in vLLM's
    model-runner order (vllm/v1/worker/kv_connector_model_runner_mixin.py
    and, for handle_preemptions, v1/worker/gpu/kv_connector.py):

        handle_preemptions -> bind_connector_metadata -> [start_load_kv if
        sync] -> forward (writes KV of the scheduled tokens) -> [start_load_kv
        if async] -> wait_for_save -> get_transfer_results ->
        get_block_ids_with_load_errors -> stats/events/worker meta ->
        clear_connector_metadata

    Subclasses say what a request's blocks are (_new_req, _add_blocks), what
    is checked before a loaded prefix is used (_check_prefix) and how the
    forward pass writes (_forward); _meta may edit the step's metadata and
    _wait_layers wait for each layer's load.
    ``skip_save_steps`` drops this rank's saves of those steps (no
    wait_for_save). Output tokens are ``sampled_token``."""

    vllm_config: VllmConfig
    connector: KVConnectorBase_V1
    kv_caches: dict[str, torch.Tensor]
    sampled_token: int = 7

    def _start(self, vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor] | None,
               connector: KVConnectorBase_V1) -> None:
        self.vllm_config = vllm_config
        self.kv_caches = kv_caches or {}
        self.connector = connector
        if kv_caches is not None:  # None: a connector without KV tensors (ConnectorStepDriver)
            connector.register_kv_caches(kv_caches)
        self.reqs: dict[str, R] = {}
        self.load_errors: list[set[int]] = []  # per step
        self.skip_save_steps: set[int] = set()  # steps whose saves this rank drops
        self.step_no = 0

    @property
    def kvshim(self) -> KVShimConnector:
        """The worker-role connector, checked to be kvshim's."""
        return as_kvshim(self.connector)

    def scribble(self) -> None:
        """Overwrite the whole cache (e.g. after a request was freed), so only
        a real load can bring the right bytes back."""
        for t in self.kv_caches.values():
            t.view(torch.int16).fill_(-21846)  # 0xAAAA

    # -- what differs between runners --
    def _new_req(self, tokens: list[int], block_ids: Sequence[Sequence[int]]) -> R:
        raise NotImplementedError

    def _add_blocks(self, r: R, new_block_ids: Sequence[Sequence[int]]) -> None:
        raise NotImplementedError

    def _check_prefix(self, rid: str, num_computed: int) -> None:
        raise NotImplementedError

    def _forward(self, work: list[tuple[str, int, int]]) -> None:
        raise NotImplementedError

    def _meta(self, meta: Any) -> Any:
        return meta

    def _wait_layers(self, wc: KVConnectorBase_V1) -> None:
        """After a synchronous start_load_kv: the forward pass's per-layer
        wait_for_layer_load (none by default; test_layerwise's runner waits
        for every layer)."""

    # -- one step --
    def _extend(self, r: R, end: int) -> None:
        """Decode: the tokens up to end are the previous sampled tokens."""
        if len(r.tokens) < end:
            r.tokens.extend([self.sampled_token] * (end - len(r.tokens)))
            r.hashes = KVModel.prefix_hashes(r.tokens)

    def _track(self, so: SchedulerOutput) -> list[tuple[str, int, int]]:
        """Update block tables; return (req, first token, n tokens) to compute."""
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self.reqs.pop(rid, None)
        work = []
        for nr in so.scheduled_new_reqs:
            # A request resumed after a preemption comes back as a new one
            # (vLLM's V2 model runner) with all its tokens, generated ones too.
            toks = list(nr.prefill_token_ids or nr.prompt_token_ids or [])
            self.reqs[nr.req_id] = self._new_req(toks, nr.block_ids)
            self._check_prefix(nr.req_id, nr.num_computed_tokens)
            work.append((nr.req_id, nr.num_computed_tokens, so.num_scheduled_tokens[nr.req_id]))
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            new = c.new_block_ids[i]
            r = self.reqs.get(rid)
            if r is None or rid in c.resumed_req_ids:
                toks = list(c.all_token_ids.get(rid) or (r.tokens if r else []))
                self.reqs[rid] = self._new_req(toks, new or ())
                self._check_prefix(rid, c.num_computed_tokens[i])
            elif new is not None:
                self._add_blocks(r, new)
            work.append((rid, c.num_computed_tokens[i], so.num_scheduled_tokens[rid]))
        return work

    def execute(self, so: SchedulerOutput) -> KVConnectorOutput:
        wc, out = self.connector, KVConnectorOutput()
        self.step_no += 1
        meta = self._meta(so.kv_connector_metadata)
        assert meta is not None
        with set_forward_context(None, self.vllm_config):
            wc.handle_preemptions(meta)
            wc.bind_connector_metadata(meta)
            sync = so.has_sync_kv_loads
            if sync:
                wc.start_load_kv(get_forward_context())
                self._wait_layers(wc)
            self._forward(self._track(so))
            if not sync:
                wc.start_load_kv(get_forward_context())
            if self.step_no not in self.skip_save_steps:
                wc.wait_for_save()
            collect_worker_output(wc, so.finished_req_ids, out)
        self.load_errors.append(set(out.invalid_block_ids))
        return out

    def close(self) -> None:
        self.connector.shutdown()


class ConnectorStepDriver(WorkerStepDriver[_RunnerReq]):
    """The step loop around an absent forward pass: a worker connector with
    no KV tensors (SchedulerHarness(with_worker=True)); the connector is the
    harness's, which shuts it down."""

    def __init__(self, vllm_config: VllmConfig, connector: KVConnectorBase_V1) -> None:
        self._start(vllm_config, None, connector)

    def _track(self, so: SchedulerOutput) -> list[tuple[str, int, int]]:
        return []

    def _forward(self, work: list[tuple[str, int, int]]) -> None:
        """(attention layers would call wait_for_layer_load and save_kv_layer here)"""


class ModelRunner(WorkerStepDriver[_RunnerReq]):
    """One rank's model runner without a GPU (one KV-cache group): CPU torch
    KV tensors standing in for GPU memory, registered with a WORKER-role
    KVShimConnector (made by vLLM's factory), driven by WorkerStepDriver."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        rank: int = 0,
        sampled_token: int = 7,
        connector: KVConnectorBase_V1 | None = None,
    ) -> None:
        self.rank = rank
        self.sampled_token = sampled_token
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        assert isinstance(spec, AttentionSpec), spec
        self.block_size = spec.block_size
        self.layer_names = list(group.layer_names)
        self.model = KVModel(len(self.layer_names), spec.num_kv_heads, spec.head_size, rank)
        # vLLM's own KV cache allocation, as its GPU model runner makes it
        # (v1/worker/utils.py allocate_kv_cache): one buffer and a (blocks,
        # heads, block_size, K|V) view per layer, strided as the resolved
        # KVCacheLayout says (FlashAttention declares none: LBNHC first).
        cache_config = vllm_config.cache_config
        resolve_layout(vllm_config, kv_cache_config)
        cache_config.num_gpu_blocks_override = kv_cache_config.num_blocks
        kv_cache_config = get_kv_cache_config_from_groups(vllm_config, kv_cache_config.kv_cache_groups, 1 << 40)
        self._start(
            vllm_config,
            allocate_kv_cache(kv_cache_config, torch.device("cpu"), cache_config.get_resolved_kv_cache_layout()),
            connector or KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config),
        )
        # req -> (num_computed_tokens, indices of wrong blocks) checked when
        # vLLM first schedules a request with a prefix it did not compute
        # in this step (loaded or a local prefix-cache hit), before the
        # forward pass: those blocks must already hold the model's bytes.
        self.prefix_checks: dict[str, tuple[int, list[int]]] = {}

    # -- KV access --
    def block_bytes(self, block_id: int) -> torch.Tensor:
        """int16 KV of one block, every layer: (layers, heads, block, K|V)."""
        return torch.stack([t.view(torch.int16)[block_id] for t in self.kv_caches.values()])

    @staticmethod
    def _content(kv: torch.Tensor) -> torch.Tensor:
        """The model's (2, tokens, heads, head) as the view's (tokens, heads,
        K|V) content: K then V of one token and head."""
        return kv.permute(1, 2, 0, 3).reshape(kv.shape[1], kv.shape[2], 2 * kv.shape[3])

    def expected_block(self, tokens: Sequence[int], block_index: int) -> torch.Tensor:
        bs = self.block_size
        hs = KVModel.prefix_hashes(tokens[: (block_index + 1) * bs])[block_index * bs :]
        assert len(hs) == bs, "block beyond the tokens"
        return torch.stack([self._content(self.model.kv(hs, i)).transpose(0, 1) for i in range(len(self.layer_names))])

    def check_blocks(self, tokens: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        """Indices i where block block_ids[i] does not hold what the model
        computes for block i of tokens (empty list: all equal)."""
        return [
            i for i, b in enumerate(block_ids)
            if not torch.equal(self.block_bytes(b), self.expected_block(tokens, i))
        ]

    # -- one step: group 0's blocks --
    def _new_req(self, tokens: list[int], block_ids: Sequence[Sequence[int]]) -> _RunnerReq:
        return _RunnerReq(tokens, KVModel.prefix_hashes(tokens), list(block_ids[0]) if block_ids else [])

    def _add_blocks(self, r: _RunnerReq, new_block_ids: Sequence[Sequence[int]]) -> None:
        r.blocks.extend(new_block_ids[0])

    def _check_prefix(self, rid: str, num_computed: int) -> None:
        n = num_computed // self.block_size
        if n:
            r = self.reqs[rid]
            self.prefix_checks[rid] = (num_computed, self.check_blocks(r.tokens, r.blocks[:n]))

    def _forward(self, work: list[tuple[str, int, int]]) -> None:
        bs = self.block_size
        for rid, start, n in work:
            r = self.reqs[rid]
            end = start + n
            self._extend(r, end)
            pos = torch.arange(start, end)
            blocks = torch.tensor(r.blocks, dtype=torch.long)[pos // bs]
            slots = pos % bs
            for i, name in enumerate(self.layer_names):
                kv = self._content(self.model.kv(r.hashes[start:end], i))
                self.kv_caches[name].view(torch.int16)[blocks, :, slots] = kv


# ---- kvshim helpers shared by the connector tests ------------------------------

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


def as_kvshim(connector: KVConnectorBase_V1 | None) -> KVShimConnector:
    assert isinstance(connector, KVShimConnector), connector
    return connector


def server_stats(connector: KVConnectorBase_V1 | None) -> dict[str, float]:
    """The server's counters through the scheduler connector (STATS)."""
    st = as_kvshim(connector).scheduler.stats()
    assert st.server is not None, st.server_error
    return st.server


def prompt(seed: int, n: int) -> list[int]:
    """n deterministic token ids (3..1000) for prompt number ``seed``."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, n)]


class ServerProcess:
    """A kvshim server in its own process: the library's ``kvshim serve``
    (kvshim_main) run by a fresh Python interpreter that loads
    libkvshim.so itself. ``kill()`` sends SIGKILL (no cleanup runs)."""

    def __init__(self, socket_path: str | os.PathLike[str], l1_size_gb: float = 0.125) -> None:
        self.socket = str(socket_path)
        self.l1_size_gb = l1_size_gb
        self.proc: Any = None

    def start(self, timeout_s: float = 30.0) -> ServerProcess:
        import subprocess
        import sys
        import time

        python_dir = str(Path(__file__).resolve().parents[2] / "python")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [python_dir, env.get("PYTHONPATH")]))
        code = (
            "import sys; from kvshim import native; "
            "sys.exit(native.run_main(['kvshim', 'serve', '--socket', sys.argv[1], "
            "'--l1-size-gb', sys.argv[2]]))"
        )
        self.log = Path(self.socket + ".log")
        with open(self.log, "w") as logf:  # a file, never a pipe that can fill
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, self.socket, str(self.l1_size_gb)],
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )
        # "kvshim serve: listening on ..." once the socket accepts.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if "listening on" in self.log.read_text():
                return self
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"kvshim serve did not start: {self.log.read_text()!r}")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def wait_stat(h: SchedulerHarness, name: str, want: float, timeout: float = 5.0) -> dict[str, float]:
    """Server counters move when asynchronous copies commit: poll them
    until ``name`` equals ``want``; return the server's counters."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = server_stats(h.connector)
        if st[name] == want or time.monotonic() > deadline:
            assert st[name] == want, (name, st[name], want)
            return st
        time.sleep(0.01)


def connector_output(step: StepResult) -> KVConnectorOutput:
    """The step's connector output (a step with a connector has one)."""
    assert step.kv_connector_output is not None, "no connector output"
    return step.kv_connector_output


def loads_of(step: StepResult | SchedulerOutput, req_id: str, kind: str = "loads") -> list[dict[str, Any]]:
    """The load specs (or with kind "saves", the save specs) kvshim put in
    this step's connector metadata (Go writes it in a binary form; meta_json
    gives its JSON text form: {"loads": [{"req", "start", "end", "hashes",
    "blocks", ...}], "saves": [...]})."""
    so = step.scheduler_output if isinstance(step, StepResult) else step
    assert isinstance(so.kv_connector_metadata, KVShimMetadata), so.kv_connector_metadata
    meta = meta_json(so.kv_connector_metadata.data)
    return [ld for ld in meta.get(kind, []) if ld["req"] == req_id]


def saves_of(h: SchedulerHarness, req_id: str) -> list[dict[str, Any]]:
    """Every save kvshim dispatched for req_id, in step order."""
    return [sv for s in h.steps for sv in loads_of(s, req_id, "saves")]


def assert_clean(h: SchedulerHarness) -> None:
    """No request, block, hold, staged object or lookup left anywhere."""
    h.assert_no_leaks()
    wait_jobs(h)
    st = server_stats(h.connector)
    assert st["kvshim_l1_holds"] == 0 and st["kvshim_lookups_live"] == 0, st
    staged = {k: v for k, v in st.items() if "stag" in k and not k.endswith("_total")}
    assert staged and not any(staged.values()), staged
    assert h.kvshim.scheduler.stats().requests == 0


def new_req_data(step: StepResult, req_id: str) -> Any:
    """The NewRequestData vLLM sent the workers for req_id in this step."""
    (nr,) = [n for n in step.scheduler_output.scheduled_new_reqs if n.req_id == req_id]
    return nr


def store(h: SchedulerHarness, r: ModelRunner, tokens: Sequence[int], **kw: Any) -> tuple[Request, list[int]]:
    """Run one request to completion (its full chunks get saved) and return
    the block ids it was computed in."""
    req = h.add_request(h.make_request(tokens, **kw))
    # (with an L2 the miss is answered after the L2 lookup: a pending step first)
    s = run_until_scheduled(h, req)
    assert s.num_scheduled_tokens[req.request_id] == len(tokens)
    blocks = list(r.reqs[req.request_id].blocks)
    h.settle()
    wait_jobs(h)
    return req, blocks


def wait_jobs(h: SchedulerHarness, timeout: float = 5.0) -> None:
    """vLLM gets a save's blocks back once the copy has read them; the
    COMMIT that makes the chunks visible to lookups follows. Wait until
    every worker has no job left (saves committed, loads reported)."""
    import time

    deadline = time.monotonic() + timeout
    for r in h.runners:
        conn = getattr(r, "connector", None)  # none in a proxy of a runner in another process
        if not isinstance(conn, KVShimConnector):
            continue
        while conn.worker.stats().jobs:
            assert time.monotonic() < deadline, f"worker jobs still running after {timeout}s"
            time.sleep(0.002)


def run_until_scheduled(h: SchedulerHarness, req: Request, timeout_s: float = 10.0, **kw: Any) -> StepResult:
    """Step until req is scheduled; return that step."""
    steps = h.settle(timeout_s, until=lambda s: req.request_id in s.num_scheduled_tokens, **kw)
    return next(s for s in steps if req.request_id in s.num_scheduled_tokens)


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


class HybridStepDriver(WorkerStepDriver[_HybridReq]):
    """WorkerStepDriver for several KV-cache groups: a request's blocks per
    group (HybridModelRunner, test_hma.py's HybridRunner)."""

    # -- one step: every group's blocks --
    def _new_req(self, tokens: list[int], block_ids: Sequence[Sequence[int]]) -> _HybridReq:
        return _HybridReq(tokens, KVModel.prefix_hashes(tokens), [list(b) for b in block_ids])

    def _add_blocks(self, r: _HybridReq, new_block_ids: Sequence[Sequence[int]]) -> None:
        for g, b in enumerate(new_block_ids):
            r.blocks[g].extend(b)


class HybridModelRunner(HybridStepDriver):
    """One rank's model runner for a hybrid model (several KV-cache groups),
    as ModelRunner is for one group: vLLM's allocate_kv_cache on the CPU
    (layers of different groups view one buffer, as on a GPU), a WORKER-role
    connector from vLLM's factory, driven in the model runner's order; every
    group's layers write the KV of the scheduled tokens (KVModel, this
    rank's bytes) into that group's blocks. ``kv_cache_config`` must hold
    tensors (hybrid_kv_cache_config).

    ``prefix_checks[req]`` = (n, {group: wrong block indices}): when vLLM
    first schedules req with n tokens it did not compute in that step (a
    load), every real block of every group below n must hold the model's
    bytes (a windowed group's null blocks below its window are not
    checked). ``skip_save_steps`` drops this rank's saves of those steps;
    ``drop_saves[step] = {group, ...}`` drops only those groups' saves."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, rank: int = 0) -> None:
        assert kv_cache_config.kv_cache_tensors, "hybrid_kv_cache_config makes the tensors"
        self.rank = rank
        resolve_layout(vllm_config, kv_cache_config)
        self.groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        self.specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        spec = self.specs[0]
        assert isinstance(spec, AttentionSpec), spec
        self.block_size = spec.block_size
        names = sorted({n for g in self.groups for n in g}, key=lambda n: int(n.split(".")[2]))
        self.index = {n: i for i, n in enumerate(names)}
        self.model = KVModel(len(names), spec.num_kv_heads, spec.head_size, rank)
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        self._start(
            vllm_config,
            allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout),
            KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config),
        )
        self.drop_saves: dict[int, set[int]] = {}
        self.prefix_checks: dict[str, tuple[int, dict[int, list[int]]]] = {}

    # -- KV access --
    def block_bytes(self, name: str, block_id: int) -> torch.Tensor:
        """int16 (heads, block, K|V) of one layer's block."""
        return self.kv_caches[name].view(torch.int16)[block_id]

    def expected(self, name: str, tokens: Sequence[int], index: int) -> torch.Tensor:
        bs = self.block_size
        hs = KVModel.prefix_hashes(tokens[: (index + 1) * bs])[index * bs :]
        assert len(hs) == bs, "block beyond the tokens"
        return ModelRunner._content(self.model.kv(hs, self.index[name])).transpose(0, 1)

    def wrong_blocks(self, group: int, tokens: Sequence[int], blocks: Sequence[int], indices: Iterable[int]) -> list[int]:
        """Indices i in indices whose block does not hold the model's KV for
        every layer of the group."""
        return [
            i for i in indices
            if any(not torch.equal(self.block_bytes(n, blocks[i]), self.expected(n, tokens, i)) for n in self.groups[group])
        ]

    # -- one step --
    def _check_prefix(self, rid: str, n: int) -> None:
        if n < self.block_size:
            return
        r = self.reqs[rid]
        wrong = {}
        for g, blocks in enumerate(r.blocks):
            real = [i for i in range(n // self.block_size) if blocks[i] != 0]
            wrong[g] = self.wrong_blocks(g, r.tokens, blocks, real)
        self.prefix_checks[rid] = (n, wrong)

    def _forward(self, work: list[tuple[str, int, int]]) -> None:
        bs = self.block_size
        for rid, start, n in work:
            r = self.reqs[rid]
            end = start + n
            self._extend(r, end)
            pos = torch.arange(start, end)
            slots = pos % bs
            for g, names in enumerate(self.groups):
                blocks = torch.tensor(r.blocks[g], dtype=torch.long)[pos // bs]
                assert bool((blocks != 0).all()), f"group {g}: tokens {start}..{end} scheduled into the null block"
                for name in names:
                    kv = ModelRunner._content(self.model.kv(r.hashes[start:end], self.index[name]))
                    self.kv_caches[name].view(torch.int16)[blocks, :, slots] = kv

    def _meta(self, meta: Any) -> Any:
        """The step's metadata, less the saves of the groups this rank drops
        in this step (re-encoded in its JSON text form, which the workers'
        decoder reads too: shim.DecodeStepMeta)."""
        drop = self.drop_saves.get(self.step_no)
        if not drop or not isinstance(meta, KVShimMetadata):
            return meta
        m = meta_json(meta.data)
        m["saves"] = [sv for sv in m.get("saves", []) if sv.get("group", 0) not in drop]
        return KVShimMetadata(json.dumps(m).encode())


# ---- ranks in spawned processes (test_tp_large.py, test_hma_tp.py) --------------


class Proc:
    """A spawned process hosting several ranks (kvshim_tp_worker.serve)."""

    def __init__(self, ctx: Any, i: int) -> None:
        import kvshim_tp_worker

        self.i = i
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=kvshim_tp_worker.serve, args=(child,), name=f"kvshim-ranks-{i}", daemon=True)
        self.proc.start()
        child.close()

    def recv(self, timeout: float = 60) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"process {self.i}: no answer in {timeout}s")
        status, res = self.conn.recv()
        if status not in ("ok", "ready"):
            raise AssertionError(f"process {self.i}: {res}")
        return res

    def call(self, cmd: str, *args: Any, timeout: float = 60) -> Any:
        self.conn.send((cmd, args))
        return self.recv(timeout)

    def close(self) -> None:
        import contextlib

        if self.proc.is_alive():
            with contextlib.suppress(Exception):  # killed below
                self.call("close", timeout=15)
        self.proc.join(timeout=15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


class Ranks:
    """The scheduler's handle on every rank: execute fans the scheduler
    output out to every process at once and gathers their outputs (ranks
    split evenly over the processes, in order)."""

    def __init__(self, procs: Sequence[Proc], world: int) -> None:
        self.procs = list(procs)
        self.world = world
        self.owner = {rk: self.procs[rk * len(self.procs) // world] for rk in range(world)}

    def setup(self, model_dir: str | os.PathLike[str], engine_id: str, par: dict[str, Any], num_blocks: int,
              cfg_kw: dict[str, Any]) -> None:
        """Every process makes its ranks' runners (kvshim_tp_worker.serve)."""
        for p in self.procs:
            mine = [rk for rk in range(self.world) if self.owner[rk] is p]
            p.conn.send(("setup", (str(model_dir), engine_id, mine, par, num_blocks, cfg_kw)))
        for p in self.procs:
            p.recv(timeout=120)

    def execute_all(self, so: SchedulerOutput) -> list[KVConnectorOutput]:
        for p in self.procs:
            p.conn.send(("execute", (so,)))
        outs: list[KVConnectorOutput] = []
        for p in self.procs:
            outs += p.recv()
        return outs

    def call(self, rank: int, sub: str, *args: Any) -> Any:
        return self.owner[rank].call("rank", rank, sub, *args)


class WorldHarness(SchedulerHarness):
    """SchedulerHarness whose runners are the remote ranks (their connector
    outputs combined by vLLM's KVOutputAggregator over the whole world)."""

    def __init__(self, cfg: VllmConfig, kvc: KVCacheConfig, ranks: Ranks) -> None:
        super().__init__(cfg, kvc)
        self.ranks = ranks
        self.runners = [ranks]  # non-empty: execute() goes to runners_step
        self._aggregator = KVOutputAggregator(ranks.world)

    def runners_step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        outs = self.ranks.execute_all(scheduler_output)
        mros: list[ModelRunnerOutput | None] = [self.model_runner_output(scheduler_output, kv_connector_output=o) for o in outs]
        assert self._aggregator is not None
        agg = self._aggregator.aggregate(mros)
        assert agg is not None and agg.kv_connector_output is not None
        return agg.kv_connector_output

    def close(self) -> None:
        self.runners = []
        super().close()
