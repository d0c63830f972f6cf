"""Hybrid models (vLLM's hybrid KV-cache manager, HMA) at TP=2 and 4: each rank
holds its slice of the KV heads of every KV-cache group, so every chunk has
one object per rank per group, and a hit is what every group of every rank
can restore (the fold across ranks and across groups).

One scheduler process (this one: vLLM's real Scheduler with one manager per
group, the SCHEDULER-role KVShimConnector and its embedded server) and one
spawned process hosting every rank (kvshim_tp_worker.serve; see
test_tp_large.py for why one process hosts several ranks): per rank its own
VllmConfig (parallel_config.rank), vLLM's KVCacheConfig of the hybrid
model's layers with its share of the 2 KV heads (get_kv_cache_groups,
get_kv_cache_config_from_groups), its own CPU KV tensors from vLLM's
allocate_kv_cache (the groups' layers view one buffer) and its own
WORKER-role KVShimConnector (harness.HybridModelRunner). Scheduler outputs
reach the ranks pickled; their connector outputs are combined by vLLM's
KVOutputAggregator. Each rank writes rank-specific bytes for every layer,
so a rank or a group that got another's object fails the byte check.
"""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import pytest
from vllm.v1.kv_cache_interface import FullAttentionSpec

from harness import (
    CHUNK,
    GEMMA3_LAYERS,
    LLAMA4_LAYERS,
    NUM_KV_HEADS,
    Proc,
    Ranks,
    WorldHarness,
    assert_clean,
    hybrid_kv_cache_config,
    hybrid_layer_specs,
    kvshim_config,
    loads_of,
    new_req_data,
    prompt,
    run_until_scheduled,
    skipped_tokens,
    wait_stat,
)

BLOCK = 16
NUM_BLOCKS = 160
# 129 tokens a step: 128 of a prefill next to another request's decode
CFG_KW: dict[str, Any] = {"enable_prefix_caching": False, "max_num_batched_tokens": 2 * CHUNK + 1}
LAYERS = {"gemma3": GEMMA3_LAYERS, "llama4": LLAMA4_LAYERS}
# (model, TP): TP=4 replicates the tiny Llama's 2 KV heads (1 a rank), each
# rank still writing its own bytes
WORLDS = [("gemma3", 2), ("llama4", 2), ("gemma3", 4)]


@pytest.fixture(scope="module")
def proc():
    p = Proc(multiprocessing.get_context("spawn"), 0)
    try:
        p.recv(timeout=180)
        yield p
    finally:
        p.close()


