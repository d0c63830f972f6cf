"""vLLM's own controls reaching kvshim, through vLLM 0.33's real Scheduler
(tests/vllm/harness/): reset_prefix_cache(reset_connector=True), the
per-tier hit sources in vLLM's connector prefix-cache stats, per-request
kv_transfer_params and kv_role. The L2 is a real fs adapter of the embedded
server in a temporary directory.

Not tested here: a real `vllm serve` (POST /reset_prefix_cache, /metrics,
two engines for prefill/decode) — tests/e2e; Redis and Mooncake hit sources
(the Go tests check the tier each adapter type maps to).
"""

from __future__ import annotations

import logging

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from harness import CHUNK, assert_clean, loads_of, prompt, run_until_scheduled, server_stats, store, wait_jobs


@pytest.fixture
def kv_l2(kv, tmp_path):
    """kv() with an fs L2 whose fills stay resident in L1."""

    def make(**kw):
        extra = {"kvshim.l2_adapters": [{"type": "fs", "base_path": str(tmp_path / "l2")}]}
        extra.update(kw.pop("kv_connector_extra_config", {}))
        return kv(kv_connector_extra_config=extra, **kw)

    return make


def hit(h, tokens, **kw):
    """A request over tokens, run until it is scheduled; its load's chunks
    (0 when nothing was loaded)."""
    req = h.add_request(h.make_request(tokens, max_tokens=1, **kw))
    run_until_scheduled(h, req)
    loaded = sum(ld["end"] - ld["start"] for st in h.steps for ld in loads_of(st, req.request_id))
    h.settle()
    return req, loaded


def hits_by_source(steps) -> dict[CacheHitSource, int]:
    """vLLM's connector prefix-cache hits by source over steps, as its
    stat loggers receive them (SchedulerStats of each step's outputs)."""
    out: dict[CacheHitSource, int] = {}
    for st in steps:
        for eco in st.engine_core_outputs.values():
            cs = eco.scheduler_stats and eco.scheduler_stats.connector_prefix_cache_stats
            for k, v in (cs.hits_by_source if cs else {}).items():
                out[k] = out.get(k, 0) + v
    return out


def wait_l2_files(path, n: int, timeout_s: float = 10.0) -> None:
    """Until the fs L2 under path holds n objects (its writes are asynchronous)."""
    import time

    deadline = time.monotonic() + timeout_s
    while sum(1 for f in path.rglob("*") if f.is_file() and not f.name.startswith(".")) < n:
        assert time.monotonic() < deadline, f"fewer than {n} objects in {path}"
        time.sleep(0.02)


def test_reset_prefix_cache_makes_every_tier_miss(kv_l2):
    h, r = kv_l2()
    p = prompt(71, 3 * CHUNK + 5)
    store(h, r, p)
    _, loaded = hit(h, p)
    assert loaded == 3  # from L1
    assert h.scheduler.reset_prefix_cache(reset_connector=True) is True
    st0 = server_stats(h.connector)
    assert st0["kvshim_resets_total"] == 1
    _, loaded = hit(h, p)
    assert loaded == 0  # not from L1, not refilled from the fs L2 that still holds the chunks
    st = server_stats(h.connector)
    assert st["kvshim_lookup_hit_chunks_total"] == st0["kvshim_lookup_hit_chunks_total"]
    # After the reset kvshim works as before: computed again, saved, found.
    wait_jobs(h)
    _, loaded = hit(h, p)
    assert loaded == 3
    assert_clean(h)


def test_reset_fails_when_the_server_is_gone(kv, tmp_path):
    from harness import ServerProcess

    srv = ServerProcess(tmp_path / "kvshim.sock").start()
    h, _ = kv(server=str(tmp_path / "kvshim.sock"))
    srv.kill()
    # vLLM reports the failure instead of claiming a reset that did not happen.
    assert h.scheduler.reset_prefix_cache(reset_connector=True) is False


