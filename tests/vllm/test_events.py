"""KV events (take_events) through vLLM 0.33's real Scheduler
(tests/vllm/harness/) with --kv-events-config's enable_kv_cache_events:
what the scheduler hands its KV-event publisher (vLLM's KVEventBatch of
BlockStored / BlockRemoved / AllBlocksCleared) after kvshim's saves commit,
after a save that was not committed, after L1 evicted announced chunks,
after the fs L2 wrote them, and after reset_prefix_cache.

Not tested here: the ZMQ publisher of a real `vllm serve` (tests/e2e).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventPublisher
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from harness import CHUNK, ModelRunner, SchedulerHarness, kvshim_config, make_kv_cache_config, prompt

BS = 16  # the harness's block size


class Recorder(EventPublisher):
    """Stands in for the scheduler's event publisher (ZMQ in vllm serve):
    keeps every batch vLLM publishes."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[EventBatch] = []

    def publish(self, events: EventBatch) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        pass

    def take(self) -> list[Any]:
        out = [e for b in self.batches for e in b.events]
        self.batches.clear()
        return out


@pytest.fixture
def kv_events(tiny_model_dir):
    made: list[SchedulerHarness] = []

    def make(events: bool = True, **extra: Any) -> tuple[SchedulerHarness, ModelRunner, Recorder]:
        cfg = kvshim_config(tiny_model_dir, enable_prefix_caching=False, kv_connector_extra_config=extra)
        if events:
            cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        cfg.cache_config.kv_cache_layout = None
        kvc = make_kv_cache_config(num_blocks=128)
        h = SchedulerHarness(cfg, kvc)
        h.runners = [ModelRunner(cfg, kvc)]
        rec = Recorder()
        h.scheduler.kv_event_publisher = rec  # what vLLM publishes each step
        made.append(h)
        return h, h.runners[0], rec

    yield make
    for h in made:
        h.close()


def run(h: SchedulerHarness, tokens: list[int], **kw: Any) -> Any:
    req = h.add_request(h.make_request(tokens, max_tokens=1, **kw))
    h.settle()
    return req


def drain(h: SchedulerHarness, rec: Recorder, want: int, timeout_s: float = 5.0) -> list[Any]:
    """Steps (nothing scheduled: the workers' reports of committed saves
    still come back with each step's output) until want events arrived."""
    deadline = time.monotonic() + timeout_s
    got: list[Any] = []
    while len(got) < want and time.monotonic() < deadline:
        h.step()
        got += rec.take()
        time.sleep(0.002)
    for _ in range(3):  # nothing more comes
        h.step()
        got += rec.take()
    return got


def test_block_stored_with_the_requests_block_hashes(kv_events):
    h, _, rec = kv_events()
    tokens = prompt(11, 2 * CHUNK + 5)
    req = run(h, tokens)
    got = drain(h, rec, 1)
    stored = [e for e in got if isinstance(e, BlockStored)]
    assert len(got) == len(stored) == 1, got
    ev = stored[0]
    n = 2 * CHUNK // BS  # the two full chunks' blocks
    assert ev.block_hashes == [maybe_convert_block_hash(b) for b in req.block_hashes[:n]]
    assert ev.parent_block_hash is None
    assert ev.token_ids == tokens[: 2 * CHUNK]
    assert ev.block_size == BS
    assert ev.medium == "CPU"
    assert ev.lora_id is None and ev.lora_name is None
    assert ev.group_idx == 0
    assert not h.kvshim.scheduler.events.requests  # finished and announced: no reference kept

    # The same prompt again: found in L1, nothing saved, nothing announced.
    run(h, tokens)
    assert drain(h, rec, 0) == []


def test_nothing_for_a_save_that_was_not_committed(kv_events):
    h, _, rec = kv_events()
    # The workers skip wait_for_save in every step: no save is started, so
    # none is committed (vLLM's own path when a save is dropped).
    h.runners[0].skip_save_steps = set(range(1, 1000))
    run(h, prompt(12, 2 * CHUNK))
    assert drain(h, rec, 0) == []


