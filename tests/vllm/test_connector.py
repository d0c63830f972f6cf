"""KVShimConnector end to end inside vLLM's real scheduler, without a GPU.

vLLM's own Scheduler and KV-cache manager build the SCHEDULER-role
KVShimConnector through KVConnectorFactory (which starts kvshim's embedded
server in this process); a WORKER-role KVShimConnector per rank is driven in
the model runner's call order by harness.ModelRunner. GPU memory is faked:
the KV caches are CPU tensors made by vLLM's own allocate_kv_cache (one
buffer, a (blocks, kv_heads, block_size, K|V) view per layer, strided as the
resolved KVCacheLayout says), and the "model" writes KV bytes that are a
function of the token prefix, so restored blocks are compared byte for byte
with what the model would have computed. Nothing of vLLM is stubbed.

Chunks are 64 tokens (4 vLLM blocks of 16). vLLM's local prefix cache is off
unless a test says otherwise, so a second request can only get its prefix
from kvshim.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

from harness import (
    CHUNK,
    kvshim_config,
    loads_of,
    make_kv_cache_config,
    new_req_data,
    prompt,
    released,
    run_until_scheduled,
    server_stats,
    store,
    wait_jobs,
    wait_stat,
)

BLOCK = 16




def test_store_then_hit_restores_bytes_into_other_blocks(kv):
    h, r = kv()
    p = prompt(1, 200)  # 3 full chunks (192 tokens) + 8
    a = h.add_request(h.make_request(p, max_tokens=6))
    s = h.step()  # A's prefill: its 3 full chunks are saved after the forward
    assert s.num_scheduled_tokens[a.request_id] == 200
    a_blocks = list(r.reqs[a.request_id].blocks)
    st = wait_stat(h, "kvshim_l1_commits_total", 3)
    assert st["kvshim_l1_objects{state=resident}"] == 3 and st["kvshim_l1_holds"] == 0

    # B shares A's first 200 tokens and arrives while A still runs (and
    # holds its blocks): B's blocks are fresh, never written.
    q = p + prompt(2, 30)
    b = h.add_request(h.make_request(q, max_tokens=2))
    s1 = h.step()
    # The lookup is final at once (the server has no L2 to fill from, so
    # it is never pending): 3 chunks held, an asynchronous load planned.
    assert b.request_id not in s1.num_scheduled_tokens
    (ld,) = loads_of(s1, b.request_id)
    assert (ld["start"], ld["end"]) == (0, 3) and len(ld["blocks"]) == 12
    assert not set(ld["blocks"]) & set(a_blocks)
    assert b.num_computed_tokens == 3 * CHUNK
    assert server_stats(h.connector)["kvshim_lookup_hit_chunks_total"] == 3

    s = run_until_scheduled(h, b)
    # vLLM computes only the rest.
    nr = new_req_data(s, b.request_id)
    assert nr.num_computed_tokens == 192
    assert s.num_scheduled_tokens[b.request_id] == 230 - 192
    blocks = r.reqs[b.request_id].blocks
    assert blocks[:12] == ld["blocks"]
    # restored (0..11) and computed (12, 13) blocks: what the model computes
    assert r.check_blocks(q, blocks[:14]) == []
    assert all(not e for e in r.load_errors)

    h.settle()
    assert h.outputs[a.request_id] == [7] * 6 and h.outputs[b.request_id] == [7, 7]
    # Saves are delay-free: A's blocks came back after finished_sending.
    assert any(a.request_id in (s.kv_connector_output.finished_sending or ()) for s in h.steps)
    h.assert_no_leaks()
    st = released(h)
    # B's prompt has no new full chunk: nothing more stored
    assert st["kvshim_l1_objects{state=resident}"] == 3
    w = r.kvshim.worker.stats().counters
    assert w["LoadedChunks"] == 3 and w["FailedLoads"] == 0 and w["SavedChunks"] == 3
    assert h.kvshim.scheduler.stats().requests == 0


@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
def test_every_kv_cache_layout_restores_bytes(kv, layout):
    # vLLM 0.33 lays the KV cache out in one of six stride orders
    # (VLLM_KV_CACHE_LAYOUT, or a connector's or backend's wish), some with
    # all layers of a block side by side (BL..): the same save and restore,
    # checked byte for byte, for each.
    h, r = kv(layout=layout)
    assert h.vllm_config.cache_config.kv_cache_layout == layout
    p = prompt(11, 2 * CHUNK + 5)
    store(h, r, p, max_tokens=1)
    wait_stat(h, "kvshim_l1_commits_total", 2)
    r.scribble()
    b = h.add_request(h.make_request(p + prompt(12, 7), max_tokens=1))
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 2 * CHUNK
    assert r.check_blocks(b.prompt_token_ids, r.reqs[b.request_id].blocks[: 2 * CHUNK // BLOCK]) == []
    h.settle()
    h.assert_no_leaks()
    # 2 saved and 2 restored chunks of 4 blocks, 2 layers: layer-outermost
    # layouts copy at least a span per layer and chunk (20 here: the block
    # ids are mostly consecutive; LHBNC 40); block-outermost ones, whose
    # layers tile each block, copy all layers of a block as one span: at
    # most 4 per chunk (10 here; 32 if each layer were copied on its own).
    w = r.kvshim.worker.stats().counters
    assert w["LoadedChunks"] == 2 and w["SavedChunks"] == 2
    if KVCacheLayout[layout].is_block_outermost:
        assert w["CopySpans"] <= 4 * 4, w
    else:
        assert w["CopySpans"] >= 4 * 2, w


def test_whole_prompt_hit_leaves_the_last_token_to_vllm(kv):
    h, r = kv()
    p = prompt(3, 3 * CHUNK)  # exactly 3 chunks
    store(h, r, p, max_tokens=1)
    wait_stat(h, "kvshim_l1_commits_total", 3)
    r.scribble()
    b = h.add_request(h.make_request(p, max_tokens=2))
    s1 = h.step()
    (ld,) = loads_of(s1, b.request_id)
    assert (ld["start"], ld["end"]) == (0, 3)
    assert b.num_computed_tokens == 3 * CHUNK - 1
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 3 * CHUNK - 1
    assert s.num_scheduled_tokens[b.request_id] == 1
    assert r.check_blocks(p, r.reqs[b.request_id].blocks[:12]) == []
    h.settle()
    assert h.outputs[b.request_id] == [7, 7]
    h.assert_no_leaks()
    released(h)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_partial_prefix_hits_only_the_chunks_before_the_divergence(kv, k):
    h, r = kv()
    p = prompt(4, 4 * CHUNK + 20)  # 4 full chunks stored
    store(h, r, p, max_tokens=1)
    wait_stat(h, "kvshim_l1_commits_total", 4)
    r.scribble()
    cut = k * CHUNK + 10  # diverges inside chunk k
    q = p[:cut] + [t + 1 for t in p[cut : 4 * CHUNK + 20]]
    b = h.add_request(h.make_request(q, max_tokens=1))
    s = run_until_scheduled(h, b)
    nr = new_req_data(s, b.request_id)
    assert nr.num_computed_tokens == k * CHUNK
    assert s.num_scheduled_tokens[b.request_id] == len(q) - k * CHUNK
    if k == 0:
        assert all(not loads_of(st, b.request_id) for st in h.steps)
    # chunks < k restored, chunk k onward computed by vLLM: every full block right
    n_full = len(q) // BLOCK
    assert r.check_blocks(q, r.reqs[b.request_id].blocks[:n_full]) == []
    h.settle()
    h.assert_no_leaks()
    st = released(h)
    assert st["kvshim_lookup_hit_chunks_total"] == k


def test_cache_salts_never_share(kv):
    h, r = kv()
    p = prompt(5, 3 * CHUNK + 5)
    store(h, r, p, max_tokens=1, cache_salt="alice")
    wait_stat(h, "kvshim_l1_commits_total", 3)
    for salt, hit in [("bob", 0), (None, 0), ("alice", 3 * CHUNK)]:
        b = h.add_request(h.make_request(p, max_tokens=1, cache_salt=salt))
        s = run_until_scheduled(h, b)
        assert new_req_data(s, b.request_id).num_computed_tokens == hit, salt
        h.settle()
    st = server_stats(h.connector)
    assert st["kvshim_lookup_hit_chunks_total"] == 3
    # "bob" and the unsalted prompt stored their own 3 chunks each
    wait_stat(h, "kvshim_l1_commits_total", 9)
    h.assert_no_leaks()


def test_abort_after_the_load_was_planned_releases_everything(kv):
    h, r = kv()
    p = prompt(6, 200)
    store(h, r, p, max_tokens=1)
    base = wait_stat(h, "kvshim_l1_commits_total", 3)
    b = h.add_request(h.make_request(p + [5, 6], max_tokens=2))
    so = h.scheduler.schedule()  # lookup final, blocks allocated, load planned
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert server_stats(h.connector)["kvshim_l1_holds"] == 3
    h.abort(b.request_id)  # before the workers ran the step
    h.finish(so, h.execute(so))
    h.settle()
    h.assert_no_leaks()
    st = released(h)
    assert st["kvshim_l1_used_bytes"] == base["kvshim_l1_used_bytes"]
    assert h.kvshim.scheduler.stats().requests == 0


def test_abort_of_a_held_hit_that_got_no_blocks_releases_its_holds(kv):
    # 31 usable blocks. C runs long with 19+ blocks, so B's hit (15 blocks)
    # cannot be allocated: B waits with the lookup answered and the chunks
    # held by the server, and is aborted there.
    h, r = kv(num_blocks=32)
    p = prompt(7, 200)
    store(h, r, p, max_tokens=1)
    c = h.add_request(h.make_request(prompt(8, 300), max_tokens=40))
    h.step()
    base = wait_stat(h, "kvshim_l1_commits_total", 3 + 4)
    b = h.add_request(h.make_request(p + prompt(9, 30), max_tokens=2))
    for _ in range(3):
        s = h.step()
        assert b.request_id not in s.num_scheduled_tokens
        assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert server_stats(h.connector)["kvshim_l1_holds"] == 3
    h.abort(b.request_id)
    st = server_stats(h.connector)
    assert st["kvshim_l1_holds"] == 0
    assert st["kvshim_l1_used_bytes"] == base["kvshim_l1_used_bytes"]
    assert c.status == RequestStatus.RUNNING
    h.abort(c.request_id)
    h.settle()
    h.assert_no_leaks()
    st = released(h)
    assert h.kvshim.scheduler.stats().requests == 0


def test_preempted_request_is_looked_up_again_and_restored(kv):
    # 23 usable blocks, two requests of 150 prompt tokens (10 blocks each)
    # decoding 60 tokens: the second is preempted when blocks run out. Its
    # prompt chunks were saved; when it comes back vLLM asks the connector
    # again, which finds them and loads them into new blocks.
    h, r = kv(num_blocks=24)
    a = h.add_request(h.make_request(prompt(51, 150), max_tokens=60))
    b = h.add_request(h.make_request(prompt(52, 150), max_tokens=60))
    h.settle(until=lambda s: b.request_id in s.scheduler_output.preempted_req_ids)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert h.outputs[b.request_id], "preempted while decoding"
    wait_stat(h, "kvshim_l1_commits_total", 4)  # 2 prompt chunks each
    s = h.settle(until=lambda s: loads_of(s, b.request_id))[-1]
    (ld,) = loads_of(s, b.request_id)
    assert (ld["start"], ld["end"]) == (0, 2)
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 2 * CHUNK
    tokens = list(b.all_token_ids)
    assert len(tokens) > 150  # prompt + the tokens it had generated
    n = b.num_computed_tokens // BLOCK
    assert r.check_blocks(tokens, r.reqs[b.request_id].blocks[:n]) == []
    h.settle()
    assert h.outputs[a.request_id] == [7] * 60 and h.outputs[b.request_id] == [7] * 60
    h.assert_no_leaks()
    released(h)
    assert r.kvshim.worker.stats().counters["LoadedChunks"] == 2
    assert h.kvshim.scheduler.stats().requests == 0


def test_local_prefix_hit_plus_kvshim_loads_only_the_blocks_vllm_lacks(kv):
    # vLLM's own prefix cache on: B's first 96 tokens (6 blocks) are a local
    # hit, kvshim has 3 chunks (192 tokens): only chunks 1-2 are loaded, and
    # of chunk 1 only the blocks vLLM does not have (never overwrite a
    # shared block).
    h, r = kv(enable_prefix_caching=True)
    p = prompt(61, 200)
    store(h, r, p, max_tokens=1)
    wait_stat(h, "kvshim_l1_commits_total", 3)
    assert h.scheduler.reset_prefix_cache()  # vLLM forgets; kvshim keeps
    r.scribble()
    # C caches p[:96] locally (chunk 0 loaded from kvshim, 2 blocks computed)
    c = h.add_request(h.make_request(p[:100] + prompt(62, 40), max_tokens=1))
    s = run_until_scheduled(h, c)
    assert new_req_data(s, c.request_id).num_computed_tokens == CHUNK
    c_blocks = list(r.reqs[c.request_id].blocks)
    h.settle()

    q = p + prompt(63, 30)
    b = h.add_request(h.make_request(q, max_tokens=1))
    s1 = h.step()
    (ld,) = loads_of(s1, b.request_id)
    assert (ld["start"], ld["end"]) == (1, 3)
    assert ld["blocks"][:2] == [-1, -1] and -1 not in ld["blocks"][2:]
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 3 * CHUNK
    blocks = r.reqs[b.request_id].blocks
    assert blocks[:6] == c_blocks[:6]  # vLLM's shared, locally cached blocks
    assert blocks[6:12] == ld["blocks"][2:]
    assert r.check_blocks(q, blocks[:14]) == []
    h.settle()
    h.assert_no_leaks()
    released(h)


def test_hit_with_overlapped_batches(kv):
    # vLLM's default here: AsyncScheduler stepped as EngineCore's batch queue
    # does (batch N+1 scheduled and executed before update_from_output of N).
    h, r = kv()
    assert type(h.scheduler).__name__ == "AsyncScheduler"
    assert h.vllm_config.max_concurrent_batches == 2
    p = prompt(71, 200)
    a = h.add_request(h.make_request(p, max_tokens=3))
    h.settle(pipelined=True)
    wait_stat(h, "kvshim_l1_commits_total", 3)
    r.scribble()
    q = p + prompt(72, 30)
    reqs = [h.add_request(h.make_request(q, max_tokens=3)) for _ in range(2)]
    steps = h.settle(pipelined=True)
    for b in reqs:
        first = next(s for s in steps if b.request_id in s.num_scheduled_tokens)
        assert new_req_data(first, b.request_id).num_computed_tokens == 3 * CHUNK
        assert first.num_scheduled_tokens[b.request_id] == len(q) - 3 * CHUNK
        assert h.outputs[b.request_id] == [7] * 3
        # restored bytes right when vLLM first scheduled it
        assert r.prefix_checks[b.request_id] == (3 * CHUNK, [])
    assert h.outputs[a.request_id] == [7] * 3
    h.assert_no_leaks()
    st = released(h)
    assert st["kvshim_lookup_hit_chunks_total"] == 6
    assert r.kvshim.worker.stats().counters["LoadedChunks"] == 6


L2_CHUNKS = 24  # enough L2 reads that the fill outlasts the first poll


def _l2_stored(kv, tmp_path, p):
    """Store p through an engine whose embedded server has an fs L2, wait
    until the L2 has every chunk, shut that engine (and its L1) down."""
    l2 = {"kvshim.l2_adapters": [{"type": "fs", "base_path": str(tmp_path / "l2")}]}
    h1, r1 = kv(num_blocks=256, kv_connector_extra_config=l2, max_num_batched_tokens=2048)
    store(h1, r1, p, max_tokens=1)
    n = len(p) // CHUNK
    wait_stat(h1, "kvshim_l2_store_saved_objects_total{adapter=fs}", n, timeout=20)
    h1.close()
    return l2


def _pending_lookup(kv, l2, tokens, attempts=4):
    """A new engine (new embedded server: empty L1, same L2) whose first
    answer for tokens is pending. The first answer comes right after the
    LOOKUP ack, while the server still reads L2; should a loaded machine
    finish the reads first, try again on a fresh server."""
    for _ in range(attempts):
        h, r = kv(num_blocks=256, kv_connector_extra_config=l2, max_num_batched_tokens=2048)
        assert server_stats(h.connector)["kvshim_l1_used_bytes"] == 0
        b = h.add_request(h.make_request(tokens, max_tokens=1))
        s = h.step()
        if not loads_of(s, b.request_id):
            # pending: vLLM got None and skipped it (nothing scheduled, no load)
            assert b.request_id not in s.num_scheduled_tokens
            assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
            # The server holds the lookup; its L2 reads may have ended
            # between vLLM's answer and this check (pending 1, then 0).
            st = server_stats(h.connector)
            assert st["kvshim_lookups_live"] == 1 and st["kvshim_lookups_pending"] in (0, 1)
            return h, r, b
        h.abort(b.request_id)
        h.settle()
        h.close()
    raise AssertionError(f"the L2 lookup was never pending in {attempts} attempts")


def test_l2_hit_after_restart_is_pending_then_loaded(kv, tmp_path):
    # The embedded server with an fs L2: A is stored in L1 and, in the
    # background, in L2. A new engine (new embedded server, empty L1, same
    # L2 directory) looks B up: the server prefetches the chunks from L2 into
    # L1 while the lookup is pending (vLLM gets None and asks again next
    # step), then answers a hit, and the worker restores the bytes.
    p = prompt(81, L2_CHUNKS * CHUNK + 10)
    l2 = _l2_stored(kv, tmp_path, p)
    q = p + prompt(82, 20)
    h, r, b = _pending_lookup(kv, l2, q)
    steps = h.settle(until=lambda s: loads_of(s, b.request_id))
    for s in steps[:-1]:
        assert b.request_id not in s.num_scheduled_tokens
    (ld,) = loads_of(steps[-1], b.request_id)
    assert (ld["start"], ld["end"]) == (0, L2_CHUNKS)
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == L2_CHUNKS * CHUNK
    assert r.prefix_checks[b.request_id] == (L2_CHUNKS * CHUNK, [])
    h.settle()
    h.assert_no_leaks()
    st = wait_stat(h, "kvshim_l1_holds", 0, timeout=10)  # L2 writes pin until they end
    assert st["kvshim_lookups_live"] == 0


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_l2_chunk_lost_in_the_middle_stops_the_prefix(kv, tmp_path, damage):
    # the design's counter-example: chunks 0-2 in L2, the L2 load of
    # chunk 1 fails, chunk 2 would succeed -> only chunk 0 is usable, never
    # chunks 0 and 2. Whoever notices (the server's L2 read, or the worker's
    # checksum check of the object) vLLM ends up with 64 good tokens and
    # computes the rest.
    from kvshim.native import meta_json

    base = tmp_path / "l2"
    l2 = {"kvshim.l2_adapters": [{"type": "fs", "base_path": str(base)}]}
    p = prompt(91, 3 * CHUNK + 8)
    h1, r1 = kv(kv_connector_extra_config=l2)
    a, _ = store(h1, r1, p, max_tokens=1)
    (save,) = [
        sv
        for st in h1.steps
        for sv in meta_json(st.connector_meta.data).get("saves", [])
        if sv["req"] == a.request_id
    ]
    wait_stat(h1, "kvshim_l2_store_saved_objects_total{adapter=fs}", 3, timeout=10)
    h1.close()
    (f,) = base.rglob(f"*{save['hashes'][1]}*")  # the object of chunk 1
    if damage == "missing":
        f.unlink()
    else:
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))

    h, r = kv(kv_connector_extra_config=l2)
    q = p + prompt(92, 20)
    b = h.add_request(h.make_request(q, max_tokens=1))
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == CHUNK
    assert r.prefix_checks[b.request_id] == (CHUNK, [])
    assert r.check_blocks(q, r.reqs[b.request_id].blocks[: len(q) // BLOCK]) == []
    h.settle()
    h.assert_no_leaks()
    # The L2 store controller pins B's new chunks (read holds) until their
    # fs writes end, in the background.
    st = wait_stat(h, "kvshim_l1_holds", 0, timeout=10)
    assert st["kvshim_lookups_live"] == 0


def test_abort_while_the_l2_lookup_is_pending_releases_everything(kv, tmp_path):
    # B's lookup is pending (the server fills chunks from L2) when B is
    # aborted: its holds are released, and the lookup itself is forgotten
    # once its fill ends (the connector reads the answer at a later step).
    p = prompt(95, L2_CHUNKS * CHUNK + 10)
    l2 = _l2_stored(kv, tmp_path, p)
    h, r, b = _pending_lookup(kv, l2, p + [3, 4])
    h.abort(b.request_id)
    h.settle()
    h.assert_no_leaks()
    assert h.kvshim.scheduler.stats().requests == 0
    wait_stat(h, "kvshim_lookups_pending", 0)  # the fill ends in the background
    # the engine's next steps (another request) let the connector reap it
    store(h, r, prompt(96, 100), max_tokens=1)
    st = wait_stat(h, "kvshim_l1_holds", 0, timeout=10)  # L2 writes pin until they end
    assert st["kvshim_lookups_live"] == 0
    assert st["kvshim_l1_objects{state=temporary}"] == 0
    # L1 holds only the new request's one full chunk
    assert st["kvshim_l1_objects{state=resident}"] == 1
    h.assert_no_leaks()


def test_connector_asks_vllm_for_a_block_outermost_layout(kv):
    # kvshim.kv_cache_layout is the connector's wish, resolved by vLLM's own
    # resolve_kv_cache_layout (as in the engine core): the cache is then
    # block-outermost and each block's layers copy as one span.
    h, r = kv(kv_connector_extra_config={"kvshim.kv_cache_layout": "BLNHC"})
    assert h.vllm_config.cache_config.kv_cache_layout == "BLNHC"
    p = prompt(13, 2 * CHUNK + 1)
    store(h, r, p, max_tokens=1)
    wait_stat(h, "kvshim_l1_commits_total", 2)
    wait_jobs(h)  # the worker counts the save once its COMMIT is answered
    w = r.kvshim.worker.stats().counters
    assert w["SavedChunks"] == 2 and w["CopySpans"] <= 2 * (CHUNK // BLOCK), w


def test_layouts_do_not_share_a_namespace(tiny_model_dir):
    # Block-outermost objects hold blocks in another order: an instance
    # with another layout must not even find them (its load would fail the
    # fingerprint check and recompute).
    from kvshim.vllm import connector_config, read_config

    def ns(layout: str | None) -> dict[str, Any]:
        cfg = kvshim_config(tiny_model_dir)
        cfg.cache_config.kv_cache_layout = layout
        kvc = make_kv_cache_config()
        return dict(connector_config(cfg, kvc, KVConnectorRole.WORKER)["open"]["namespace"])

    assert ns("LBNHC") == ns("LBNHC")
    assert ns("LBNHC")["layout"] != ns("BLNHC")["layout"]
    with pytest.raises(ValueError, match=r'kvshim.kv_cache_layout: "NHD" is not one of \['):
        read_config({"kvshim.kv_cache_layout": "NHD"})
