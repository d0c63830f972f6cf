"""get_kv_connector_stats reports each worker's counters since its last
report, and vLLM's aggregation across workers sums them. CPU tensors stand
in for GPU memory (no GPU here)."""

from harness import CHUNK, ModelRunner, SchedulerHarness, kvshim_config, make_kv_cache_config, prompt, wait_stat

from kvshim.vllm import KVShimConnector, KVShimStats


def test_stats_aggregate_and_reduce():
    a = KVShimStats(data={"saved_chunks": 2, "loaded_chunks": 1})
    b = KVShimConnector.build_kv_connector_stats({"saved_chunks": 3, "failed_loads": 1})
    assert a.aggregate(b).reduce() == {"saved_chunks": 5, "loaded_chunks": 1, "failed_loads": 1}
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()


def test_worker_reports_saved_chunks_once(tiny_model_dir):
    cfg = kvshim_config(tiny_model_dir, enable_prefix_caching=False)
    kvc = make_kv_cache_config(num_blocks=64)
    h = SchedulerHarness(cfg, kvc)
    r = ModelRunner(cfg, kvc)
    h.runners = [r]
    try:
        h.add_request(h.make_request(prompt(5, 3 * CHUNK + 4), max_tokens=1))
        h.step()
        wait_stat(h, "kvshim_l1_commits_total", 3)
        st = r.connector.get_kv_connector_stats()
        assert st is not None and st.data["saved_chunks"] == 3
        assert st.data["saved_bytes"] > 0 and st.data["failed_saves"] == 0
        assert r.connector.get_kv_connector_stats() is None  # nothing new since
    finally:
        h.close()