def test_nothing_for_a_skipped_save(kv_events):
    h, r, rec = kv_events()
    # Two requests with one prompt in one step (vLLM's own prefix cache
    # off): both compute it and both saves are dispatched; the server
    # stages the chunks for one, the other's save is skipped and announces
    # nothing, so the router learns the chunks once.
    tokens = prompt(16, 2 * CHUNK + 3)
    a = h.add_request(h.make_request(tokens, max_tokens=1))
    b = h.add_request(h.make_request(tokens, max_tokens=1))
    h.settle()
    got = drain(h, rec, 1)
    counters = r.kvshim.worker.stats().counters
    assert (counters["SavedChunks"], counters["SkippedChunks"]) == (2, 2)
    assert len(got) == 1 and isinstance(got[0], BlockStored), got
    assert got[0].block_hashes == [maybe_convert_block_hash(x) for x in a.block_hashes[: 2 * CHUNK // BS]]
    assert a.block_hashes[: 2 * CHUNK // BS] == b.block_hashes[: 2 * CHUNK // BS]
    st = h.kvshim.scheduler.events
    assert st is not None and not st.requests


def test_all_blocks_cleared_after_reset_prefix_cache(kv_events):
    h, _, rec = kv_events()
    run(h, prompt(13, CHUNK + 1))
    assert len(drain(h, rec, 1)) == 1
    assert h.scheduler.reset_prefix_cache(reset_connector=True) is True
    # kvshim's own (vLLM's block pool publishes another for its GPU cache;
    # a router clears the instance either way).
    own = list(h.kvshim.take_events())
    assert len(own) == 1 and isinstance(own[0], AllBlocksCleared), own
    # The chunks are computed and saved anew under the new generation.
    run(h, prompt(13, CHUNK + 1))
    got = [e for e in drain(h, rec, 2) if not isinstance(e, AllBlocksCleared)]
    assert len(got) == 1 and isinstance(got[0], BlockStored), got


def test_off_without_kv_events_config(kv_events):
    h, _, rec = kv_events(events=False)
    run(h, prompt(14, 2 * CHUNK))
    assert drain(h, rec, 0) == []
    assert h.kvshim.scheduler.events is None


def hashes_of(req: Any, first: int, n: int) -> list[Any]:
    return [maybe_convert_block_hash(b) for b in req.block_hashes[first:first + n]]


def test_block_removed_when_l1_evicts(kv_events):
    # A small L1: every prompt's chunks are saved, announced, and in time
    # evicted by the later prompts'; each eviction comes back as
    # BlockRemoved naming exactly the block hashes announced for the chunk.
    h, _, rec = kv_events(**{"kvshim.l1_size_gb": 1 / 1024, "kvshim.l1_prefault_gb": 0})
    first = run(h, prompt(40, 2 * CHUNK))
    got = drain(h, rec, 1)
    assert len(got) == 1 and isinstance(got[0], BlockStored), got
    n = 2 * CHUNK // BS
    assert got[0].block_hashes == hashes_of(first, 0, n)
    stored = list(got[0].block_hashes)
    removed: list[Any] = []
    for i in range(200):
        run(h, prompt(41 + i, 2 * CHUNK))
        for e in drain(h, rec, 1):
            if isinstance(e, BlockRemoved):
                assert e.medium == "CPU" and e.group_idx == 0
                removed += e.block_hashes
            else:
                assert isinstance(e, BlockStored) and e.medium == "CPU", e
        if set(stored) <= set(removed):
            break
    assert set(stored) <= set(removed), "the first prompt's chunks were never reported evicted"
    # Per chunk, in the chunk's own block order; each block once.
    mine = [b for b in removed if b in set(stored)]
    assert sorted(mine) == sorted(stored) and len(mine) == len(set(mine))
    assert mine[: n // 2] in (stored[: n // 2], stored[n // 2:])


def test_storage_stored_with_the_fs_l2(kv_events, tmp_path):
    adapter = {"type": "fs", "base_path": str(tmp_path / "l2")}
    h, _, rec = kv_events(**{"kvshim.l2_adapters": [adapter]})
    req = run(h, prompt(60, 2 * CHUNK))
    got = drain(h, rec, 3)  # CPU for both chunks, then STORAGE for each
    n = 2 * CHUNK // BS
    cpu = [e for e in got if isinstance(e, BlockStored) and e.medium == "CPU"]
    storage = [e for e in got if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert len(cpu) == 1 and cpu[0].block_hashes == hashes_of(req, 0, n), got
    # One STORAGE event per chunk, as the L2 writer finished each.
    assert sorted(b for e in storage for b in e.block_hashes) == sorted(hashes_of(req, 0, n)), got
    for e in storage:
        assert e.block_size == BS and e.group_idx == 0 and len(e.token_ids) == len(e.block_hashes) * BS
        i = hashes_of(req, 0, n).index(e.block_hashes[0])
        assert e.token_ids == list(req.all_token_ids[i * BS:(i + len(e.block_hashes)) * BS])
        assert e.parent_block_hash == (None if i == 0 else hashes_of(req, i - 1, 1)[0])
