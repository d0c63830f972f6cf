"""TP=2: one scheduler process (this one: vLLM's real Scheduler, the
SCHEDULER-role KVShimConnector and its embedded server) and two worker
processes (multiprocessing "spawn", kvshim_tp_worker.serve), each loading
libkvshim.so itself and registering its own CPU KV tensors (standing in for
GPU memory; FlashAttention shape with 1 of the model's 2 KV heads) under its
rank (vllm_config.parallel_config.rank). Scheduler outputs go to both ranks
pickled, as vLLM's multiproc executor sends them; their connector outputs
are combined by vLLM's KVOutputAggregator. Each rank's "model" writes
rank-specific bytes, so a rank that got the other rank's chunk would fail
the byte check. Nothing of vLLM is stubbed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import uuid
from typing import Any

import pytest

from harness import (
    CHUNK,
    NUM_KV_HEADS,
    Proc,
    Ranks,
    WorldHarness,
    kvshim_config,
    loads_of,
    make_kv_cache_config,
    new_req_data,
    prompt,
    released,
    run_until_scheduled,
    wait_stat,
)

TP = 2
NUM_BLOCKS = 128
CFG_KW: dict[str, Any] = {"enable_prefix_caching": False, "max_num_batched_tokens": 2 * CHUNK}


class _Rank:
    """One rank of a Ranks, as these tests address it: rank, call(cmd, ...)."""

    def __init__(self, ranks: Ranks, rank: int) -> None:
        self.ranks, self.rank = ranks, rank

    def call(self, cmd: str, *args: Any) -> Any:
        return self.ranks.call(self.rank, cmd, *args)


@pytest.fixture
def tp(tiny_model_dir):
    engine_id = f"tp-{uuid.uuid4().hex[:12]}"
    ctx = multiprocessing.get_context("spawn")
    procs = [Proc(ctx, rank) for rank in range(TP)]  # each rank in a process of its own
    h = None
    try:
        for p in procs:
            p.recv(timeout=180)
        ranks = Ranks(procs, TP)
        ranks.setup(tiny_model_dir, engine_id, {"tp": TP}, NUM_BLOCKS, CFG_KW)
        cfg = kvshim_config(tiny_model_dir, tensor_parallel_size=TP, rank=0, engine_id=engine_id, **CFG_KW)
        assert cfg.parallel_config.world_size == TP
        kvc = make_kv_cache_config(num_blocks=NUM_BLOCKS, num_kv_heads=NUM_KV_HEADS // TP)
        h = WorldHarness(cfg, kvc, ranks)
        yield h, [_Rank(ranks, rk) for rk in range(TP)]
    finally:
        for p in procs:  # the ranks' connectors first, then the scheduler's (its embedded server)
            with contextlib.suppress(Exception):
                p.call("teardown")
        if h is not None:
            h.close()
        for p in procs:
            p.close()


def _store(h, runners, tokens, skip_rank1_save_in_step=None):
    """Chunked prefill: 128 tokens per step, so chunks 0-1 are saved after
    step 1 and chunk 2 after step 2."""
    if skip_rank1_save_in_step is not None:
        runners[1].call("skip_save_in", skip_rank1_save_in_step)
    req = h.add_request(h.make_request(tokens, max_tokens=1))
    s1 = h.step()
    assert s1.num_scheduled_tokens[req.request_id] == 2 * CHUNK
    s2 = h.step()
    assert s2.num_scheduled_tokens[req.request_id] == len(tokens) - 2 * CHUNK
    h.settle()
    return req


def test_tp2_each_rank_restores_its_own_bytes_and_hits_fold(tp):
    h, runners = tp
    p1, p2 = prompt(31, 200), prompt(32, 200)  # 3 full chunks each
    _store(h, runners, p1)
    wait_stat(h, "kvshim_l1_commits_total", 3 * TP)
    # p2: rank 1 loses its save of chunk 2 (dropped in the second step):
    # rank 0 has 3 chunks, rank 1 has 2.
    _store(h, runners, p2, skip_rank1_save_in_step=2)
    wait_stat(h, "kvshim_l1_commits_total", 3 * TP + 3 + 2)
    runners[0].ranks.wait_idle()
    saved = [r.call("stats")["worker"]["SavedChunks"] for r in runners]
    assert saved == [6, 5]
    h.assert_no_leaks()
    for r in runners:
        r.call("scribble")

    # Both ranks have all 3 chunks of p1: a hit of 192 tokens, each rank
    # restoring its own bytes into blocks other than the ones it saved from.
    q1 = p1 + prompt(33, 30)
    b1 = h.add_request(h.make_request(q1, max_tokens=1))
    s = h.step()
    (ld,) = loads_of(s, b1.request_id)
    assert (ld["start"], ld["end"]) == (0, 3)
    s = run_until_scheduled(h, b1)
    assert new_req_data(s, b1.request_id).num_computed_tokens == 3 * CHUNK
    assert s.num_scheduled_tokens[b1.request_id] == len(q1) - 3 * CHUNK
    for r in runners:
        blocks = r.call("blocks", b1.request_id)
        assert blocks[:12] == ld["blocks"]
        assert r.call("check_blocks", q1, blocks[:14]) == [], f"rank {r.rank}"
    h.settle()

    # p2: rank 0 has 3 chunks, rank 1 has 2 -> every rank skips 2 chunks.
    q2 = p2 + prompt(34, 30)
    b2 = h.add_request(h.make_request(q2, max_tokens=1))
    s = h.step()
    (ld,) = loads_of(s, b2.request_id)
    assert (ld["start"], ld["end"]) == (0, 2)
    s = run_until_scheduled(h, b2)
    assert new_req_data(s, b2.request_id).num_computed_tokens == 2 * CHUNK
    assert s.num_scheduled_tokens[b2.request_id] == len(q2) - 2 * CHUNK
    for r in runners:
        blocks = r.call("blocks", b2.request_id)
        assert r.call("check_blocks", q2, blocks[:14]) == [], f"rank {r.rank}"
    h.settle()
    h.assert_no_leaks()
    st = released(h)
    assert st["kvshim_lookup_hit_chunks_total"] == 3 + 2
    loaded = [r.call("stats")["worker"]["LoadedChunks"] for r in runners]
    assert loaded == [5, 5]
