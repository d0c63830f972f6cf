"""Drive vLLM's real v1 Scheduler and a KV connector on a machine without a GPU.

Nothing of vLLM is replaced: the VllmConfig is built from a local directory that
holds only a tiny Llama ``config.json`` (no Hugging Face download, no tokenizer),
the connector is created by vLLM's own ``KVConnectorFactory`` (inside
``Scheduler.__init__`` for the SCHEDULER role; directly for the WORKER role),
requests are real ``vllm.v1.request.Request`` objects with vLLM's block hasher,
and each step runs ``schedule()`` (which calls ``build_connector_meta``) and
``update_from_output()``. Only the model is absent: the model-runner output
carries one fake sampled token per request that finished its prefill.

The recipe follows vLLM's own unit-test helpers in
tests/v1/kv_connector/unit/utils.py of the vllm-project/vllm repository
(create_vllm_config, create_scheduler, create_request,
create_model_runner_output); this is a rewrite for kvshim's needs: no hub
download, connectors loaded by module path, an optional worker-role connector
driven in the order of vllm/v1/worker/kv_connector_model_runner_mixin.py, and
leak checks.

Typical use::

    cfg = make_vllm_config(model_dir, kv_connector="KVShimConnector",
                           kv_connector_module_path="kvshim.vllm")
    h = SchedulerHarness(cfg, num_blocks=256, with_worker=True)
    req = h.add_request(h.make_request(list(range(100)), max_tokens=4))
    h.run_until_idle()
    h.assert_no_leaks()

KV bytes without a GPU: ``ModelRunner`` plays one rank's GPU model runner.
Its KV cache is made by vLLM's own ``allocate_kv_cache`` on the CPU
(standing in for GPU memory): one buffer viewed as ``(num_blocks, kv_heads,
block_size, K|V)`` per layer in the resolved ``KVCacheLayout``, exactly what
vLLM 0.33's GPU model runner registers with a WORKER-role connector through
``register_kv_caches``. Its "forward pass" writes, for every scheduled token,
KV bytes that are a deterministic function of the token prefix up to it
(``KVModel``), so a restored block can be checked byte for byte. Pass
``SchedulerHarness(..., runners=[ModelRunner(...), ...])``; with more than one
runner (TP) their outputs are combined by vLLM's own KVOutputAggregator.

The package, by concern: ``config`` (the tiny model, vLLM and KV-cache
configs), ``scheduler`` (SchedulerHarness), ``runner`` (KVModel and the one
worker-step driver, WorkerStepDriver, with ModelRunner and
HybridModelRunner), ``checks`` (helpers of the connector tests), ``server``
(ServerProcess) and ``ranks`` (ranks in spawned processes). Everything is
re-exported here: tests import ``from harness import ...``.
"""

from __future__ import annotations

from .checks import (
    assert_clean,
    connector_output,
    loads_of,
    new_req_data,
    prompt,
    released,
    run_until_scheduled,
    saves_of,
    server_stats,
    store,
    wait_jobs,
    wait_stat,
)
from .config import (
    CHUNK,
    EOS_TOKEN_ID,
    GEMMA3_LAYERS,
    HEAD_SIZE,
    LLAMA4_LAYERS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    TINY_LLAMA_CONFIG,
    hybrid_kv_cache_config,
    hybrid_layer_specs,
    kvshim_config,
    layer_names,
    make_kv_cache_config,
    make_vllm_config,
    resolve_layout,
    skipped_tokens,
    write_tiny_model_dir,
)
from .ranks import (
    Proc,
    Ranks,
    WorldHarness,
)
from .runner import (
    ConnectorStepDriver,
    HybridModelRunner,
    HybridStepDriver,
    KVModel,
    ModelRunner,
    WorkerStepDriver,
    _HybridReq,
    _RunnerReq,
    as_kvshim,
    collect_worker_output,
)
from .scheduler import (
    SchedulerHarness,
    StepResult,
)
from .server import ServerProcess

__all__ = [
    "CHUNK",
    "EOS_TOKEN_ID",
    "GEMMA3_LAYERS",
    "HEAD_SIZE",
    "LLAMA4_LAYERS",
    "NUM_KV_HEADS",
    "NUM_LAYERS",
    "TINY_LLAMA_CONFIG",
    "ConnectorStepDriver",
    "HybridModelRunner",
    "HybridStepDriver",
    "KVModel",
    "ModelRunner",
    "Proc",
    "Ranks",
    "SchedulerHarness",
    "ServerProcess",
    "StepResult",
    "WorkerStepDriver",
    "WorldHarness",
    "_HybridReq",
    "_RunnerReq",
    "as_kvshim",
    "assert_clean",
    "collect_worker_output",
    "connector_output",
    "hybrid_kv_cache_config",
    "hybrid_layer_specs",
    "kvshim_config",
    "layer_names",
    "loads_of",
    "make_kv_cache_config",
    "make_vllm_config",
    "new_req_data",
    "prompt",
    "released",
    "resolve_layout",
    "run_until_scheduled",
    "saves_of",
    "server_stats",
    "skipped_tokens",
    "store",
    "wait_jobs",
    "wait_stat",
    "write_tiny_model_dir",
]
