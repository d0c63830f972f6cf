"""KV events (take_events) through vLLM 0.33's real Scheduler
(tests/vllm/harness.py) with --kv-events-config's enable_kv_cache_events:
what the scheduler hands its KV-event publisher (vLLM's KVEventBatch of
BlockStored / AllBlocksCleared) after kvshim's saves commit, after a save
that was not committed, and after reset_prefix_cache.

Not tested here: the ZMQ publisher of a real `vllm serve` (tests/e2e);
BlockRemoved (kvshim does not report evictions yet: docs/vllm-controls.md).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, EventBatch, EventPublisher
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from harness import CHUNK, ModelRunner, SchedulerHarness, kvshim_config, make_kv_cache_config, prompt, wait_jobs

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

    def make(events: bool = True) -> tuple[SchedulerHarness, ModelRunner, Recorder]:
        cfg = kvshim_config(tiny_model_dir, enable_prefix_caching=False)
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
    wait_jobs(h)
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
    wait_jobs(h)
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
