"""kvshim.layerwise and kvshim.sync_load through vLLM 0.33's real scheduler
and connector classes.

kvshim.sync_load loads a hit in the step that computes it, as layer-wise
loads do, but waits for the whole load in start_load_kv and saves after the
forward pass as by default.

With kvshim.layerwise on, get_num_new_matched_tokens says the load is not
asynchronous: vLLM schedules the request in the step that loads it, the
model runner calls start_load_kv before the forward pass, and each attention
layer calls wait_for_layer_load(layer) before it reads the KV cache.
LayerwiseRunner is harness.ModelRunner with that forward pass: before the
runner reads anything of a layer (its prefix checks, then its writes) it
waits for that layer, in vLLM's layer order, and records what the wait
found. Failures with layer-wise loads, the delayed-copy ordering and bytes
of every layout are also covered in Go (shim/layerwise_test.go,
layout/layerplan_test.go); the TTFT effect is a GPU figure
(build/gpu-check.sh). What cannot be tested here: a real forward pass
overlapping the copies (no GPU; `vllm serve` e2e is the lead's).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout

from harness import (
    CHUNK,
    ModelRunner,
    SchedulerHarness,
    kvshim_config,
    loads_of,
    make_kv_cache_config,
    new_req_data,
    prompt,
    store,
    wait_stat,
)

BLOCK = 16


class LayerwiseRunner(ModelRunner):
    """ModelRunner whose forward pass waits for each layer's load first."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.waited: list[str] = []

    def _wait_layers(self, wc: Any) -> None:
        for name in self.layer_names:  # the attention layers, in the forward pass's order
            wc.wait_for_layer_load(name)
            self.waited.append(name)


@pytest.fixture
def lw(tiny_model_dir):
    made: list[SchedulerHarness] = []

    def make(layout: str | None = None, mode: str = "layerwise") -> tuple[SchedulerHarness, LayerwiseRunner]:
        extra = {} if mode == "async" else {f"kvshim.{mode}": True}
        cfg = kvshim_config(tiny_model_dir, enable_prefix_caching=False, kv_connector_extra_config=extra)
        cfg.cache_config.kv_cache_layout = layout
        kvc = make_kv_cache_config(num_blocks=128)
        h = SchedulerHarness(cfg, kvc)
        r = LayerwiseRunner(cfg, kvc)
        h.runners = [r]
        made.append(h)
        return h, r

    yield make
    for h in made:
        h.close()


@pytest.mark.parametrize("mode", ["layerwise", "sync_load"])
@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
def test_hit_is_loaded_in_the_step_that_computes_it(lw, layout, mode):
    # kvshim.sync_load: the whole load before the forward pass, in
    # start_load_kv; kvshim.layerwise: each layer before it is read.
    h, r = lw(layout=layout, mode=mode)
    p = prompt(21, 2 * CHUNK + 5)
    store(h, r, p, max_tokens=1)
    wait_stat(h, "kvshim_l1_commits_total", 2)
    r.scribble()
    b = h.add_request(h.make_request(p + prompt(22, 7), max_tokens=2))
    s = h.step()
    # Synchronous: scheduled in the step whose metadata carries the load.
    assert b.request_id in s.num_scheduled_tokens
    (ld,) = loads_of(s, b.request_id)
    assert (ld["start"], ld["end"]) == (0, 2)
    assert new_req_data(s, b.request_id).num_computed_tokens == 2 * CHUNK
    # Every layer was waited for, before the runner read the restored blocks.
    assert r.waited[-len(r.layer_names):] == r.layer_names
    assert r.prefix_checks[b.request_id] == (2 * CHUNK, [])
    assert r.check_blocks(b.prompt_token_ids, r.reqs[b.request_id].blocks[: 2 * CHUNK // BLOCK]) == []
    # Not reported received (vLLM asserts on that for a running request).
    assert b.request_id not in (s.kv_connector_output.finished_recving or ())
    h.settle()
    assert all(not e for e in r.load_errors)
    h.assert_no_leaks()
    w = r.kvshim.worker.stats().counters
    assert w["LoadedChunks"] == 2 and w["LayerwiseLoads"] == 1 and w["FailedLoads"] == 0


def test_default_keeps_asynchronous_loads(lw):
    h, r = lw(mode="async")
    p = prompt(31, 2 * CHUNK + 5)
    store(h, r, p, max_tokens=1)
    wait_stat(h, "kvshim_l1_commits_total", 2)
    b = h.add_request(h.make_request(p + prompt(32, 7), max_tokens=1))
    s = h.step()
    assert b.request_id not in s.num_scheduled_tokens  # waits for its load first
    h.settle()
    h.assert_no_leaks()
    w = r.kvshim.worker.stats().counters
    assert w["LoadedChunks"] == 2 and w["LayerwiseLoads"] == 0
