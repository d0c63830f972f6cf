#!/bin/sh
# Several vLLM instances on one host sharing one kvshim server (its L1 and
# L2): start the server once (deploy/kvshim.service does the same under
# systemd), then point each vLLM at its socket with "kvshim.server". vLLM
# and the server must run as the same user (the socket is 0600).
# tests/test_examples.py checks both command lines with the product's
# parsers (kvshim serve's flags and --config file; vLLM's arguments and
# the connector's read_config).
set -e
kvshim serve --config deploy/kvshim.conf --socket /run/kvshim/kvshim.sock --l1-size-gb 128 \
  --l2-adapter "$(cat examples/l2-fs.json)" &

CUDA_VISIBLE_DEVICES=0,1 vllm serve Qwen/Qwen3-8B --port 8000 \
  --tensor-parallel-size 2 \
  --kv-transfer-config '{"kv_connector": "KVShimConnector", "kv_connector_module_path": "kvshim.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"kvshim.server": "/run/kvshim/kvshim.sock"}}' &
CUDA_VISIBLE_DEVICES=2 vllm serve Qwen/Qwen3-8B --port 8001 \
  --kv-transfer-config '{"kv_connector": "KVShimConnector", "kv_connector_module_path": "kvshim.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"kvshim.server": "/run/kvshim/kvshim.sock"}}' &
wait
