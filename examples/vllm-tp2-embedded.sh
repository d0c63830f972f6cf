#!/bin/sh
# vLLM at TP=2 with kvshim's embedded server (the default: no
# "kvshim.server" key): the server runs inside vLLM's engine process, with
# 32 GiB of L1 in host memory shared with both GPU workers; nothing else
# to start. Install the wheel into vLLM's environment first (README).
# tests/test_examples.py parses this command line with vLLM's own parser
# and the connector's read_config.
exec vllm serve Qwen/Qwen3-8B \
  --tensor-parallel-size 2 \
  --kv-transfer-config '{"kv_connector": "KVShimConnector", "kv_connector_module_path": "kvshim.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"kvshim.l1_size_gb": 32}}'
