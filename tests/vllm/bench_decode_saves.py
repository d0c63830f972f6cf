"""How much recompute do saves at chunk boundaries during long decodes
remove? A measurement, not a test.

    KVSHIM_LIBRARY=$PWD/out/libkvshim.so PYTHONPATH=$PWD/python \\
        $venv/bin/python tests/vllm/bench_decode_saves.py

kvshim saves a request's prompt chunks after its prefill, each chunk its
decode completes once its KV is computed, and what is left at the finish. A
preempted request (vLLM drops its blocks and recomputes prompt + answer on
resume) is looked up over all its tokens, so the chunks saved during its
decode are loads. This runs vLLM's real scheduler with KVShimConnector under
memory pressure (long decodes, a KV cache too small for all requests), with
the decode-time saves on and off (MODES; off: KVShimScheduler._decoded_chunks
does nothing, i.e. the generated chunks are saved only at the finish, as
before), and reports the tokens the engine computed, the tokens loaded at resumes,
and, at every preemption, the full chunks of generated tokens the request
had computed that no save covered (recomputed on resume).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for path in (str(_HERE.parent.parent / "python"), str(_HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


MODES = {
    "before": "no decode saves, resumes looked up over the prompt (kvshim before this change)",
    "resume": "no decode saves, resumes looked up over all tokens",
    "on": "decode saves, resumes looked up over all tokens",
}


def run(num_blocks: int, n_req: int, prompt_len: int, max_tokens: int, mode: str) -> int:
    from harness import (
        CHUNK,
        ModelRunner,
        SchedulerHarness,
        kvshim_config,
        loads_of,
        make_kv_cache_config,
        prompt,
        wait_jobs,
        write_tiny_model_dir,
    )
    from kvshim.native import meta_json
    from kvshim.vllm import KVShimScheduler

    d = write_tiny_model_dir(tempfile.mkdtemp(prefix="kvshim-decode-"))
    cfg = kvshim_config(d, enable_prefix_caching=False, async_scheduling=False)
    kvc = make_kv_cache_config(num_blocks=num_blocks)
    orig = KVShimScheduler.__dict__["_decoded_chunks"], KVShimScheduler.__dict__["_lookup_ids"]
    if mode != "on":
        KVShimScheduler._decoded_chunks = lambda self, rid, entry: None  # type: ignore[method-assign]
    if mode == "before":
        KVShimScheduler._lookup_ids = staticmethod(lambda request: request.prompt_token_ids)  # type: ignore[method-assign]
    h = SchedulerHarness(cfg, kvc)
    h.runners = [ModelRunner(cfg, kvc)]
    try:
        reqs = [h.add_request(h.make_request(prompt(80 + i, prompt_len), max_tokens=max_tokens)) for i in range(n_req)]
        saved: dict[str, set[int]] = {r.request_id: set() for r in reqs}  # chunk indexes dispatched for saving
        lost_chunks = preemptions = total = loaded = 0
        for _ in range(20000):
            if not h.scheduler.has_requests():
                break
            before = {r.request_id: r.num_computed_tokens for r in reqs}
            s = h.step()
            total += sum(s.num_scheduled_tokens.values())
            for sv in meta_json(s.connector_meta.data).get("saves", []):
                saved[sv["req"]].update(range(sv["first"], sv["first"] + len(sv["hashes"])))
            for r in reqs:
                loaded += sum((ld["end"] - ld["start"]) * CHUNK for ld in loads_of(s, r.request_id))
            for rid in s.scheduler_output.preempted_req_ids or ():
                preemptions += 1
                done = before[rid] // CHUNK
                covered = next(c for c in range(done + 1) if c not in saved[rid])  # contiguous from 0
                lost_chunks += max(0, done - max(covered, prompt_len // CHUNK))
            wait_jobs(h)  # (the commits land before the next lookup, as on an idle server)
        print(f"  {mode:>6}: {preemptions} preemptions; tokens computed {total}; "
              f"loaded at resumes {loaded}; generated full chunks recomputed after preemption: {lost_chunks} "
              f"= {lost_chunks * CHUNK} tokens = {100 * lost_chunks * CHUNK / total:.1f} % of all computed")
        return total
    finally:
        KVShimScheduler._decoded_chunks, KVShimScheduler._lookup_ids = orig  # type: ignore[method-assign]
        h.close()


if __name__ == "__main__":
    for nb, n, p, m in ((64, 4, 150, 400), (128, 8, 300, 600), (96, 4, 1000, 200)):
        print(f"{n} requests x ({p} prompt + {m} decode), {nb} blocks of 16 (minimum {n * (p + m - 1)} tokens computed):")
        total = {mode: run(nb, n, p, m, mode) for mode in MODES}
        off, on = total["before"], total["on"]
        print(f"  on vs before: {off - on} fewer tokens computed = {100 * (off - on) / off:.1f} % of the engine's work")
