"""A real `vllm serve` whose KV cache is too small for its concurrent
requests, so the scheduler preempts running requests while their saves are
in flight: every request completes, kvshim loads no block that failed, and the
greedy tokens equal those of the same engine without kvshim.

Both servers get the same small cache (--num-gpu-blocks-override) and the
same requests; what is compared is the greedy tokens, not the logprobs: a
preempted request is recomputed (or, with kvshim, partly loaded) at points
that depend on timing, so its KV is computed in differently shaped steps and
bf16 rounding may differ in the last bits.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import Processes, VllmServer, kvshim_config, prompt_ids, warm_up

CHUNK = 256
BLOCKS = 20  # x 128 tokens, one the null block (the least --max-model-len 2048 starts with)
SMALL = ["--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "2048", "--max-num-seqs", "6"]
# Each request grows to 7 blocks (532 + 300 tokens): three are admitted (5 blocks of prompt
# each), and their decodes need 21 blocks of the 19: vLLM preempts.
N, PROMPT, OUT = 6, CHUNK * 2 + 20, 300


def _run(s: VllmServer) -> list[list[int]]:
    prompts = [prompt_ids(PROMPT, seed=300 + i) for i in range(N)]
    with ThreadPoolExecutor(N) as ex:
        rs = list(ex.map(lambda p: s.complete(p, max_tokens=OUT, logprobs=None), prompts))
    return [list(r["choices"][0]["token_ids"]) for r in rs]


@pytest.fixture(scope="module")
def servers(procs: Processes) -> tuple[VllmServer, VllmServer]:
    shim = procs.start_vllm("vllm-small-kvshim", kv=kvshim_config(), args=SMALL, wait=False)
    plain = procs.start_vllm("vllm-small-plain", args=SMALL, wait=False)
    shim.wait_ready()
    plain.wait_ready()
    for s in (shim, plain):
        warm_up(s, prompt_ids(CHUNK + 8, seed=996))
    return shim, plain


def test_preempted_requests_complete_and_match_the_run_without_kvshim(servers: tuple[VllmServer, VllmServer]) -> None:
    shim, plain = servers
    p0 = shim.metrics().get("vllm:num_preemptions_total", 0.0)
    got = _run(shim)
    preemptions = shim.metrics().get("vllm:num_preemptions_total", 0.0) - p0
    want = _run(plain)
    assert preemptions > 0, "the small cache forced no preemption: the test tests nothing"
    assert all(len(t) == OUT for t in got), [len(t) for t in got]
    assert got == want, [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    log = shim.log_text()
    assert "Traceback (most recent call last)" not in log, shim.tail()
    print(f"{preemptions:.0f} preemptions; external hits {shim.external_hits():.0f} tokens")
