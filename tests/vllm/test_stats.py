"""get_kv_connector_stats reports each worker's counters since its last
report, and vLLM's aggregation across workers sums them. CPU tensors stand
in for GPU memory (no GPU here)."""

from typing import Any

from harness import CHUNK, ModelRunner, SchedulerHarness, kvshim_config, make_kv_cache_config, prompt, wait_stat
from kvshim.vllm import KVShimConnector, KVShimStats


def test_stats_aggregate_and_reduce():
    a = KVShimStats(data={"saved_chunks": 2, "loaded_chunks": 1})
    b = KVShimConnector.build_kv_connector_stats({"saved_chunks": 3, "failed_loads": 1})
    red = a.aggregate(b).reduce()
    assert {k: v for k, v in red.items() if v} == {"saved_chunks": 5, "loaded_chunks": 1, "failed_loads": 1}
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
        step = h.step()
        wait_stat(h, "kvshim_l1_commits_total", 3)
        h.wait_workers()  # the worker counts a save once its COMMIT is answered, after the server did
        # The step's own stats read (vLLM's, in the runner) may already have
        # counted saves that ended within the step: the two reports add up.
        st = KVShimStats(data={})
        out = step.kv_connector_output
        for part in (out.kv_connector_stats if out is not None else None, r.connector.get_kv_connector_stats()):
            if part is not None:
                st.aggregate(part)
        assert st.data["saved_chunks"] == 3
        assert st.data["saved_bytes"] > 0 and st.data["failed_saves"] == 0
        assert r.connector.get_kv_connector_stats() is None  # nothing new since
    finally:
        h.close()


def test_reduce_prints_summary_keys_in_order():
    st = KVShimStats(data={"loaded_bytes": 10, "copy_spans": 4, "hit_tokens": 64})
    red = st.reduce()
    assert list(red)[: len(KVShimStats.SUMMARY)] == list(KVShimStats.SUMMARY)
    assert red["hit_tokens"] == 64 and red["loaded_bytes"] == 10 and red["failed_loads"] == 0
    assert red["copy_spans"] == 4


class _Lines:
    """vLLM's LoggingStatLogger writes through its module logger: catch the
    formatted lines."""

    def __init__(self, monkeypatch):
        from vllm.v1.metrics import loggers

        self.lines: list[str] = []
        for level in ("info", "debug"):
            monkeypatch.setattr(loggers.logger, level, lambda msg, *a, **k: self.lines.append(msg % a))

    def transfer(self) -> dict[str, int]:
        """The last "KV Transfer metrics: k=v, ..." line as a dict."""
        got = [ln for ln in self.lines if ln.startswith("KV Transfer metrics: ")]
        assert got, self.lines
        return {k: int(v) for k, v in (kv.split("=") for kv in got[-1].removeprefix("KV Transfer metrics: ").split(", "))}


def _scheduler_stats(result):
    (eco,) = result.engine_core_outputs.values()
    return eco.scheduler_stats


def test_vllm_aggregates_and_logs_two_tp_workers(tiny_model_dir, monkeypatch):
    """TP=2 in one process: two real worker connectors (ranks 0 and 1) save
    a prompt; a second request with the same prompt is a kvshim hit both
    ranks load. vLLM's own code carries the stats: KVOutputAggregator sums
    the two workers', Scheduler.update_from_output adds the scheduler
    connector's hit tokens and puts them in SchedulerStats, and
    LoggingStatLogger accumulates them over its interval and prints them."""
    from vllm.v1.metrics.loggers import LoggingStatLogger

    from harness import NUM_KV_HEADS

    engine_id = "stats-tp2"
    kw: dict[str, Any] = {"enable_prefix_caching": False, "tensor_parallel_size": 2, "engine_id": engine_id}
    cfgs = [kvshim_config(tiny_model_dir, rank=r, **kw) for r in range(2)]
    kvc = make_kv_cache_config(num_blocks=64, num_kv_heads=NUM_KV_HEADS // 2)
    h = SchedulerHarness(cfgs[0], kvc, runners=[ModelRunner(cfgs[r], kvc, rank=r) for r in range(2)])
    lines = _Lines(monkeypatch)
    stat_logger = LoggingStatLogger(cfgs[0])
    try:
        p = prompt(11, 3 * CHUNK + 4)
        h.add_request(h.make_request(p, max_tokens=1))
        results = h.run_until_idle()
        wait_stat(h, "kvshim_l1_commits_total", 6)  # 3 chunks x 2 ranks
        h.add_request(h.make_request(p, max_tokens=1))
        results += h.run_until_idle()
        for res in results:
            stat_logger.record(scheduler_stats=_scheduler_stats(res), iteration_stats=None)
        stat_logger.log()
        got = lines.transfer()
        assert got["hit_tokens"] == 3 * CHUNK and got["hit_requests"] == 1
        # Each rank saved and then loaded its own 3 chunks: vLLM summed both.
        assert got["saved_chunks"] == 6 and got["loaded_chunks"] == 6
        assert got["failed_loads"] == 0 and got["failed_saves"] == 0
        # Saved bytes are whole objects (header + KV), loaded ones the KV.
        assert got["saved_bytes"] > 0 and got["saved_bytes"] % 6 == 0
        assert 0 < got["loaded_bytes"] <= got["saved_bytes"] and got["loaded_bytes"] % 6 == 0
        # The interval was reset: nothing new, nothing printed.
        lines.lines.clear()
        stat_logger.log()
        assert not [ln for ln in lines.lines if ln.startswith("KV Transfer metrics")]
    finally:
        h.close()


def test_vllm_logs_failed_loads_per_worker_sum(tiny_model_dir, monkeypatch):
    """Two workers' failures in one step and a second step's, through
    KVOutputAggregator, update_from_output and LoggingStatLogger: the line
    printed sums both workers and both steps."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.metrics.loggers import LoggingStatLogger
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    cfg = kvshim_config(tiny_model_dir, enable_prefix_caching=False)
    h = SchedulerHarness(cfg)
    lines = _Lines(monkeypatch)
    stat_logger = LoggingStatLogger(cfg)
    agg = KVOutputAggregator(2)
    workers: list[list[dict[str, Any] | None]] = [
        [{"failed_loads": 1, "loaded_chunks": 2, "loaded_bytes": 200}, {"failed_loads": 2, "failed_saves": 1}],
        [{"saved_chunks": 1, "saved_bytes": 100}, None],
    ]
    try:
        h.add_request(h.make_request(prompt(3, 2 * CHUNK), max_tokens=2))
        for step in workers:
            so = h.scheduler.schedule()
            mros: list[ModelRunnerOutput | None] = [
                h.model_runner_output(so, kv_connector_output=KVConnectorOutput(
                    kv_connector_stats=None if d is None else KVShimConnector.build_kv_connector_stats(d)))
                for d in step
            ]
            mro = agg.aggregate(mros)
            assert mro is not None
            res = h.finish(so, mro)
            stat_logger.record(scheduler_stats=_scheduler_stats(res), iteration_stats=None)
        stat_logger.log()
        got = lines.transfer()
        assert got["failed_loads"] == 3 and got["failed_saves"] == 1
        assert got["loaded_chunks"] == 2 and got["loaded_bytes"] == 200
        assert got["saved_chunks"] == 1 and got["saved_bytes"] == 100
        assert got["hit_tokens"] == 0
    finally:
        h.close()