def test_hit_sources_split_by_tier(kv, tmp_path):
    # Two engines, each with its own embedded server (own L1), one fs L2:
    # A computes the prompt; B finds its first chunk in B's L1 (it computed
    # that chunk itself) and the rest on disk. vLLM's connector prefix-cache
    # stats get the split, summing to the hit.
    l2 = tmp_path / "l2"
    extra = {"kvshim.l2_adapters": [{"type": "fs", "base_path": str(l2)}]}
    ha, _ = kv(kv_connector_extra_config=extra, engine_id="engine-a")
    hb, rb = kv(kv_connector_extra_config=extra, engine_id="engine-b")
    p = prompt(72, 3 * CHUNK + 5)
    store(hb, rb, p[: CHUNK + 5])  # B computes chunk 0: in B's L1 and on disk
    wait_l2_files(l2, 1)
    ha.add_request(ha.make_request(p, max_tokens=1))  # A: chunk 0 from disk, chunks 1 and 2 computed
    ha.settle()
    wait_l2_files(l2, 3)
    first = len(hb.steps)
    _, loaded = hit(hb, p)
    assert loaded == 3
    assert hits_by_source(hb.steps[first:]) == {CacheHitSource.HOST: CHUNK, CacheHitSource.DISK: 2 * CHUNK}
    assert_clean(hb)


def test_kv_transfer_params_skip_save_and_skip_load(kv):
    h, r = kv()
    p = prompt(73, 2 * CHUNK + 5)
    store(h, r, p, kv_transfer_params={"kvshim.skip_save": True})
    assert r.kvshim.worker.stats().counters["SavedChunks"] == 0
    store(h, r, p)
    assert r.kvshim.worker.stats().counters["SavedChunks"] == 2
    lookups = server_stats(h.connector)["kvshim_lookups_total"]
    _, loaded = hit(h, p, kv_transfer_params={"kvshim.skip_load": True, "do_remote_prefill": False})
    assert loaded == 0
    assert server_stats(h.connector)["kvshim_lookups_total"] == lookups  # never asked
    _, loaded = hit(h, p)
    assert loaded == 2
    assert_clean(h)


def test_kv_transfer_params_unknown_key_is_named_and_fails_closed(kv, caplog):
    h, r = kv()
    p = prompt(74, 2 * CHUNK + 5)
    with caplog.at_level(logging.WARNING, logger="vllm.kvshim"):
        store(h, r, p, kv_transfer_params={"kvshim.skip_saves": True})
    assert any('"kvshim.skip_saves"' in m for m in caplog.messages), caplog.messages
    # The engine went on; the request was served without kvshim: nothing saved.
    assert r.kvshim.worker.stats().counters["SavedChunks"] == 0
    assert_clean(h)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kv_role(kv, role):
    h, r = kv(kv_role=role)
    p = prompt(75, 2 * CHUNK + 5)
    store(h, r, p)
    saved = r.kvshim.worker.stats().counters["SavedChunks"]
    lookups = server_stats(h.connector)["kvshim_lookups_total"]
    _, loaded = hit(h, p)
    if role == "kv_producer":
        assert saved == 2 and loaded == 0
        assert server_stats(h.connector)["kvshim_lookups_total"] == lookups
    else:
        assert saved == 0 and loaded == 0  # nothing was saved to load
    assert_clean(h)


def test_build_prom_metrics_in_vllms_registry(kv):
    # vLLM's own KVConnectorProm (what PrometheusStatLogger builds for
    # /metrics) over kvshim's connector class, fed each step's
    # SchedulerStats.kv_connector_stats as vLLM's logger feeds it.
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    h, r = kv()
    prom = KVConnectorProm(h.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom.prom_metrics is not None
    p = prompt(76, 2 * CHUNK + 5)
    store(h, r, p)
    _, loaded = hit(h, p)
    assert loaded == 2
    for st in h.steps:
        for eco in st.engine_core_outputs.values():
            if eco.scheduler_stats and eco.scheduler_stats.kv_connector_stats:
                prom.observe(eco.scheduler_stats.kv_connector_stats, 0)

    def sample(name: str) -> float:
        v = prometheus_client.REGISTRY.get_sample_value(name, {"model_name": "tiny", "engine": "0"})
        assert v is not None, name
        return v

    assert sample("vllm:kvshim_saved_chunks_total") == 2
    assert sample("vllm:kvshim_loaded_chunks_total") == 2
    assert sample("vllm:kvshim_hit_tokens_total") == 2 * CHUNK
    assert sample("vllm:kvshim_failed_loads_total") == 0
    assert sample("vllm:kvshim_load_seconds_count") >= 1  # one load job (one rank)
    assert sample("vllm:kvshim_save_seconds_count") >= 1
    assert sample("vllm:kvshim_load_seconds_sum") > 0
