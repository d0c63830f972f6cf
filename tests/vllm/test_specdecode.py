"""Speculative decoding through vLLM's real scheduler in spec-decode mode.

vLLM is configured with a real ``SpeculativeConfig`` (``ngram``, and
``draft_model`` whose ``num_lookahead_tokens`` is 3), so its Scheduler
schedules draft tokens (``scheduled_spec_decode_tokens``), rolls
``num_computed_tokens`` back by the rejected drafts in ``update_from_output``
and reserves lookahead slots in ``allocate_slots``. The model is absent, as in
every harness test: ``SpecRunner`` plays the GPU model runner. It writes KV
for every scheduled position, drafts included (a rejected draft's KV stays in
the block until the position is recomputed, as on a GPU), and "verifies" the
drafts against a deterministic target model (``target_next``): it outputs the
accepted drafts plus one corrected/bonus token, as vLLM's rejection sampler
does. Its drafter is scripted (``SpecHarness.drafts``) so that some drafts
are accepted and some rejected, and the last step of a request ends with a
rejected draft in the last slot of a chunk: the bytes there are a draft's,
so that chunk must not be saved. Drafts reach the scheduler the way
EngineCore.post_step hands them over (``Scheduler.update_draft_token_ids``
with a ``DraftTokenIds``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.config import SpeculativeConfig, VllmConfig
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.request import RequestStatus

from harness import (
    CHUNK,
    KVModel,
    ModelRunner,
    SchedulerHarness,
    assert_clean,
    kvshim_config,
    make_kv_cache_config,
    prompt,
    saves_of,
    server_stats,
)
from kvshim.native import meta_json
from test_multiturn import BLOCK, turn2

NUM_SPEC = 3


def target_next(tokens: list[int]) -> int:
    """The target model's greedy next token after ``tokens``."""
    return 3 + KVModel.prefix_hashes(tokens)[-1] % 997


