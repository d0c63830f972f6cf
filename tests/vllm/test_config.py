"""kv_connector_extra_config: no setting is silently ignored.

Each case failed before: the nested form vLLM's dotted CLI produces was
ignored (16 GiB instead of 4), l1_size_gb <= 0 became 16 GiB, a JSON string
of adapters gave one error per character, a non-number gave a bare
`invalid literal for int()` that did not name the key.
"""

from __future__ import annotations

import pytest

from kvshim.vllm import read_config


def test_nested_form_is_the_same_setting():
    assert read_config({"kvshim": {"l1_size_gb": 4}})["kvshim.l1_size_gb"] == 4.0
    assert read_config({"kvshim": {"l1_size_gb": 4}, "kvshim.l1_size_gb": 4})["kvshim.l1_size_gb"] == 4.0
    with pytest.raises(ValueError, match=r'unknown .*"kvshim.l1_size"'):
        read_config({"kvshim": {"l1_size": 4}})
    with pytest.raises(ValueError, match="given twice"):
        read_config({"kvshim": {"l1_size_gb": 4}, "kvshim.l1_size_gb": 8})
    with pytest.raises(ValueError, match="kvshim: want an object"):
        read_config({"kvshim": 3})


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"kvshim.l1_size_gb": 0}, "kvshim.l1_size_gb: must be > 0, got 0"),
        ({"kvshim.l1_size_gb": -1}, "kvshim.l1_size_gb: must be > 0"),
        ({"kvshim.chunk_size": "abc"}, 'kvshim.chunk_size: want a number, got "abc"'),
        ({"kvshim.timeout_ms": True}, "kvshim.timeout_ms: want a number"),
        ({"kvshim.l2_adapters": "[{"}, "kvshim.l2_adapters: not a JSON list"),
        ({"kvshim.l2_adapters": 3}, "kvshim.l2_adapters: want a list of adapters"),
        ({"kvshim.verify": "sometimes"}, 'kvshim.verify: "sometimes" is not one of'),
        ({"kvshim.l1_prefault_gb": -2}, "kvshim.l1_prefault_gb: must be >= 0"),
        ({"kvshim.server": ""}, "kvshim.server: want a non-empty string"),
    ],
)
def test_bad_values_name_their_key(extra, message):
    with pytest.raises(ValueError) as e:
        read_config(extra)
    assert message in str(e.value)


def test_values_are_converted():
    cfg = read_config({"kvshim.chunk_size": "512", "kvshim.l2_adapters": '[{"type": "fs", "base_path": "/x"}]',
                       "kvshim.l1_prefault_gb": 0})
    assert cfg["kvshim.chunk_size"] == 512
    assert cfg["kvshim.l2_adapters"] == [{"type": "fs", "base_path": "/x"}]
    assert cfg["kvshim.l1_prefault_gb"] == 0.0
    assert read_config({"kvshim.l2_adapters": {"type": "fs", "base_path": "/x"}})["kvshim.l2_adapters"] == [
        {"type": "fs", "base_path": "/x"}]
    assert read_config({})["kvshim.l1_size_gb"] == 16.0


def test_connector_says_it_is_active_and_warns_once_when_the_server_is_away(tiny_model_dir, tmp_path, caplog, capfd):
    """One INFO line at start-up names the version, role and settings; a
    server that cannot be reached is one WARNING (rate-limited), not silence
    and not a line per request."""
    from harness import ModelRunner, SchedulerHarness, kvshim_config, make_kv_cache_config, prompt

    cfg = kvshim_config(tiny_model_dir, server=str(tmp_path / "none.sock"), timeout_ms=300, enable_prefix_caching=False)
    kvc = make_kv_cache_config(num_blocks=64)
    with caplog.at_level("INFO", logger="vllm.kvshim"):
        h = SchedulerHarness(cfg, kvc)
    try:
        assert "active: role=scheduler server=" + str(tmp_path / "none.sock") in caplog.text
        h.runners = [ModelRunner(cfg, kvc)]
        for i in range(3):
            h.add_request(h.make_request(prompt(40 + i, 200), max_tokens=1))
            h.settle()
        err = capfd.readouterr().err
        assert err.count("cannot reach the server") == 2, err  # the scheduler's link and the worker's, once each
    finally:
        h.close()


def test_required_layout_is_read_without_the_library():
    """get_required_kvcache_layout may be asked before vLLM forks: it reads
    the key, flat or nested, in Python; a name vLLM does not know is refused."""
    from kvshim.vllm.config import required_layout

    assert required_layout({"kvshim": {"kv_cache_layout": "BLNHC"}}) == "BLNHC"
    assert required_layout({"kvshim.kv_cache_layout": "BLHNC"}) == "BLHNC"
    assert required_layout({}) is None
    with pytest.raises(ValueError, match=r"kvshim\.kv_cache_layout: 'NHD' is not one of"):
        required_layout({"kvshim.kv_cache_layout": "NHD"})
