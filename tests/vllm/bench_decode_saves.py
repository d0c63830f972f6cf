"""Would saves at chunk boundaries during long decodes pay off? A
measurement, not a test (issue 14, item "saves at chunk boundaries during
long decodes, if the measurement says it is worth it").

    KVSHIM_LIBRARY=$PWD/out/libkvshim.so PYTHONPATH=$PWD/python \\
        $venv/bin/python tests/vllm/bench_decode_saves.py

kvshim saves a request's prompt chunks after its prefill and every other
full chunk it computed (its answer's) when it finishes. A chunk completed
during the decode is therefore lost when the request is preempted (vLLM
drops its blocks and recomputes prompt + answer on resume) or aborted. This
runs vLLM's real scheduler with KVShimConnector under memory pressure (long
decodes, a KV cache too small for all requests) and counts, at every
preemption, the full chunks of generated tokens the request had computed
that no save covered: what saves at decode chunk boundaries would have
turned from recompute into loads. It reports them against all the tokens
the engine computed. (Saving them during the decode writes no extra bytes
for requests that finish normally: the same chunks are saved at the finish
today.)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for p in (str(_HERE.parent.parent / "python"), str(_HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(num_blocks: int, n_req: int, prompt_len: int, max_tokens: int) -> None:
    from harness import (
        CHUNK,
        ModelRunner,
        SchedulerHarness,
        kvshim_config,
        make_kv_cache_config,
        prompt,
        write_tiny_model_dir,
    )

    d = write_tiny_model_dir(tempfile.mkdtemp(prefix="kvshim-decode-"))
    cfg = kvshim_config(d, enable_prefix_caching=False, async_scheduling=False)
    kvc = make_kv_cache_config(num_blocks=num_blocks)
    h = SchedulerHarness(cfg, kvc)
    h.runners = [ModelRunner(cfg, kvc)]
    try:
        reqs = [h.add_request(h.make_request(prompt(80 + i, prompt_len), max_tokens=max_tokens)) for i in range(n_req)]
        computed = {r.request_id: 0 for r in reqs}
        lost_chunks = preemptions = total = recomputed = 0
        for _ in range(20000):
            if not h.scheduler.has_requests():
                break
            before = {r.request_id: r.num_computed_tokens for r in reqs}
            s = h.step()
            total += sum(s.num_scheduled_tokens.values())
            for rid in s.scheduler_output.preempted_req_ids or ():
                preemptions += 1
                prompt_chunks = prompt_len // CHUNK
                done = before[rid] // CHUNK
                lost_chunks += max(0, done - prompt_chunks)
                recomputed += before[rid]
            for r in reqs:
                computed[r.request_id] = max(computed[r.request_id], r.num_computed_tokens)
        needed = n_req * (prompt_len + max_tokens - 1)
        print(f"{n_req} requests x ({prompt_len} prompt + {max_tokens} decode), {num_blocks} blocks of 16: "
              f"{preemptions} preemptions; tokens computed {total} (minimum {needed}); "
              f"recomputed after preemption {recomputed} tokens (of which prompt chunks restored by kvshim: "
              f"{preemptions * (prompt_len // CHUNK) * CHUNK}); generated full chunks lost at preemption: "
              f"{lost_chunks} = {lost_chunks * CHUNK} tokens = {100 * lost_chunks * CHUNK / total:.1f} % of all computed")
    finally:
        h.close()


if __name__ == "__main__":
    for args in ((64, 4, 150, 400), (128, 8, 300, 600), (96, 4, 1000, 200)):
        run(*args)
