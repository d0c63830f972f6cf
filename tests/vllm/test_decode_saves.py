"""Saves at chunk boundaries during long decodes, through vLLM's real
scheduler: a running request whose KV crosses a chunk boundary
saves the chunk its decode completed, under the chained key its finish (and
a lookup of its whole token list) uses, so a request preempted in a long
decode resumes from those chunks (loads) instead of recomputing them; a
resumed request is looked up over all its tokens, prompt and generated.

Same setup as test_multiturn.py: 64-token chunks of 4 vLLM blocks of 16,
vLLM's prefix cache off, the harness's ModelRunner writing every computed
token's KV (a function of its prefix), restored blocks compared byte for
byte with what the model computes before the forward pass that follows the
load (ModelRunner.prefix_checks).
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.request import RequestStatus

from harness import CHUNK, assert_clean, loads_of, prompt, saves_of, server_stats, wait_jobs
from test_multiturn import turn2


def chunks_saved(h, req_id: str) -> list[int]:
    """The chunk indexes of every save of req_id, in dispatch order."""
    return [x["first"] + i for x in saves_of(h, req_id) for i in range(len(x["hashes"]))]


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_preempted_long_decode_resumes_from_its_decode_saves(kv, pipelined):
    # 2 requests of 150 prompt tokens (2 full chunks + 22) decoding 300
    # tokens each, in 35 usable blocks (both need 29 at the end): vLLM
    # preempts B (the last running) in the middle of its decode, with
    # generated chunks whose KV it computed. pipelined: vLLM's
    # AsyncScheduler with overlapped batches (a step's tokens are in flight
    # while the next is scheduled: never saved before they are processed).
    h, r = kv(num_blocks=36, async_scheduling=pipelined)
    a = h.add_request(h.make_request(prompt(61, 150), max_tokens=300))
    b = h.add_request(h.make_request(prompt(62, 150), max_tokens=300))
    h.settle(pipelined=pipelined, until=lambda s: b.request_id in (s.scheduler_output.preempted_req_ids or ()))
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    # Saved: the prompt's 2 chunks after its prefill, then each generated
    # chunk during the decode, once.
    k = len(chunks_saved(h, b.request_id))
    assert chunks_saved(h, b.request_id) == list(range(k))
    assert saves_of(h, b.request_id)[0]["first"] == 0 and len(saves_of(h, b.request_id)[0]["hashes"]) == 2
    assert k >= 4, k  # the decode completed at least 2 chunks
    assert len(b.all_token_ids) > k * CHUNK
    wait_jobs(h)
    # The blocks those chunks were saved from that no request holds now are
    # overwritten: only a load brings their bytes back.
    b_blocks = [x for sv in saves_of(h, b.request_id) for x in sv["blocks"]]
    held = {x for q in r.reqs.values() for x in q.blocks}
    for t in r.kv_caches.values():
        t.view(torch.int16)[[x for x in b_blocks if x not in held]] = -21846

    # B resumes (when A is done): its lookup over all its tokens hits every
    # saved chunk, the generated ones included, loaded byte-exact into the
    # blocks vLLM gives it now (checked before the forward pass that
    # follows); it recomputes only the rest.
    steps = h.settle(pipelined=pipelined, until=lambda s: b.request_id in s.num_scheduled_tokens)
    (ld,) = [x for s in steps for x in loads_of(s, b.request_id)]
    assert (ld["start"], ld["end"]) == (0, k)
    n, bad = r.prefix_checks[b.request_id]
    assert n == k * CHUNK and bad == [], (n, bad)
    assert ld["blocks"] != b_blocks
    st = server_stats(h.connector)
    assert st["kvshim_lookup_hit_chunks_total"] == k  # A's and B's first lookups missed
    assert r.kvshim.worker.stats().counters["LoadedChunks"] == k
    h.settle(pipelined=pipelined)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.outputs[b.request_id] == [7] * 300
    assert all(not e for e in r.load_errors)
    # Every chunk B computed is saved once, none twice: the restored ones
    # neither at the resume nor at the finish; 449 of its 450 tokens have KV.
    assert sorted(chunks_saved(h, b.request_id)) == list(range(449 // CHUNK))
    assert sorted(chunks_saved(h, a.request_id)) == list(range(449 // CHUNK))
    # and what B saved after its resume is right too
    turn2(h, r, list(b.all_token_ids) + prompt(63, 10), hit_chunks=449 // CHUNK)
    assert_clean(h)
