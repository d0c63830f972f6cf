"""Multi-turn chat through vLLM's real scheduler: a finished request saves
every full chunk it computed, prompt and generated alike, so turn 2 (turn
1's prompt + turn 1's answer + a new question) restores both from kvshim.

Same setup as test_connector.py: 64-token chunks of 4 vLLM blocks of 16,
vLLM's own prefix cache off, CPU KV tensors from vLLM's allocate_kv_cache
written by harness.ModelRunner (every computed token's KV, generated tokens
included, is a function of its prefix), restored blocks compared byte for
byte with what the model computes.
"""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from harness import (
    CHUNK,
    assert_clean,
    loads_of,
    new_req_data,
    prompt,
    run_until_scheduled,
    saves_of,
    server_stats,
    wait_stat,
)

BLOCK = 16



def turn2(h, r, tokens: list[int], hit_chunks: int):
    """Turn 2 with prompt tokens: the lookup hits hit_chunks chunks, loaded
    into fresh blocks that must hold exactly what the model computes."""
    r.scribble()  # only a real load can bring turn 1's bytes back
    b = h.add_request(h.make_request(tokens, max_tokens=1))
    s1 = h.step()
    (ld,) = loads_of(s1, b.request_id)
    assert (ld["start"], ld["end"]) == (0, hit_chunks)
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == hit_chunks * CHUNK
    assert s.num_scheduled_tokens[b.request_id] == len(tokens) - hit_chunks * CHUNK
    blocks = r.reqs[b.request_id].blocks
    # restored (the first hit_chunks chunks) and computed blocks alike
    assert r.check_blocks(tokens, blocks[: len(tokens) // BLOCK]) == []
    assert all(not e for e in r.load_errors)
    h.settle()
    return b


@pytest.mark.parametrize("pipelined", [False, True])
def test_turn_two_restores_the_prompt_and_the_answer(kv, pipelined):
    # pipelined: vLLM's AsyncScheduler with overlapped batches (batch N+1
    # scheduled before N's output is processed): tokens of steps still in
    # flight at the finish are not counted as computed.
    h, r = kv()
    assert type(h.scheduler).__name__ == "AsyncScheduler"
    p = prompt(21, 2 * CHUNK + 5)  # 2 full chunks + 5 tokens
    a = h.add_request(h.make_request(p, max_tokens=2 * CHUNK))
    h.settle(pipelined=pipelined)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    answer = h.outputs[a.request_id]
    assert answer == [7] * (2 * CHUNK)

    # 261 tokens, 260 of them computed (the last sampled one has no KV yet):
    # 4 full chunks, 2 of the prompt and 2 with the answer, all restored.
    q = p + answer + prompt(22, 20)  # turn 2: 281 tokens
    turn2(h, r, q, hit_chunks=4)
    # The prompt's chunks were saved after the prefill, the answer's during
    # the decode, each once its KV was computed and processed: nothing is
    # left for the finish, which still delays the free until the decode's
    # saves have read the blocks (finished_sending).
    sv = saves_of(h, a.request_id)
    assert [(x["first"], len(x["hashes"])) for x in sv] == [(0, 2), (2, 1), (3, 1)]
    assert any(a.request_id in (s.kv_connector_output.finished_sending or ()) for s in h.steps)
    st = server_stats(h.connector)
    assert st["kvshim_lookup_hit_chunks_total"] == 4
    w = r.kvshim.worker.stats().counters
    assert w["LoadedChunks"] == 4 and w["FailedLoads"] == 0
    # turn 2 computed no new full chunk: nothing more saved
    assert w["SavedChunks"] == 4
    assert_clean(h)


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_last_sampled_token_is_not_saved(kv, pipelined):
    # Turn 1 stops (EOS) with exactly 4 chunks of tokens: the EOS token was
    # sampled but never computed, so its chunk is not saved; chunk 2 (the
    # prompt's tail and the answer's head) is. Pipelined, the step after
    # the EOS is already in flight when the request stops: vLLM counts its
    # token in num_computed_tokens, but its KV was computed from a token
    # guessed before the EOS was known (the harness's runner writes the
    # KV of token 7 there), so it must not be saved either.
    h, r = kv()
    p = prompt(23, 2 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=4 * CHUNK))
    while len(h.outputs[a.request_id]) < 4 * CHUNK - len(p) - 1:
        h.step()
    if pipelined:
        h.settle(pipelined=True, eos_req_ids={a.request_id})
    else:
        h.step(eos_req_ids={a.request_id})
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert len(a.all_token_ids) == 4 * CHUNK
    assert a.num_computed_tokens == 4 * CHUNK - 1 + pipelined
    h.settle()
    turn2(h, r, list(a.all_token_ids) + prompt(24, 10), hit_chunks=3)
    assert [(x["first"], len(x["hashes"])) for x in saves_of(h, a.request_id)] == [(0, 2), (2, 1)]
    # turn 2's prefill computed chunk 3 (its own prompt's): saved as usual
    wait_stat(h, "kvshim_l1_commits_total", 4)
    assert_clean(h)


def test_an_aborted_request_saves_nothing_at_the_abort(kv):
    # Its prompt's chunks were saved after the prefill and chunk 2 during
    # the decode (its KV computed); the abort adds nothing (chunk 3 is one
    # token short).
    h, r = kv()
    p = prompt(25, 2 * CHUNK + 5)
    a = h.add_request(h.make_request(p, max_tokens=4 * CHUNK))
    while len(h.outputs[a.request_id]) < 2 * CHUNK - 5:  # KV up to 4 chunks - 1 token
        h.step()
    h.abort(a.request_id)
    h.settle()
    assert a.num_computed_tokens == 4 * CHUNK - 1
    assert [(x["first"], len(x["hashes"])) for x in saves_of(h, a.request_id)] == [(0, 2), (2, 1)]
    wait_stat(h, "kvshim_l1_commits_total", 3)
    turn2(h, r, p + h.outputs[a.request_id] + prompt(26, 10), hit_chunks=3)
    assert_clean(h)


def test_a_preempted_request_saves_its_answer_when_it_finishes(kv):
    # 23 usable blocks, two requests of 150 prompt tokens decoding 60: the
    # second is preempted while decoding, looked up again (its prompt
    # chunks hit), recomputes its answer and finishes; its finish saves
    # chunk 2 (prompt tail + answer), which turn 2 restores.
    h, r = kv(num_blocks=24)
    a = h.add_request(h.make_request(prompt(27, 150), max_tokens=60))
    b = h.add_request(h.make_request(prompt(28, 150), max_tokens=60))
    h.settle(until=lambda s: b.request_id in s.scheduler_output.preempted_req_ids)
    assert b.status == RequestStatus.PREEMPTED and h.outputs[b.request_id]
    h.settle()
    assert h.outputs[b.request_id] == [7] * 60
    for req in (a, b):
        assert (2, 1) in [(x["first"], len(x["hashes"])) for x in saves_of(h, req.request_id)]
    turn2(h, r, list(b.all_token_ids) + prompt(29, 10), hit_chunks=3)
    assert_clean(h)