def spec_config(model_dir, method: str, **kw) -> VllmConfig:
    """kvshim_config with vLLM's SpeculativeConfig (plain Scheduler: the
    runner tracks tokens the way a synchronous model runner does)."""
    base = kvshim_config(model_dir, async_scheduling=False, enable_prefix_caching=False, **kw)
    sk: dict[str, Any] = {"method": method, "num_speculative_tokens": NUM_SPEC}
    if method == "ngram":
        sk |= {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    else:  # a draft model: the tiny model dir again (no weights are read)
        sk |= {"model": str(model_dir), "target_model_config": base.model_config,
               "target_parallel_config": base.parallel_config}
    return VllmConfig(
        parallel_config=base.parallel_config,
        model_config=base.model_config,
        scheduler_config=base.scheduler_config,
        cache_config=base.cache_config,
        kv_transfer_config=base.kv_transfer_config,
        device_config=base.device_config,
        speculative_config=SpeculativeConfig(**sk),
    )


class SpecRunner(ModelRunner):
    """ModelRunner whose forward pass takes the scheduled draft tokens as
    inputs and whose sampler verifies them against target_next."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prompt_len: dict[str, int] = {}
        self.sampled: dict[str, list[int]] = {}
        self.drafted = self.accepted = 0
        self._so = None

    def execute(self, so):
        self._so, self.sampled = so, {}
        for nr in so.scheduled_new_reqs:
            self.prompt_len[nr.req_id] = len(nr.prompt_token_ids)
        return super().execute(so)

    def _forward(self, work):
        bs = self.block_size
        assert self._so is not None
        spec = self._so.scheduled_spec_decode_tokens
        for rid, start, n in work:
            r = self.reqs[rid]
            drafts = list(spec.get(rid, ()))
            known = start + n - len(drafts)  # positions of known tokens: [0, known)
            assert len(r.tokens) >= known, (rid, len(r.tokens), known)
            seq = r.tokens[:known] + drafts
            hashes = KVModel.prefix_hashes(seq)
            pos = list(range(start, start + n))
            blocks = [r.blocks[p // bs] for p in pos]
            for i, name in enumerate(self.layer_names):
                kv = self._content(self.model.kv(hashes[start:start + n], i))
                self.kv_caches[name].view(torch.int16)[blocks, :, [p % bs for p in pos]] = kv
            if start + n < self.prompt_len[rid]:
                r.tokens = seq
                continue  # a prefill chunk samples nothing
            # Rejection sampling, greedy: accept drafts while they equal
            # the target's token, then one corrected (or bonus) token.
            out = []
            for j, d in enumerate(drafts + [None]):
                want = target_next(seq[: known + j])
                out.append(want)
                if d != want:
                    break
            self.drafted += len(drafts)
            self.accepted += len(out) - 1
            r.tokens = seq[:known] + out
            self.sampled[rid] = out


class SpecHarness(SchedulerHarness):
    """The harness with the runner's sampled tokens and a scripted drafter
    whose drafts reach the scheduler as EngineCore.post_step passes them."""

    final_q: dict[str, int]

    def model_runner_output(self, scheduler_output, **kw):
        mro = super().model_runner_output(scheduler_output, **kw)
        runner = self.runners[0]
        mro.sampled_token_ids = [
            list(runner.sampled.get(rid, [])) if toks else []
            for rid, toks in zip(mro.req_ids, mro.sampled_token_ids)
        ]
        return mro

    def finish(self, so, mro):
        res = super().finish(so, mro)
        ids, drafts = [], []
        for rid, req in self.scheduler.requests.items():
            if req.status == RequestStatus.RUNNING and not req.is_prefill_chunk and req.num_output_tokens:
                ids.append(rid)
                drafts.append(self.drafts(rid, list(req.all_token_ids)))
        if ids:
            self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))
        return res

    def drafts(self, rid: str, toks: list[int]) -> list[int]:
        """Drafts for the positions after toks: the target's tokens, made
        wrong on purpose in a pattern: some steps accept all, some reject
        from the first or the third draft; none in the last steps before
        final_q, where the drafts are [right, wrong, wrong]."""
        q = len(toks) - 1  # position of the last known token (the next input)
        fq = self.final_q.get(rid, 1 << 30)
        if q > fq or fq - 4 <= q < fq:
            return []
        good: list[int] = []
        for _ in range(NUM_SPEC):
            good.append(target_next(toks + good))
        wrong = lambda t: 3 + (t + 1) % 997  # noqa: E731
        if q == fq:
            return [good[0], wrong(good[1]), wrong(good[2])]
        kind = q % 3
        if kind == 0:
            return good  # all accepted (+ a bonus token)
        if kind == 1:
            return [wrong(good[0])] + good[1:]  # all rejected
        return good[:2] + [wrong(good[2])]  # one rejected


@pytest.fixture
def spec(tiny_model_dir):
    made = []

    def make(method: str, num_blocks: int = 128):
        cfg = spec_config(tiny_model_dir, method)
        kvc = make_kv_cache_config(num_blocks=num_blocks)
        h = SpecHarness(cfg, kvc)
        h.final_q = {}
        h.runners = [SpecRunner(cfg, kvc)]
        made.append(h)
        return h, h.runners[0]

    yield make
    for h in made:
        h.close()


@pytest.mark.parametrize("method,lookahead", [("ngram", 0), ("draft_model", NUM_SPEC)])
def test_rejected_drafts_are_never_saved_or_counted(spec, method, lookahead):
    h, r = spec(method)
    assert h.scheduler.num_spec_tokens == NUM_SPEC
    assert h.scheduler.num_lookahead_tokens == lookahead
    p = prompt(41, 2 * CHUNK + 5)
    # The last step starts at position 4*CHUNK-3: its drafts [right, wrong,
    # wrong] give two tokens (the right draft and the correction), the
    # request reaches max_tokens with exactly 4 chunks of tokens, and the
    # last slot of chunk 3 holds the KV of the rejected second draft.
    fq = 4 * CHUNK - 3
    a = h.make_request(p, max_tokens=4 * CHUNK - len(p))
    h.final_q[a.request_id] = fq
    h.add_request(a)
    blocks: list[int] = []
    while not a.is_finished():
        s = h.step()
        if a.request_id in r.reqs:
            blocks = list(r.reqs[a.request_id].blocks)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    toks = list(a.all_token_ids)
    assert len(toks) == 4 * CHUNK
    assert toks[len(p):] == h.outputs[a.request_id]
    # what the drafts did: scheduled, some accepted, some rejected
    assert any(st.scheduler_output.scheduled_spec_decode_tokens for st in h.steps)
    assert r.accepted > 0 and r.drafted - r.accepted > 0, (r.drafted, r.accepted)
    # every output is the target's token: the rollbacks kept the runner and
    # vLLM in step
    assert all(toks[i] == target_next(toks[:i]) for i in range(len(p), len(toks)))
    # num_computed_tokens after the rollback: the last token (the correction)
    # has no KV; its slot holds the rejected draft's (the trap is armed).
    assert a.num_computed_tokens == 4 * CHUNK - 1
    bad = r.check_blocks(toks, blocks[: 4 * CHUNK // BLOCK])
    assert bad == [4 * CHUNK // BLOCK - 1], bad
    assert s.finished.get(a.request_id) is not None
    h.settle()
    # Saved: the prompt's 2 chunks after the prefill and chunk 2 during the
    # decode (once its positions were accepted); chunk 3 (whose last slot is
    # a draft's KV) never.
    assert [(x["first"], len(x["hashes"])) for x in saves_of(h, a.request_id)] == [(0, 2), (2, 1)]
    (decoding,) = [st for st in h.steps if any(sv["req"] == a.request_id and sv["first"] == 2 for sv in
                                               meta_json(st.scheduler_output.kv_connector_metadata.data).get("saves", []))]
    assert a.request_id in decoding.num_scheduled_tokens  # a step A ran in: not its finish

    # Turn 2 restores 3 chunks byte-exact into other blocks and computes the
    # rest itself; hits count only real tokens (drafts are never in a key).
    b = turn2(h, r, toks + prompt(42, 10), hit_chunks=3)
    assert b.num_computed_tokens >= len(toks)
    st = server_stats(h.connector)
    assert st["kvshim_lookup_hit_chunks_total"] == 3
    w = r.kvshim.worker.stats().counters
    assert w["LoadedChunks"] == 3 and w["FailedLoads"] == 0
    h.settle()
    assert_clean(h)


def test_spec_decode_prompt_chunks_saved_after_prefill_only(spec):
    """Drafts are scheduled in the same steps as other requests' prefills:
    a decoding request's in-flight drafts never make a save, and the
    prefill's saves are exactly its prompt chunks."""
    h, r = spec("ngram")
    a = h.add_request(h.make_request(prompt(43, CHUNK + 3), max_tokens=40))
    while not any(st.scheduler_output.scheduled_spec_decode_tokens for st in h.steps):
        h.step()
    b = h.add_request(h.make_request(prompt(44, 3 * CHUNK), max_tokens=4))
    h.settle()
    assert [(x["first"], len(x["hashes"])) for x in saves_of(h, a.request_id)] == [(0, 1)]
    sb = saves_of(h, b.request_id)
    assert sum(len(x["hashes"]) for x in sb) == 3 and sb[0]["first"] == 0
    assert r.drafted > 0
    assert_clean(h)
