"""One rank's model runner without a GPU: KVModel (what the "model" computes),
WorkerStepDriver (the one worker-step loop) and its runners."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.utils import allocate_kv_cache

from kvshim.native import meta_json
from kvshim.vllm import KVShimConnector, KVShimMetadata

from .config import HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS, resolve_layout


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


def as_kvshim(connector: KVConnectorBase_V1 | None) -> KVShimConnector:
    assert isinstance(connector, KVShimConnector), connector
    return connector


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
    block_size: int

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

    def _spans(self, work: list[tuple[str, int, int]]) -> Iterator[tuple[R, int, int, torch.Tensor, torch.Tensor]]:
        """Each request's span of work as (request, start, end, block index
        and slot of each position), its tokens extended up to end."""
        for rid, start, n in work:
            r = self.reqs[rid]
            self._extend(r, start + n)
            pos = torch.arange(start, start + n)
            yield r, start, start + n, pos // self.block_size, pos % self.block_size

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
        for r, start, end, index, slots in self._spans(work):
            blocks = torch.tensor(r.blocks, dtype=torch.long)[index]
            for i, name in enumerate(self.layer_names):
                kv = self._content(self.model.kv(r.hashes[start:end], i))
                self.kv_caches[name].view(torch.int16)[blocks, :, slots] = kv


# ---- hybrid models (several KV-cache groups) ----


class HybridStepDriver(WorkerStepDriver[_HybridReq]):
    """WorkerStepDriver for several KV-cache groups: a request's blocks per
    group (HybridModelRunner, test_hma.py's HybridRunner)."""

    # -- one step: every group's blocks --
    def _new_req(self, tokens: list[int], block_ids: Sequence[Sequence[int]]) -> _HybridReq:
        return _HybridReq(tokens, KVModel.prefix_hashes(tokens), [list(b) for b in block_ids])

    def _add_blocks(self, r: _HybridReq, new_block_ids: Sequence[Sequence[int]]) -> None:
        for g, b in enumerate(new_block_ids):
            r.blocks[g].extend(b)

    # -- KV access: each subclass's block_bytes and expected, per layer --
    groups: list[list[str]]  # layer names per KV-cache group

    def block_bytes(self, name: str, block_id: int) -> torch.Tensor:
        raise NotImplementedError

    def expected(self, name: str, tokens: Sequence[int], index: int) -> torch.Tensor:
        raise NotImplementedError

    def wrong_blocks(self, group: int, tokens: Sequence[int], blocks: Sequence[int], indices: Iterable[int]) -> list[int]:
        """Indices i in indices whose block does not hold the model's KV for
        every layer of the group."""
        return [
            i for i in indices
            if any(not torch.equal(self.block_bytes(n, blocks[i]), self.expected(n, tokens, i)) for n in self.groups[group])
        ]


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
        for r, start, end, index, slots in self._spans(work):
            for g, names in enumerate(self.groups):
                blocks = torch.tensor(r.blocks[g], dtype=torch.long)[index]
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