@pytest.fixture(params=WORLDS, ids=[f"{m}-tp{tp}" for m, tp in WORLDS])
def hybrid_tp(request, proc, tiny_model_dir):
    """(harness, ranks, specs): every rank in the spawned process, the
    scheduler here with rank 0's KV cache config (as vLLM's EngineCore)."""
    model, tp = request.param
    kinds = LAYERS[model]
    engine_id = f"hmatp-{uuid.uuid4().hex[:12]}"
    ranks = Ranks([proc], tp)
    ranks.setup(tiny_model_dir, engine_id, {"tp": tp, "hybrid": kinds}, NUM_BLOCKS, CFG_KW)
    h = None
    try:
        cfg = kvshim_config(tiny_model_dir, tensor_parallel_size=tp, rank=0, engine_id=engine_id, **CFG_KW)
        assert cfg.parallel_config.world_size == tp
        kvc = hybrid_kv_cache_config(cfg, hybrid_layer_specs(kinds, num_kv_heads=max(1, NUM_KV_HEADS // tp)), NUM_BLOCKS)
        h = WorldHarness(cfg, kvc, ranks)
        yield h, ranks, [g.kv_cache_spec for g in kvc.kv_cache_groups]
    finally:
        if h is not None:
            h.close()
        proc.call("teardown")


def store(h, ranks, tokens):
    """Chunked prefill, at least 128 tokens in step 1 (chunks 0-1 of every
    group saved), the rest in step 2 (chunk 2); the request keeps decoding
    (its blocks stay its own) until the test aborts it."""
    req = h.add_request(h.make_request(tokens, max_tokens=100))
    assert 2 * CHUNK <= h.step().num_scheduled_tokens[req.request_id] < 3 * CHUNK
    h.step()
    assert req.num_computed_tokens == len(tokens)
    h.step()  # its first decode
    ranks.wait_idle()
    return req


def restore(h, ranks, specs, stored, tokens, hit_chunks):
    """A request with tokens hits hit_chunks chunks: every group loads the
    chunks its window needs at the hit (a full group all of them), into
    blocks of its own (stored still runs and holds its blocks), and every
    rank holds its own bytes in every real block below the hit before
    vLLM computes the rest. Returns the chunks each rank loaded."""
    hit = hit_chunks * CHUNK
    held = [set(ids) - {0} for ids in h.scheduler.kv_cache_manager.get_block_ids(stored.request_id)]
    b = h.add_request(h.make_request(tokens, max_tokens=1))
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == hit
    assert s.num_scheduled_tokens[b.request_id] == len(tokens) - hit
    loads = {ld.get("group", 0): ld for st in h.steps for ld in loads_of(st, b.request_id)}
    for g, spec in enumerate(specs):
        first = skipped_tokens(spec, hit) // BLOCK  # vLLM's first real block at the hit
        if first >= hit // BLOCK:
            # nothing below the hit: no load, or an empty one (its lookup let go)
            assert g not in loads or (loads[g]["start"] == loads[g]["end"] == hit_chunks and not loads[g]["blocks"]), loads[g]
            continue
        ld = loads[g]
        assert (ld["start"], ld["end"]) == (first * BLOCK // CHUNK, hit_chunks), (g, spec, ld)
        real = [x for x in ld["blocks"] if x > 0]
        assert len(real) == hit // BLOCK - first and held[g] and held[g].isdisjoint(real), (g, real, held[g])
    for rk in range(ranks.world):
        checks = ranks.call(rk, "attr", "prefix_checks")
        assert checks[b.request_id] == (hit, {g: [] for g in range(len(specs))}), f"rank {rk}: {checks[b.request_id]}"
        assert not any(ranks.call(rk, "attr", "load_errors")), f"rank {rk}"
    h.settle(until=lambda st: b.request_id not in h.scheduler.requests)
    return sum(ld["end"] - ld["start"] for ld in loads.values())


def test_hybrid_each_rank_restores_every_group_and_hits_fold(hybrid_tp):
    h, ranks, specs = hybrid_tp
    tp = ranks.world
    ngroups = len(specs)
    assert len(h.scheduler.kv_cache_manager.coordinator.single_type_managers) == ngroups > 1
    windowed = [g for g, sp in enumerate(specs) if type(sp) is not FullAttentionSpec]
    assert windowed and len(windowed) < ngroups
    p1, p2 = prompt(71, 3 * CHUNK + 8), prompt(72, 3 * CHUNK + 8)  # 3 full chunks each
    a1 = store(h, ranks, p1)
    # one object per chunk, per group, per rank
    wait_stat(h, "kvshim_l1_commits_total", 3 * ngroups * tp)
    # p2: the last rank loses its save of one windowed group's chunk 2
    # (every other group of that rank and all of the others have 3 chunks)
    ranks.call(tp - 1, "drop_group_saves_in", 2, [windowed[0]])
    a2 = store(h, ranks, p2)
    wait_stat(h, "kvshim_l1_commits_total", 6 * ngroups * tp - 1)
    ranks.wait_idle()
    saved = [ranks.call(rk, "stats")["worker"]["SavedChunks"] for rk in range(tp)]
    assert saved == [6 * ngroups] * (tp - 1) + [6 * ngroups - 1]
    for rk in range(tp):
        ranks.call(rk, "scribble")  # only a load brings bytes back

    # p1: every group of every rank has 3 chunks: a hit of 192 tokens
    loaded = restore(h, ranks, specs, a1, p1[: 3 * CHUNK] + prompt(73, 30), hit_chunks=3)
    # p2: the group the last rank lacks at chunk 2 cannot restore its
    # window at 192, so every group of every rank stops at 128 (where that
    # group's window lies in chunks every rank has)
    loaded += restore(h, ranks, specs, a2, p2[: 3 * CHUNK] + prompt(74, 30), hit_chunks=2)
    # each rank loaded its own objects of the same chunks
    assert [ranks.call(rk, "stats")["worker"]["LoadedChunks"] for rk in range(tp)] == [loaded] * tp
    h.abort(a1.request_id, a2.request_id)
    h.settle()
    assert_clean(h)
