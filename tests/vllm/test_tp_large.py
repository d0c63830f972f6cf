"""TP=4, TP=8 and TP=4 x PP=2 (8 ranks): the fold across ranks and each
rank's own objects, as test_tp.py does for TP=2.

One scheduler process (this one: vLLM's real Scheduler, the SCHEDULER-role
KVShimConnector and its embedded server) and two spawned worker processes
(kvshim_tp_worker.serve), each hosting half of the ranks: per rank its own
VllmConfig (parallel_config.rank = vLLM's global rank, pp_rank * TP +
tp_rank), its own KVCacheConfig (a pipeline stage lists only its own layers,
split by vLLM's get_pp_indices), its own CPU KV tensors from vLLM's
allocate_kv_cache, its own WORKER-role KVShimConnector (own server session).
Two processes, not eight: eight interpreters importing torch and vLLM are
more than this 2-core machine runs in well under a minute (see
kvshim_tp_worker.py). Scheduler outputs go to the processes pickled, as
vLLM's multiproc executor sends them; the ranks' connector outputs are
combined by vLLM's KVOutputAggregator over the whole world (with PP, vLLM
aggregates every rank's KV connector output, not only the last stage's).
Each rank writes rank-specific bytes, so a rank that got another rank's
chunk fails the byte check.

The model has 3 layers, so PP=2 splits them 2 + 1 (vLLM's split): the
stages' KV differs in size, and the scheduler (built, as in vLLM's
EngineCore, from rank 0's KV cache config: generate_scheduler_kv_cache_config)
sees only stage 0's layers.
"""

from __future__ import annotations

import json
import multiprocessing
import uuid
from typing import Any

import pytest

from harness import (
    CHUNK,
    HEAD_SIZE,
    TINY_LLAMA_CONFIG,
    Proc,
    Ranks,
    WorldHarness,
    kvshim_config,
    loads_of,
    new_req_data,
    prompt,
    released,
    run_until_scheduled,
    wait_stat,
)

NUM_BLOCKS = 64
LAYERS = 3
CFG_KW: dict[str, Any] = {"enable_prefix_caching": False, "max_num_batched_tokens": 2 * CHUNK}


@pytest.fixture(scope="module")
def model8(tmp_path_factory):
    """A tiny Llama with 8 attention heads (TP=8 needs them) over 2 KV heads
    (vLLM replicates them: 1 per rank at TP 4 and 8) and 3 layers."""
    d = tmp_path_factory.mktemp("tiny-llama-8h")
    cfg = dict(TINY_LLAMA_CONFIG, num_attention_heads=8, hidden_size=8 * HEAD_SIZE, num_hidden_layers=LAYERS)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    """A tiny DeepSeek-V2 config (vLLM's use_mla: a 48-element latent a
    token, 32 kv_lora_rank + 16 rope) with 3 layers; no weights."""
    d = tmp_path_factory.mktemp("tiny-deepseek")
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 128,
        "intermediate_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_hidden_layers": LAYERS, "vocab_size": 1024, "max_position_embeddings": 8192, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": LAYERS, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "rope_theta": 10000,
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


@pytest.fixture(scope="module")
def procs():
    ctx = multiprocessing.get_context("spawn")
    ps = [Proc(ctx, i) for i in range(2)]
    try:
        for p in ps:
            p.recv(timeout=180)
        yield ps
    finally:
        for p in ps:
            p.close()


PARALLEL: dict[str, dict[str, Any]] = {
    "tp4": {"tp": 4, "pp": 1},
    "tp8": {"tp": 8, "pp": 1},
    "tp4pp2": {"tp": 4, "pp": 2},
    # decode context parallel: DCP groups {0,1} {2,3}, each rank a token
    # slice of every 32-token scheduler block (vLLM needs TP > KV heads)
    "tp4dcp2": {"tp": 4, "pp": 1, "dcp": 2, "runner_cls": "kvshim_tp_worker:DCPRunner"},
    # MLA: one object per chunk written by rank 0 and read by both ranks
    "mla_tp2": {"tp": 2, "pp": 1, "mla": True},
    # MLA under DCP: each rank a token slice, so each rank its own objects
    "mla_tp4dcp2": {"tp": 4, "pp": 1, "dcp": 2, "mla": True, "runner_cls": "kvshim_tp_worker:DCPRunner"},
}


