"""Hybrid models through vLLM's hybrid KV-cache manager (HMA): KVShimConnector
implements SupportsHMA, so vLLM keeps the manager on, and every KV-cache
group is saved and restored by its own protocol (shim/groups.go).

The KV-cache configs are vLLM's own: per-layer specs as the model's
attention layers declare them (a Gemma-3-style model: sliding-window layers
and every third layer global; a Llama-4-style model: chunked local
attention and every fourth layer global; a Jamba-style model: Mamba
layers in mamba_cache_mode "align" and every fourth layer global), grouped by vLLM's
get_kv_cache_groups, laid out by get_kv_cache_config_from_groups and
allocated by allocate_kv_cache (layers of different groups view one buffer,
as on a GPU). The scheduler is vLLM's real one, one manager per group.
No weights: the "model" writes, for every computed token and layer, KV
bytes that are a function of the token prefix (harness.KVModel), so
restored blocks are compared byte for byte.

This machine has no GPU: vLLM's UnspecifiedPlatform does not support the
hybrid manager (platforms/interface.py support_hybrid_kv_cache), so
VllmConfig turns it off (config/vllm.py:2232-2234); the tests turn it back
on after the config is built, as a GPU platform leaves it. Llama-4's chunked
local attention keeps HMA only with
VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 (config/vllm.py:2245);
the test sets HMA on the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from harness import (
    CHUNK,
    HybridStepDriver,
    KVModel,
    SchedulerHarness,
    assert_clean,
    kvshim_config,
    loads_of,
    new_req_data,
    prompt,
    resolve_layout,
    run_until_scheduled,
    saves_of,
    wait_jobs,
)
from kvshim.native import meta_json
from kvshim.vllm import KVShimConnector, connector_config

BLOCK = 16
HEADS, HEAD = 2, 16
NUM_BLOCKS = 160


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def gemma3_specs(num_layers: int = 6, window: int = 40) -> dict[str, Any]:
    """Gemma-3's attention: sliding-window layers, every sixth global
    (Gemma3Config.sliding_window_pattern = 6; a window smaller than a chunk
    here, so a window's first block lies inside the hit's last chunk)."""
    kw: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": HEADS, "head_size": HEAD, "dtype": torch.float16}
    return {
        layer(i): FullAttentionSpec(**kw) if i % 6 == 5 else SlidingWindowSpec(sliding_window=window, **kw)
        for i in range(num_layers)
    }


def llama4_specs(num_layers: int = 4, attention_chunk: int = 2 * CHUNK) -> dict[str, Any]:
    """Llama-4's attention: chunked local attention, every fourth layer
    global (no_rope_layers: the NoPE layers attend to everything)."""
    kw: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": HEADS, "head_size": HEAD, "dtype": torch.float16}
    return {
        layer(i): FullAttentionSpec(**kw) if i % 4 == 3 else ChunkedLocalAttentionSpec(attention_chunk_size=attention_chunk, **kw)
        for i in range(num_layers)
    }


def jamba_specs(num_layers: int = 8, mode: str = "align", **mamba: Any) -> dict[str, Any]:
    """A Jamba/Granite-4-style hybrid: Mamba layers, every fourth layer
    full attention. The state (a conv and an SSM tensor, MambaSpec.shapes)
    is padded to the attention page (page_size_padded, as vLLM pads a
    hybrid model's Mamba pages: cache_config.mamba_page_size_padded), so
    get_kv_cache_groups puts the layers of a kind in groups of one page
    size."""
    kw: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": HEADS, "head_size": HEAD, "dtype": torch.float16}
    page = FullAttentionSpec(**kw).page_size_bytes
    state: dict[str, Any] = {"block_size": BLOCK, "shapes": ((4, 8), (HEADS, HEAD, 8)), "dtypes": (torch.float16, torch.float16),
             "page_size_padded": page, "mamba_cache_mode": mode} | mamba
    return {layer(i): FullAttentionSpec(**kw) if i % 4 == 3 else MambaSpec(**state) for i in range(num_layers)}


def mamba_only_specs(num_layers: int = 4) -> dict[str, Any]:
    """An attention-free Mamba-2/Falcon-Mamba-style model: every layer a
    Mamba layer in mamba_cache_mode "align" (no attention page to pad the
    state to), so get_kv_cache_groups makes one MambaSpec group."""
    state = MambaSpec(block_size=BLOCK, shapes=((4, 8), (HEADS, HEAD, 8)), dtypes=(torch.float16, torch.float16),
                      mamba_cache_mode="align")
    return dict.fromkeys((layer(i) for i in range(num_layers)), state)


def hma_config(model_dir, specs: dict[str, Any], layout: str = "LBNHC", *, prefix_caching: bool = False,
               mamba_cache_mode: Literal["align", "none"] | None = None, groups: int = 0) -> tuple[Any, KVCacheConfig]:
    """A VllmConfig with the hybrid manager on and vLLM's KVCacheConfig for
    the specs (groups by get_kv_cache_groups, tensors by
    get_kv_cache_config_from_groups; groups: how many vLLM must make, 0:
    several). mamba_cache_mode is the cache config's (vLLM derives "align"
    from prefix caching for a model with Mamba layers; the tiny Llama has
    none, so it is set here)."""
    cfg = kvshim_config(model_dir, enable_prefix_caching=prefix_caching)
    if mamba_cache_mode is not None:
        cfg.cache_config.mamba_cache_mode = mamba_cache_mode
    # The factory's check: KVShimConnector no longer turns HMA off.
    assert cfg.kv_transfer_config is not None
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on a GPU platform
    cfg.cache_config.kv_cache_layout = layout
    cfg.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    made = get_kv_cache_groups(cfg, dict(specs))
    assert len(made) == groups if groups else len(made) > 1, made
    kvc = get_kv_cache_config_from_groups(cfg, made, 1 << 40)
    assert kvc.num_blocks == NUM_BLOCKS
    return cfg, kvc


class HybridRunner(HybridStepDriver):
    """One rank's model runner for a hybrid model, without a GPU: vLLM's
    allocate_kv_cache on the CPU (optionally with kernel blocks of
    kernel_block_size tokens), a WORKER-role KVShimConnector from vLLM's
    factory, driven by harness.WorkerStepDriver; every group's layers write
    the KV of the scheduled tokens into that group's blocks (a Mamba
    group's layers: the state, _advance_state)."""

    def __init__(self, vllm_config: Any, kv_cache_config: KVCacheConfig, kernel_block_size: int | None = None) -> None:
        cfg, kvc = vllm_config, kv_cache_config
        self.kv_cache_config = kvc
        self.kernel_block_size = kernel_block_size
        resolve_layout(cfg, kvc)
        self.groups = [list(g.layer_names) for g in kvc.kv_cache_groups]
        self.specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
        # Mamba groups: one state a block, not a KV a token (state()).
        self.state_groups = {g for g, sp in enumerate(self.specs) if isinstance(sp, MambaSpec)}
        # (request, tokens) of every step that found a state other than the
        # model's for its prefix where vLLM reads the running state
        self.state_errors: list[tuple[str, int]] = []
        names = sorted({n for g in self.groups for n in g}, key=lambda n: int(n.split(".")[2]))
        self.index = {n: i for i, n in enumerate(names)}
        self.model = KVModel(len(names), HEADS, HEAD)
        kbs = None if kernel_block_size is None else [kernel_block_size] * len(self.groups)
        self.kbs = kernel_block_size or BLOCK
        self._start(
            cfg,
            allocate_kv_cache(kvc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout(), kbs),
            KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc),
        )

    # -- KV access: (kernel) block coordinates, never the connector's view --
    def _where(self, block: int, slot: int) -> tuple[int, int]:
        k = BLOCK // self.kbs
        return block * k + slot // self.kbs, slot % self.kbs

    def block_bytes(self, name: str, block: int) -> torch.Tensor:
        t = self.kv_caches[name].view(torch.int16)
        return torch.cat([t[self._where(block, s)[0], :, self._where(block, s)[1]].unsqueeze(1) for s in range(BLOCK)], 1)

    def expected(self, name: str, tokens: Sequence[int], index: int) -> torch.Tensor:
        hs = KVModel.prefix_hashes(tokens[: (index + 1) * BLOCK])[index * BLOCK :]
        kv = self.model.kv(hs, self.index[name])  # (2, tokens, heads, head)
        return kv.permute(2, 1, 0, 3).reshape(HEADS, BLOCK, 2 * HEAD)

    def state(self, name: str, hashes: list[int], n: int) -> torch.Tensor:
        """A Mamba layer's state after n tokens: bytes that are a function
        of the n-token prefix and the layer (int8, the page view's width)."""
        import numpy as np

        seed = (hashes[n - 1] ^ (self.index[name] + 1) * 0x9E3779B97F4A7C15) & (1 << 64) - 1
        width = self.kv_caches[name].shape[-1]
        return torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, width, dtype=np.int8))

    def state_ok(self, group: int, hashes: list[int], block: int, n: int) -> bool:
        return all(torch.equal(self.kv_caches[name][block, 0, 0], self.state(name, hashes, n)) for name in self.groups[group])

    # -- one step --
    def _check_prefix(self, rid: str, n: int) -> None:
        """Before vLLM computes a request with n tokens it did not compute
        (a load): every real block each group has for them must hold the
        model's bytes. Records (n, {group: wrong block indices})."""
        if n == 0:
            return
        r = self.reqs[rid]
        wrong = {}
        for g, blocks in enumerate(r.blocks):
            if g in self.state_groups:
                # the state at n, in the block that ends there
                wrong[g] = [] if self.state_ok(g, r.hashes, blocks[n // BLOCK - 1], n) else [n // BLOCK - 1]
                continue
            real = [i for i in range(n // BLOCK) if blocks[i] != 0]
            wrong[g] = self.wrong_blocks(g, r.tokens, blocks, range(real[0], n // BLOCK)) if real else []
        r.first_check = (n, wrong)

    def _forward(self, work) -> None:
        for rid, start, n in work:
            r = self.reqs[rid]
            self._extend(r, start + n)
            for g, names in enumerate(self.groups):
                if g in self.state_groups:
                    self._advance_state(rid, g, start, start + n)
                    continue
                for p in range(start, start + n):
                    b = r.blocks[g][p // BLOCK]
                    assert b != 0, f"group {g}: token {p} scheduled into the null block"
                    kb, slot = self._where(b, p % BLOCK)
                    for name in names:
                        kv = self.model.kv(r.hashes[p : p + 1], self.index[name])  # (2, 1, heads, head)
                        self.kv_caches[name].view(torch.int16)[kb, :, slot] = kv.permute(1, 2, 0, 3).reshape(HEADS, 2 * HEAD)

    def _advance_state(self, rid: str, g: int, start: int, end: int) -> None:
        """vLLM's align mode on the worker: the step reads the running state
        from the block holding token start-1 (the hit's block after a load)
        and leaves the state after end tokens in the block holding token
        end-1 (v1/core/single_type_kv_cache_manager.py MambaManager
        allocate_new_blocks; scheduler.py:607-610). A state other than the
        model's where it is read is recorded."""
        r = self.reqs[rid]
        if start > 0:
            src = r.blocks[g][(start - 1) // BLOCK]
            assert src != 0, f"group {g}: the state at {start} is in the null block"
            if not self.state_ok(g, r.hashes, src, start):
                self.state_errors.append((rid, start))
        dst = r.blocks[g][(end - 1) // BLOCK]
        assert dst != 0, f"group {g}: the state at {end} goes into the null block"
        for name in self.groups[g]:
            self.kv_caches[name][dst, 0, 0] = self.state(name, r.hashes, end)


@pytest.fixture
def hybrid(tiny_model_dir):
    made = []

    def make(specs: dict[str, Any], kernel_block_size: int | None = None, layout: str = "LBNHC", **kw: Any):
        cfg, kvc = hma_config(tiny_model_dir, specs, layout, **kw)
        h = SchedulerHarness(cfg, kvc)
        h.runners = [HybridRunner(cfg, kvc, kernel_block_size)]
        made.append(h)
        return h, h.runners[0]

    yield make
    for h in made:
        h.close()



def skipped(spec: Any, n: int) -> int:
    """vLLM's get_num_skipped_tokens for the spec (the managers' rule)."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, n - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return n // spec.attention_chunk_size * spec.attention_chunk_size
    return 0


def store_and_restore(h, r, *, chunks: int = 3) -> None:
    """Request A computes chunks full chunks and saves them, per group;
    request B with the same prefix restores them into its own blocks,
    byte for byte, while A still runs (so B's blocks are not A's)."""
    sched = h.scheduler
    ngroups = len(r.groups)
    # vLLM's coordinator runs one manager per group (with prefix caching off:
    # KVCacheCoordinatorNoPrefixCache; HybridKVCacheCoordinator with it on).
    assert len(sched.kv_cache_manager.coordinator.single_type_managers) == ngroups > 1
    p = prompt(31, chunks * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=60))
    run_until_scheduled(h, a)
    # A's prompt chunks are saved during its prefill, every group its own.
    h.step()  # A decodes: its saves run
    wait_jobs(h)
    svs = saves_of(h, a.request_id)
    assert sorted({sv.get("group", 0) for sv in svs}) == list(range(ngroups))
    for sv in svs:
        spec = r.specs[sv.get("group", 0)]
        for c, first in zip(range(sv["first"], chunks), range(0, len(sv["blocks"]), CHUNK // BLOCK)):
            ids = sv["blocks"][first : first + CHUNK // BLOCK]
            # the object holds the blocks inside the window at the chunk's end
            lo = max(c * CHUNK, skipped(spec, (c + 1) * CHUNK - 1)) // BLOCK - c * CHUNK // BLOCK
            assert all(b == -1 for b in ids[:lo]) and all(b > 0 for b in ids[lo:]), (spec, c, ids)

    r.scribble()  # only a load can bring the bytes back (A's too: it recomputes nothing)
    q = p[: chunks * CHUNK] + prompt(32, 9)
    b = h.add_request(h.make_request(q, max_tokens=1))
    s = run_until_scheduled(h, b)
    hit = chunks * CHUNK
    assert new_req_data(s, b.request_id).num_computed_tokens == hit
    loads = [ld for st in h.steps for ld in loads_of(st, b.request_id)]
    assert sorted(ld.get("group", 0) for ld in loads) == list(range(ngroups))
    rb = r.reqs[b.request_id]
    # A's blocks now (vLLM freed the ones its windows moved past)
    a_blocks = [set(ids) - {0} for ids in sched.kv_cache_manager.get_block_ids(a.request_id)]
    n, wrong = rb.first_check
    assert n == hit
    assert wrong == {g: [] for g in range(ngroups)}, wrong
    for g, spec in enumerate(r.specs):
        first_real = skipped(spec, hit) // BLOCK
        # vLLM gave null blocks below the window and real ones inside it...
        assert all(x == 0 for x in rb.blocks[g][:first_real]) and all(x != 0 for x in rb.blocks[g][first_real : hit // BLOCK])
        # ...into which the load restored the window: blocks of B's own
        assert a_blocks[g] and set(rb.blocks[g][first_real : hit // BLOCK]).isdisjoint(a_blocks[g])
    (ld_full,) = [ld for ld in loads if isinstance(r.specs[ld.get("group", 0)], FullAttentionSpec)
                  and ld.get("group", 0) == min(i for i, sp in enumerate(r.specs) if type(sp) is FullAttentionSpec)]
    assert (ld_full["start"], ld_full["end"]) == (0, chunks)
    assert all(not e for e in r.load_errors)
    h.abort(a.request_id)
    h.settle()
    assert_clean(h)


def test_gemma3_sliding_window_restores_each_group(hybrid):
    h, r = hybrid(gemma3_specs())
    kinds = {type(s).__name__ for s in r.specs}
    assert kinds == {"SlidingWindowSpec", "FullAttentionSpec"}, kinds
    store_and_restore(h, r)
    # The sliding-window groups loaded only the chunk that holds the window.
    loads = [ld for st in h.steps for req in h.requests for ld in loads_of(st, req)]
    for ld in loads:
        if isinstance(r.specs[ld.get("group", 0)], SlidingWindowSpec):
            assert (ld["start"], ld["end"]) == (2, 3), ld
            assert ld["blocks"][0] == -1  # below the window: a null block, never written


def test_llama4_chunked_local_restores_each_group(hybrid):
    h, r = hybrid(llama4_specs())
    assert {type(s).__name__ for s in r.specs} == {"ChunkedLocalAttentionSpec", "FullAttentionSpec"}
    store_and_restore(h, r)
    loads = [ld for st in h.steps for req in h.requests for ld in loads_of(st, req)]
    for ld in loads:
        if isinstance(r.specs[ld.get("group", 0)], ChunkedLocalAttentionSpec):
            # the hit ends at 192 tokens: its attention chunk started at 128
            assert (ld["start"], ld["end"]) == (2, 3), ld


def test_multiturn_restores_the_answer_through_the_windows_it_kept(hybrid):
    """Turn 1 finishes after a long answer: each answer chunk is saved
    during the decode, once its KV is computed, when every group (the
    sliding windows too) still holds the blocks the chunk's object needs.
    Turn 2 (turn 1's prompt + answer + a question) restores all 4 chunks;
    the windowed groups load only the chunk whose window they need at the
    full groups' boundary."""
    h, r = hybrid(gemma3_specs())
    p = prompt(41, 2 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=2 * CHUNK))
    h.settle()
    turn1 = p + h.outputs[a.request_id]
    # While A decoded, vLLM freed blocks behind its windows and handed some
    # out again while saves that read them could still run: those steps made
    # the workers wait for A's copies first (the fence; vLLM itself preempted
    # nothing).
    fenced = [st for st in h.steps if a.request_id in meta_json(st.scheduler_output.kv_connector_metadata.data).get("preempted", [])]
    assert fenced and not any(st.scheduler_output.preempted_req_ids for st in h.steps)
    assert len(turn1) == 4 * CHUNK + 5
    saved: dict[int, list[int]] = {}
    for sv in saves_of(h, a.request_id):
        saved.setdefault(sv.get("group", 0), []).extend(range(sv["first"], sv["first"] + len(sv["hashes"])))
    for g in range(len(r.specs)):
        # every chunk, once: the prompt's during the prefill, the answer's
        # during the decode (a window's blocks are still there then)
        assert sorted(saved[g]) == [0, 1, 2, 3], (g, saved[g])

    r.scribble()
    q = turn1 + prompt(42, 9)
    b = h.add_request(h.make_request(q, max_tokens=1))
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 4 * CHUNK
    n, wrong = r.reqs[b.request_id].first_check
    assert n == 4 * CHUNK and wrong == {g: [] for g in range(len(r.specs))}, wrong
    loads = [ld for st in h.steps for ld in loads_of(st, b.request_id)]
    for ld in loads:
        if isinstance(r.specs[ld.get("group", 0)], SlidingWindowSpec):
            # chunk 3 alone (the window at 256 starts at 217)
            assert (ld["start"], ld["end"]) == (3, 4) and len(ld["hashes"]) == 1, ld
        else:
            assert (ld["start"], ld["end"]) == (0, 4), ld
    assert all(not e for e in r.load_errors)
    h.settle()
    assert_clean(h)


def restore_after_vllm_evicts(h, r, *, fillers: int, max_tokens: int) -> None:
    """With vLLM's prefix cache on (HybridKVCacheCoordinator): A's prompt
    runs, fillers other prompts fill the pool until vLLM evicted its own
    cached blocks of it, then B (A's 3 chunks and 9 tokens more) gets all 3
    chunks from kvshim, every group's loaded byte-exact, and runs to its
    end."""
    assert type(h.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    p = prompt(51, 3 * CHUNK + 5)
    h.add_request(h.make_request(p, max_tokens=1))
    h.settle()
    for i in range(fillers):
        h.add_request(h.make_request(prompt(60 + i, 5 * CHUNK), max_tokens=1))
        h.settle()
    r.scribble()
    b = h.add_request(h.make_request(p[: 3 * CHUNK] + prompt(52, 9), max_tokens=max_tokens))
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 3 * CHUNK
    loads = [ld for st in h.steps for ld in loads_of(st, b.request_id)]
    assert sorted(ld.get("group", 0) for ld in loads) == list(range(len(r.specs)))
    n, wrong = r.reqs[b.request_id].first_check
    assert n == 3 * CHUNK and wrong == {g: [] for g in range(len(r.specs))}, wrong
    h.settle()


def test_with_vllms_prefix_cache_on(hybrid):
    """vLLM's prefix cache on (HybridKVCacheCoordinator, as in production):
    once vLLM evicted its own copy, kvshim restores every group."""
    h, r = hybrid(gemma3_specs(), prefix_caching=True)
    restore_after_vllm_evicts(h, r, fillers=4, max_tokens=1)
    assert all(not e for e in r.load_errors)
    assert_clean(h)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_block_split_is_restored(hybrid, layout):
    # vLLM splits 16-token blocks into kernel blocks of 8 (dim 0 counts
    # those): kvshim copies whole blocks, token-major (one run a block) or
    # head-major (a kernel_blocks dimension) alike.
    h, r = hybrid(gemma3_specs(), kernel_block_size=8, layout=layout)
    t = next(iter(r.kv_caches.values()))
    assert t.shape[0] == 2 * NUM_BLOCKS and t.shape[2] == 8
    assert (t.stride(1) > t.stride(2)) == (layout == "LBHNC")  # heads outside the tokens
    store_and_restore(h, r)


def test_groups_are_named_in_the_namespace(tiny_model_dir):
    """The layout names every group by vLLM's order (Go gives each its own
    namespace from it: shim/groups_test.go; a group's object read as
    another's is a key mismatch, never copied: TestGroupsSaveAndRestore...)."""
    import json

    cfg, kvc = hma_config(tiny_model_dir, gemma3_specs())
    ns = connector_config(cfg, kvc, KVConnectorRole.WORKER)["open"]["namespace"]
    groups = json.loads(ns["layout"])["groups"]
    assert [g["kind"] for g in groups] == [
        "full" if type(g.kv_cache_spec) is FullAttentionSpec else "sliding_window" for g in kvc.kv_cache_groups
    ]
    assert all(g["window"] == 40 for g in groups if g["kind"] == "sliding_window")
    assert ns["kv_group"] == 0  # the groups' own ids are added in Go


# The namespace of the single-group tiny Llama before KV-cache groups
# existed (kvshim's main at 78f1810): keys of stored objects must not move.
SINGLE_GROUP_NAMESPACE = {
    "dtype": "float16",
    "kv_group": 0,
    "layout": '{"block_size": 16, "cache_layout": "LBNHC", "head_size": 16, "kv_heads": 2, "layers": 2, "spec": "FullAttentionSpec"}',
    "mla": False,
    "tp_size": 1,
    "world_size": 1,
    "chunk_size": CHUNK,
    # Added since 78f1810; a DCP size of 0 or 1 is "none" and leaves the
    # namespace's hash as it was (shim TestNamespaceDCP).
    "dcp_size": 1,
}


def test_single_group_keys_are_unchanged(tiny_model_dir):
    from harness import make_kv_cache_config

    cfg = kvshim_config(tiny_model_dir, enable_prefix_caching=False)
    cfg.cache_config.kv_cache_layout = "LBNHC"
    assert cfg.kv_transfer_config is not None
    ns = connector_config(cfg, make_kv_cache_config(), KVConnectorRole.WORKER)["open"]["namespace"]
    ns.pop("model")
    assert ns == SINGLE_GROUP_NAMESPACE


@pytest.mark.parametrize(("cache_mode", "mamba", "groups", "why"), [
    # vLLM keeps one running state, overwritten in place: no boundary state
    ("none", {"mamba_cache_mode": "none"}, 2, r"mamba_cache_mode is 'none'"),
    ("align", {"mamba_cache_mode": "none"}, 2, r"mamba_cache_mode is 'none'"),
    # the running state moves among 1+n blocks (_relocate_speculative_block)
    ("align", {"mamba_cache_mode": "align", "num_speculative_blocks": 1}, 2, r"speculative decoding keeps 1"),
    # a speculative config (EAGLE's block drop moves prefill checkpoints)
    ("align", {"mamba_cache_mode": "align", "spec": True}, 2, r"speculative decoding \(a prefill checkpoint"),
    ("align", {"mamba_cache_mode": "align", "tokens_per_state": 4}, 2, r"several states"),
    ("align", {"mamba_cache_mode": "align", "prefix_match_unit": 8}, 2, r"prefix_match_unit 8 is finer"),
    # an attention-free model's one Mamba group: the same rules
    ("none", {"mamba_cache_mode": "none"}, 1, r"mamba_cache_mode is 'none'"),
    ("align", {"mamba_cache_mode": "align", "num_speculative_blocks": 2}, 1, r"speculative decoding keeps 2"),
    # a state block of other than the scheduler's block_size tokens (mamba_block_size set apart)
    ("align", {"mamba_cache_mode": "align", "block_size": 2 * BLOCK}, 1, r"32-token blocks \(mamba_block_size\) are not the scheduler's"),
    ("align", {"mamba_cache_mode": "align", "block_size": 2 * BLOCK}, 2, r"32-token blocks \(mamba_block_size\) are not the scheduler's"),
])
def test_unsupported_mamba_group_is_refused_naming_group_and_model(tiny_model_dir, cache_mode, mamba, groups, why):
    from vllm.config import SpeculativeConfig, VllmConfig

    mamba = dict(mamba)
    cfg = kvshim_config(tiny_model_dir, enable_prefix_caching=False)
    if mamba.pop("spec", False):
        cfg = VllmConfig(parallel_config=cfg.parallel_config, model_config=cfg.model_config, scheduler_config=cfg.scheduler_config,
                         cache_config=cfg.cache_config, kv_transfer_config=cfg.kv_transfer_config, device_config=cfg.device_config,
                         speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                              prompt_lookup_max=4, prompt_lookup_min=2))
    cfg.cache_config.prefix_match_unit = mamba.pop("prefix_match_unit", None)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    cfg.cache_config.mamba_cache_mode = cache_mode
    full = KVCacheGroupSpec([layer(0)], FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16))
    state = KVCacheGroupSpec([layer(1)], MambaSpec(**{"block_size": BLOCK, "shapes": ((4, 8),), "dtypes": (torch.float16,)} | mamba))
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[full, state][2 - groups:])
    where = rf"KV-cache group {groups - 1} \(MambaSpec, layers \['model.layers.1.self_attn.attn'\]\) of model .*tiny-llama.*@main"
    for role in (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER):
        with pytest.raises(ValueError, match=where + r" holds Mamba/SSM state, .*" + why):
            KVShimConnector(cfg, role, kvc)


def test_mamba_groups_are_named_in_the_namespace(tiny_model_dir):
    import json

    cfg, kvc = hma_config(tiny_model_dir, jamba_specs(), mamba_cache_mode="align")
    ns = connector_config(cfg, kvc, KVConnectorRole.WORKER)["open"]["namespace"]
    groups = json.loads(ns["layout"])["groups"]
    assert [g["kind"] for g in groups] == ["mamba" if isinstance(g.kv_cache_spec, MambaSpec) else "full" for g in kvc.kv_cache_groups]
    assert groups[0] | {"layers": 2} == {"kind": "mamba", "spec": "MambaSpec", "block_size": BLOCK, "kv_heads": None, "head_size": None,
                                         "layers": 2, "shapes": [[4, 8], [HEADS, HEAD, 8]], "dtypes": ["float16", "float16"],
                                         "mamba_type": "MAMBA2"}


def mamba_saved(h, req_id: str, r: HybridRunner) -> dict[int, list[int]]:
    """The chunks saved per group for req_id."""
    saved: dict[int, list[int]] = {}
    for sv in saves_of(h, req_id):
        saved.setdefault(sv.get("group", 0), []).extend(range(sv["first"], sv["first"] + len(sv["hashes"])))
    return saved


def test_mamba_hybrid_restores_attention_and_state(hybrid):
    """A Jamba-style model (3 Mamba groups, 1 full attention group) in
    mamba_cache_mode "align". Request A's prefill stops at 192, the last
    block boundary before its 197-token prompt's end (vLLM's
    _mamba_block_aligned_split): the state at 192 is kept, those at 64 and
    128 never exist (null blocks). kvshim saves the attention group's 3
    chunks and each Mamba group's chunk 2 alone (its last block). B (A's
    192 tokens and 9 more) restores every group at 192: the attention KV and
    the state block, byte for byte, into its own blocks, and its first step
    reads the restored state. C (A's first 150 tokens) would hit 128 tokens
    of attention, but no state is stored there: a miss, never a restore
    of a wrong state."""
    h, r = hybrid(jamba_specs(), mamba_cache_mode="align")
    assert [type(sp).__name__ for sp in r.specs].count("MambaSpec") == 3 and len(r.specs) == 4
    sched = h.scheduler
    assert sched.need_mamba_block_aligned_split
    p = prompt(31, 3 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=60))
    s = run_until_scheduled(h, a)
    assert s.num_scheduled_tokens[a.request_id] == 3 * CHUNK
    h.step()  # A's last 5 prompt tokens
    wait_jobs(h)
    saved = mamba_saved(h, a.request_id, r)
    for g in range(len(r.specs)):
        assert saved[g] == ([2] if g in r.state_groups else [0, 1, 2]), (g, saved)
    for sv in saves_of(h, a.request_id):
        if sv.get("group", 0) in r.state_groups:
            assert sv["blocks"][:3] == [-1, -1, -1] and sv["blocks"][3] > 0, sv  # the block ending at 192

    r.scribble()  # only a load can bring the bytes back
    q = p[: 3 * CHUNK] + prompt(32, 9)
    b = h.add_request(h.make_request(q, max_tokens=2))
    s = run_until_scheduled(h, b)
    hit = 3 * CHUNK
    assert new_req_data(s, b.request_id).num_computed_tokens == hit
    loads = [ld for st in h.steps for ld in loads_of(st, b.request_id)]
    assert sorted(ld.get("group", 0) for ld in loads) == list(range(len(r.specs)))
    (ld_full,) = [ld for ld in loads if ld.get("group", 0) not in r.state_groups]
    assert (ld_full["start"], ld_full["end"]) == (0, 3)
    for ld in loads:
        if ld.get("group", 0) in r.state_groups:
            # chunk 2 alone (a lookup of chunks 2.. : its chunk 0), the state block ending at 192
            assert ld["hashes"] == ld_full["hashes"][2:] and (ld["start"], ld["end"]) == (0, 1), ld
            assert ld["blocks"][:3] == [-1, -1, -1] and ld["blocks"][3] > 0, ld
    rb = r.reqs[b.request_id]
    a_blocks = [set(ids) - {0} for ids in sched.kv_cache_manager.get_block_ids(a.request_id)]
    n, wrong = rb.first_check
    assert n == hit and wrong == {g: [] for g in range(len(r.specs))}, wrong
    for g in r.state_groups:
        # vLLM's blocks for a hit of 192: null up to the state block (MambaManager.get_num_skipped_tokens: n-1)
        assert all(x == 0 for x in rb.blocks[g][: hit // BLOCK - 1]) and rb.blocks[g][hit // BLOCK - 1] not in a_blocks[g] | {0}
    h.settle(until=lambda st: b.request_id in st.scheduler_output.finished_req_ids)
    # (A reads the state the scribble wiped: no request but A's is wrong)
    assert {rid for rid, _ in r.state_errors} <= {a.request_id} and all(not e for e in r.load_errors)

    c = h.add_request(h.make_request(p[:150] + prompt(33, 9), max_tokens=1))
    s = run_until_scheduled(h, c)
    assert new_req_data(s, c.request_id).num_computed_tokens == 0
    assert not [ld for st in h.steps for ld in loads_of(st, c.request_id)]
    h.abort(a.request_id)
    h.settle()
    assert {rid for rid, _ in r.state_errors} <= {a.request_id}
    assert_clean(h)


def test_mamba_multiturn_restores_the_state_saved_during_decode(hybrid):
    """Turn 1 (133-token prompt, 128 tokens of answer): the prefill keeps
    the state at 128, the decode passes 192 and 256 one token a step, and
    each of those states is saved once the step that computed it ran.
    Turn 2 (turn 1 + a question) restores 256 tokens: the attention group's
    4 chunks and each Mamba group's state at 256."""
    h, r = hybrid(jamba_specs(), mamba_cache_mode="align")
    p = prompt(41, 2 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=2 * CHUNK))
    h.settle()
    turn1 = p + h.outputs[a.request_id]
    assert len(turn1) == 4 * CHUNK + 5
    saved = mamba_saved(h, a.request_id, r)
    for g in range(len(r.specs)):
        assert sorted(saved[g]) == ([1, 2, 3] if g in r.state_groups else [0, 1, 2, 3]), (g, saved)

    r.scribble()
    b = h.add_request(h.make_request(turn1 + prompt(42, 9), max_tokens=1))
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 4 * CHUNK
    n, wrong = r.reqs[b.request_id].first_check
    assert n == 4 * CHUNK and wrong == {g: [] for g in range(len(r.specs))}, wrong
    loads = [ld for st in h.steps for ld in loads_of(st, b.request_id)]
    (ld_full,) = [ld for ld in loads if ld.get("group", 0) not in r.state_groups]
    assert (ld_full["start"], ld_full["end"]) == (0, 4)
    for ld in loads:
        if ld.get("group", 0) in r.state_groups:
            assert ld["hashes"] == ld_full["hashes"][3:], ld  # the state at 256 alone
    h.settle()
    assert r.state_errors == [] and all(not e for e in r.load_errors)
    assert_clean(h)


def test_connector_supports_hma():
    assert supports_hma(KVShimConnector)


def test_mamba_with_vllms_prefix_cache_on(hybrid):
    """Prefix caching on (vLLM's HybridKVCacheCoordinator: how a Mamba
    hybrid runs in "align" mode in production): once vLLM evicted its own
    copy, kvshim restores the attention chunks and the state at 192."""
    h, r = hybrid(jamba_specs(), prefix_caching=True, mamba_cache_mode="align")
    restore_after_vllm_evicts(h, r, fillers=10, max_tokens=2)
    assert r.state_errors == [] and all(not e for e in r.load_errors)
    assert_clean(h)


def test_attention_free_mamba_model_restores_its_state(hybrid):
    """An attention-free model (Mamba-2/Falcon-Mamba style): vLLM makes one
    MambaSpec group, and kvshim describes it as a group list of one (its
    namespace says "mamba"), so Go applies the Mamba rule and reads vLLM's
    null block (id 0 in the single-group block lists) as no state. A's
    prefill stops at 192 (the last block boundary before its 197-token
    prompt's end): only the state at 192 exists and is saved. B (A's 192
    tokens and 9 more) restores it, byte for byte, into its own block, and
    its first step reads it. C (A's first 150 tokens) and D (exactly A's
    192 tokens: a hit must stop short of the prompt, at 128, where no state
    was kept) miss."""
    import json

    h, r = hybrid(mamba_only_specs(), mamba_cache_mode="align", groups=1)
    assert [type(sp).__name__ for sp in r.specs] == ["MambaSpec"] and r.state_groups == {0}
    cfg = h.scheduler.vllm_config
    assert h.scheduler.need_mamba_block_aligned_split
    ns = connector_config(cfg, r.kv_cache_config, KVConnectorRole.WORKER)["open"]["namespace"]
    layout = json.loads(ns["layout"])
    assert [g["kind"] for g in layout["groups"]] == ["mamba"] and layout["spec"] == "MambaSpec", layout
    assert ns["kv_group"] == 0
    p = prompt(31, 3 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=60))
    s = run_until_scheduled(h, a)
    assert s.num_scheduled_tokens[a.request_id] == 3 * CHUNK
    h.step()  # A's last 5 prompt tokens
    wait_jobs(h)
    assert mamba_saved(h, a.request_id, r) == {0: [2]}
    (sv,) = saves_of(h, a.request_id)
    assert sv["blocks"][:3] == [-1, -1, -1] and sv["blocks"][3] > 0, sv  # the block ending at 192, never block 0

    r.scribble()  # only a load can bring the bytes back
    q = p[: 3 * CHUNK] + prompt(32, 9)
    b = h.add_request(h.make_request(q, max_tokens=2))
    s = run_until_scheduled(h, b)
    hit = 3 * CHUNK
    assert new_req_data(s, b.request_id).num_computed_tokens == hit
    (ld,) = [ld for st in h.steps for ld in loads_of(st, b.request_id)]
    assert ld.get("group", 0) == 0 and (ld["start"], ld["end"]) == (0, 1) and len(ld["hashes"]) == 1, ld
    assert ld["blocks"][:3] == [-1, -1, -1] and ld["blocks"][3] > 0, ld
    rb = r.reqs[b.request_id]
    (a_blocks,) = [set(ids) - {0} for ids in h.scheduler.kv_cache_manager.get_block_ids(a.request_id)]
    n, wrong = rb.first_check
    assert n == hit and wrong == {0: []}, wrong
    # vLLM's blocks for a hit of 192: null up to the state block, which is B's own
    assert all(x == 0 for x in rb.blocks[0][: hit // BLOCK - 1]) and rb.blocks[0][hit // BLOCK - 1] not in a_blocks | {0}
    assert ld["blocks"][3] == rb.blocks[0][hit // BLOCK - 1]
    h.settle(until=lambda st: b.request_id in st.scheduler_output.finished_req_ids)
    # (A reads the state the scribble wiped: no request but A's is wrong)
    assert {rid for rid, _ in r.state_errors} <= {a.request_id} and all(not e for e in r.load_errors)

    for seed, toks in ((33, p[:150] + prompt(33, 9)), (34, p[: 3 * CHUNK])):
        m = h.add_request(h.make_request(toks, max_tokens=1))
        s = run_until_scheduled(h, m)
        assert new_req_data(s, m.request_id).num_computed_tokens == 0, seed
        assert not [ld for st in h.steps for ld in loads_of(st, m.request_id)], seed
    h.abort(a.request_id)
    h.settle()
    assert {rid for rid, _ in r.state_errors} <= {a.request_id} and all(not e for e in r.load_errors)
    assert_clean(h)


def test_attention_free_mamba_multiturn_with_vllms_prefix_cache_on(hybrid):
    """An attention-free model as it runs in "align" mode in production
    (prefix caching on: vLLM's UnitaryKVCacheCoordinator over one
    MambaManager). Turn 1 (133-token prompt, 128 tokens of answer) keeps
    the state at 128 (prefill) and at 192 and 256 (decode), each saved once
    computed; its blocks at 64 are the null block and saved never. Once
    vLLM evicted its own copy, turn 2 (turn 1 + a question) restores the
    state at 256 alone."""
    h, r = hybrid(mamba_only_specs(), prefix_caching=True, mamba_cache_mode="align", groups=1)
    assert type(h.scheduler.kv_cache_manager.coordinator).__name__ == "UnitaryKVCacheCoordinator"
    p = prompt(41, 2 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=2 * CHUNK))
    h.settle()
    turn1 = p + h.outputs[a.request_id]
    assert len(turn1) == 4 * CHUNK + 5
    assert sorted(mamba_saved(h, a.request_id, r)[0]) == [1, 2, 3]
    for i in range(10):  # other prompts fill the pool: vLLM's cached state blocks of turn 1 are evicted
        h.add_request(h.make_request(prompt(60 + i, 5 * CHUNK), max_tokens=1))
        h.settle()
    r.scribble()
    b = h.add_request(h.make_request(turn1 + prompt(42, 9), max_tokens=1))
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 4 * CHUNK
    n, wrong = r.reqs[b.request_id].first_check
    assert n == 4 * CHUNK and wrong == {0: []}, wrong
    (ld,) = [ld for st in h.steps for ld in loads_of(st, b.request_id)]
    assert len(ld["hashes"]) == 1 and ld["blocks"][:3] == [-1, -1, -1], ld  # the state at 256 alone
    h.settle()
    assert r.state_errors == [] and all(not e for e in r.load_errors)
    assert_clean(h)


def test_lone_sliding_window_group_saves_only_its_window(hybrid):
    """A model whose every layer has the same sliding window (HMA on: vLLM
    keeps SlidingWindowSpec) makes one KV-cache group that frees blocks
    behind its window, as a windowed group of a hybrid does: its block
    lists hold vLLM's null block (id 0) below the window. kvshim describes
    it as a group list of one, so Go applies the window rule: A's objects
    hold only the blocks inside the window at each chunk's end, never block
    0, and B restores the window's blocks byte for byte into its own."""
    import json

    specs = {layer(i): SlidingWindowSpec(sliding_window=40, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                         dtype=torch.float16) for i in range(4)}
    h, r = hybrid(specs, groups=1)
    assert [type(sp).__name__ for sp in r.specs] == ["SlidingWindowSpec"]
    cfg = h.scheduler.vllm_config
    ns = connector_config(cfg, r.kv_cache_config, KVConnectorRole.WORKER)["open"]["namespace"]
    assert [g["kind"] for g in json.loads(ns["layout"])["groups"]] == ["sliding_window"], ns["layout"]
    p = prompt(41, 3 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=60))
    run_until_scheduled(h, a)
    h.step()
    wait_jobs(h)
    svs = saves_of(h, a.request_id)
    assert svs and all(b != 0 for sv in svs for b in sv["blocks"]), svs  # never the null block
    spec = r.specs[0]
    for sv in svs:
        for c, first in zip(range(sv["first"], 3), range(0, len(sv["blocks"]), CHUNK // BLOCK)):
            ids = sv["blocks"][first : first + CHUNK // BLOCK]
            lo = max(c * CHUNK, skipped(spec, (c + 1) * CHUNK - 1)) // BLOCK - c * CHUNK // BLOCK
            assert all(b == -1 for b in ids[:lo]) and all(b > 0 for b in ids[lo:]), (c, ids)

    r.scribble()
    b = h.add_request(h.make_request(p[: 3 * CHUNK] + prompt(42, 9), max_tokens=1))
    s = run_until_scheduled(h, b)
    hit = 3 * CHUNK
    assert new_req_data(s, b.request_id).num_computed_tokens == hit
    rb = r.reqs[b.request_id]
    n, wrong = rb.first_check
    assert n == hit and wrong == {0: []}, wrong
    first_real = skipped(spec, hit) // BLOCK
    (a_blocks,) = [set(ids) - {0} for ids in h.scheduler.kv_cache_manager.get_block_ids(a.request_id)]
    assert set(rb.blocks[0][first_real : hit // BLOCK]).isdisjoint(a_blocks | {0})
    assert all(not e for e in r.load_errors)
    h.abort(a.request_id)
    h.settle()
    assert_clean(h)
