"""SchedulerHarness: vLLM's real v1 Scheduler stepped with a fake model output."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvshim.vllm import KVShimConnector

from .config import EOS_TOKEN_ID, make_kv_cache_config, resolve_layout
from .runner import ConnectorStepDriver, as_kvshim


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
        self,
        max_steps: int = 200,
        *,
        pipelined: bool = False,
        idle_timeout_s: float = 30.0,
        **execute_kwargs: Any,
    ) -> list[StepResult]:
        """Step until the scheduler has no requests left (including finished
        ones whose blocks a connector still holds) and the workers no jobs
        (wait_workers); raise after ``max_steps``
        steps that scheduled tokens, or after ``idle_timeout_s`` in a row of
        steps that scheduled none (only waiting for a connector's asynchronous
        save or load, which a loaded machine can make take any number of
        such steps: counting them failed a TP=2 save on a busy CI run).

        ``pipelined=True`` overlaps steps like EngineCore.step_with_batch_queue
        (used when max_concurrent_batches > 1, e.g. async scheduling): batch
        N+1 is scheduled and executed before update_from_output of batch N."""
        results: list[StepResult] = []
        depth = self.vllm_config.max_concurrent_batches if pipelined else 1
        queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        steps, idle_deadline = 0, time.monotonic() + idle_timeout_s
        while steps < max_steps and time.monotonic() < idle_deadline:
            if self.scheduler.has_requests():
                so = self.scheduler.schedule()
                queue.appendleft((so, self.execute(so, **execute_kwargs)))
                if len(queue) < depth and (
                    so.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()
                ):
                    continue
            elif not queue:
                self.wait_workers(max(idle_deadline - time.monotonic(), 1.0))
                return results
            so, mro = queue.pop()
            results.append(self.finish(so, mro))
            if so.total_num_scheduled_tokens > 0:
                steps, idle_deadline = steps + 1, time.monotonic() + idle_timeout_s
            else:
                time.sleep(0.001)  # like an idle engine loop; leaves the CPU to the transfer
        raise AssertionError(
            f"scheduler not idle after {steps} steps with tokens (limit {max_steps}) "
            f"or {idle_timeout_s:g} s without one: "
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
        (EngineCore.step_with_batch_queue). Idle includes the workers
        (wait_workers): what a test reads after settle() is what every copy
        left. Raises after ``timeout_s``."""
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
                self.wait_workers(max(deadline - time.monotonic(), 1.0))
                return results
            so, mro = queue.pop()
            results.append(self.finish(so, mro))
            if until is not None and until(results[-1]):
                done = True

    def wait_workers(self, timeout_s: float = 5.0) -> None:
        """Until no worker has a job left: saves committed and counted (vLLM
        gets a save's blocks back once the copy read them; the COMMIT, and
        the worker's count of it, follow), loads reported and their holds
        RELEASEd (after the copies, off the request's path)."""
        deadline = time.monotonic() + timeout_s
        for r in self.runners:
            conn = getattr(r, "connector", None)  # none in a proxy of a runner in another process
            if not isinstance(conn, KVShimConnector):
                continue
            while conn.worker.stats().jobs:
                assert time.monotonic() < deadline, f"worker jobs still running after {timeout_s}s"
                time.sleep(0.002)

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
