"""Lookup cost at TP=8 and 128K tokens, measured from Python (a bench, not a
test: it prints, it asserts nothing about time).

    KVSHIM_LIBRARY=$PWD/out/libkvshim.so PYTHONPATH=$PWD/python \\
        $venv/bin/python tests/vllm/bench_lookup_tp8.py [--tokens 131072] [--reps 5]

Setup: vLLM's real Scheduler with the SCHEDULER-role KVShimConnector
(embedded server) for TP=8, and eight WORKER-role connectors (one per rank,
each with its own VllmConfig, rank and CPU KV tensors from vLLM's
allocate_kv_cache; all in this process to keep the machine's load small).
A 128K-token prompt is prefilled and saved (512 chunks of 256 tokens on each
of the 8 ranks: 4,096 objects), then the same prompt is looked up through
KVShimConnector.get_num_new_matched_tokens, the call vLLM's scheduler makes:

- first call: chunk keys of 128K tokens (SHA-256 chain) + LOOKUP submit;
- polls until the answer is final (the server checks 512 chunks x 8 ranks
  and takes read holds), with their count and the wall time to the answer;
- a miss of a different 128K prompt, for comparison.
Each lookup's holds are released the way vLLM's calls do
(update_state_after_alloc with 0 external tokens, request_finished).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for p in (str(_HERE.parent.parent / "python"), str(_HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128 * 1024)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from harness import (
        HEAD_SIZE,
        TINY_LLAMA_CONFIG,
        ModelRunner,
        SchedulerHarness,
        make_vllm_config,
        prompt,
        server_stats,
    )
    from kvshim_tp_worker import stage_kv_cache_config, stage_layers

    d = Path(tempfile.mkdtemp(prefix="kvshim-bench-"))
    cfg = dict(TINY_LLAMA_CONFIG, num_attention_heads=8, hidden_size=8 * HEAD_SIZE, num_hidden_layers=1,
               max_position_embeddings=a.tokens + 1024)
    (d / "config.json").write_text(json.dumps(cfg))
    engine_id = "bench-tp8"
    batch = 16384
    blocks = a.tokens // 16 + 64
    extra = {"kvshim.chunk_size": a.chunk, "kvshim.l1_size_gb": 0.5, "kvshim.l1_prefault_gb": 0,
             "kvshim.timeout_ms": 10000}

    def config(rank: int):
        return make_vllm_config(d, kv_connector_extra_config=extra, enable_prefix_caching=False,
                                max_num_batched_tokens=batch, max_model_len=a.tokens + 1024,
                                tensor_parallel_size=a.tp, rank=rank, engine_id=engine_id, async_scheduling=False)

    kvc = stage_kv_cache_config(blocks, stage_layers(1, 0, a.tp, 1), 1)
    t0 = time.perf_counter()
    runners = [ModelRunner(config(rk), stage_kv_cache_config(blocks, stage_layers(1, rk, a.tp, 1), 1), rank=rk)
               for rk in range(a.tp)]
    h = SchedulerHarness(config(0), kvc, runners=runners)
    print(f"setup: {a.tp} ranks, {blocks} blocks each: {time.perf_counter() - t0:.1f} s")
    try:
        toks = prompt(71, a.tokens)
        t0 = time.perf_counter()
        h.add_request(h.make_request(toks, max_tokens=1))
        h.settle(timeout_s=600)
        n_chunks = a.tokens // a.chunk
        deadline = time.monotonic() + 120
        while server_stats(h.connector)["kvshim_l1_commits_total"] < n_chunks * a.tp:
            assert time.monotonic() < deadline, "saves not committed"
            time.sleep(0.01)
        print(f"prefill + save of {a.tokens} tokens on {a.tp} ranks ({n_chunks * a.tp} objects): "
              f"{time.perf_counter() - t0:.1f} s")

        conn = h.kvshim
        empty = KVCacheBlocks(tuple([] for _ in kvc.kv_cache_groups))

        def lookup(tokens, rid):
            req = h.make_request(tokens, max_tokens=1, request_id=rid)
            t = time.perf_counter()
            n, _ = conn.get_num_new_matched_tokens(req, 0)
            first = time.perf_counter() - t
            polls, poll_s = 0, 0.0
            while n is None:
                tp = time.perf_counter()
                n, _ = conn.get_num_new_matched_tokens(req, 0)
                poll_s += time.perf_counter() - tp
                polls += 1
            total = time.perf_counter() - t
            conn.update_state_after_alloc(req, empty, 0)  # releases the holds
            conn.request_finished(req, [])
            return n, first, polls, poll_s, total

        for kind, tokens in (("hit", toks), ("miss", prompt(72, a.tokens))):
            rows = [lookup(tokens, f"{kind}-{i}") for i in range(a.reps)]
            n = rows[0][0]
            med = lambda k: sorted(r[k] for r in rows)[len(rows) // 2]  # noqa: E731, B023 - used at once, in this iteration
            print(f"lookup {kind}: {n} tokens matched; first call (keys + submit) median {med(1) * 1e3:.2f} ms, "
                  f"polls until final median {med(2)} (their CPU {med(3) * 1e3:.2f} ms), "
                  f"wall to the final answer median {med(4) * 1e3:.2f} ms "
                  f"[all: {', '.join(f'{r[4] * 1e3:.1f}' for r in rows)} ms]")
        st = server_stats(conn)
        assert st["kvshim_l1_holds"] == 0 and st["kvshim_lookups_live"] == 0, st
    finally:
        h.close()


if __name__ == "__main__":
    main()