@pytest.fixture(params=list(PARALLEL))
def world(request, procs, model8, mla_model):
    par = PARALLEL[request.param]
    model = mla_model if par.get("mla") else model8
    tp, pp = par["tp"], par["pp"]
    w = tp * pp
    engine_id = f"tpl-{uuid.uuid4().hex[:12]}"
    ranks = Ranks(procs, w)
    ranks.setup(model, engine_id, par, NUM_BLOCKS, CFG_KW)
    h = None
    try:
        from kvshim_tp_worker import stage_kv_cache_config, stage_layers

        cfg = kvshim_config(model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            decode_context_parallel_size=par.get("dcp", 1), rank=0, engine_id=engine_id, **CFG_KW)
        assert cfg.parallel_config.world_size == w
        # the scheduler's KV cache config is rank 0's (stage 0's layers)
        mla = cfg.model_config.use_mla
        assert mla == bool(par.get("mla"))
        kvc = stage_kv_cache_config(NUM_BLOCKS, stage_layers(LAYERS, 0, tp, pp), 1,
                                    mla_head_size=cfg.model_config.get_head_size() if mla else 0)
        h = WorldHarness(cfg, kvc, ranks)
        yield h, ranks, par
    finally:
        if h is not None:
            h.close()
        for p in procs:
            p.call("teardown")


def _store(h, ranks, tokens, skip_save=None):
    """Chunked prefill, 128 tokens a step: chunks 0-1 saved after step 1,
    chunk 2 after step 2. skip_save=(rank, step): that rank drops its
    saves of that step."""
    if skip_save is not None:
        ranks.call(skip_save[0], "skip_save_in", skip_save[1])
    req = h.add_request(h.make_request(tokens, max_tokens=1))
    s1 = h.step()
    assert s1.num_scheduled_tokens[req.request_id] == 2 * CHUNK
    s2 = h.step()
    assert s2.num_scheduled_tokens[req.request_id] == len(tokens) - 2 * CHUNK
    h.settle()
    return req


def _restore(h, ranks, tokens, hit_chunks, vblock=16):
    b = h.add_request(h.make_request(tokens, max_tokens=1))
    s = h.step()
    (ld,) = loads_of(s, b.request_id)
    assert (ld["start"], ld["end"]) == (0, hit_chunks)
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == hit_chunks * CHUNK
    assert s.num_scheduled_tokens[b.request_id] == len(tokens) - hit_chunks * CHUNK
    nb = len(tokens) // vblock  # the scheduler's blocks (DCP: vblock tokens)
    for rk in range(ranks.world):
        blocks = ranks.call(rk, "blocks", b.request_id)
        assert blocks[: hit_chunks * CHUNK // vblock] == ld["blocks"]
        assert ranks.call(rk, "check_blocks", tokens, blocks[:nb]) == [], f"rank {rk}"
    h.settle()


def test_each_rank_restores_its_own_bytes_and_hits_fold(world):
    h, ranks, par = world
    w = ranks.world
    # the ranks that write: all, or rank 0 alone for MLA shared by every
    # rank (one stage, no DCP)
    shared = par.get("mla") and w == par["tp"] and par.get("dcp", 1) == 1
    writers = [0] if shared else list(range(w))
    p1, p2 = prompt(61, 200), prompt(62, 200)  # 3 full chunks each
    _store(h, ranks, p1)
    wait_stat(h, "kvshim_l1_commits_total", 3 * len(writers))
    # p2: the last writer (a stage-1 rank under PP) loses its save of
    # chunk 2: every other rank has 3 chunks, it has 2.
    _store(h, ranks, p2, skip_save=(writers[-1], 2))
    wait_stat(h, "kvshim_l1_commits_total", 6 * len(writers) - 1)
    ranks.wait_idle()
    saved = [ranks.call(rk, "stats")["worker"]["SavedChunks"] for rk in range(w)]
    assert saved == [6 if rk in writers[:-1] else 5 if rk == writers[-1] else 0 for rk in range(w)]
    h.assert_no_leaks()
    for rk in range(w):
        ranks.call(rk, "scribble")
    vb = 16 * par.get("dcp", 1)
    _restore(h, ranks, p1 + prompt(63, 30), hit_chunks=3, vblock=vb)
    # every rank skips 2 chunks of p2: the fold over all 8 (or 4) ranks
    _restore(h, ranks, p2 + prompt(64, 30), hit_chunks=2, vblock=vb)
    h.assert_no_leaks()
    st = released(h)
    staged = {k: v for k, v in st.items() if "stag" in k and not k.endswith("_total")}
    assert staged and not any(staged.values()), staged
    assert st["kvshim_lookup_hit_chunks_total"] == 3 + 2
    assert h.kvshim.scheduler.stats().requests == 0
    loaded = [ranks.call(rk, "stats")["worker"]["LoadedChunks"] for rk in range(w)]
    assert loaded == [5] * w
    if par.get("dcp", 1) > 1:
        # a scheduler block is 2 ranks' blocks, a rank holds half its tokens
        assert h.scheduler.block_size == 32
    if par["pp"] > 1:
        # the stages hold different layers: 2 and 1 of the 3
        assert [len(ranks.call(rk, "attr", "layer_names")) for rk in (0, w - 1)] == [2, 1]
