#!/usr/bin/env bash
# Lints the Python side (python/kvshim and tests): ruff (style and bug
# patterns), then mypy --strict (types). Configuration: pyproject.toml's
# [tool.ruff] and [tool.mypy]. The tools come from their own small venv
# (python/requirements-lint.txt).
#
# mypy checks the code against the real vllm, torch, numpy and pytest: it
# reads them from the test venv (python/requirements-test.txt, built by
# build/test.sh anyway) through --python-executable, so KVShimConnector's
# overrides are checked against vLLM's KVConnectorBase_V1 and a vLLM
# upgrade that changes a signature fails here, not in production. It does
# not import them, so nothing native is loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
lint=$(build/venv.sh python/requirements-lint.txt)
test_venv=$(build/venv.sh python/requirements-test.txt)
cache=${KVSHIM_CACHE:-$HOME/.cache/kvshim}

echo "== ruff"
"$lint/bin/ruff" check --no-cache python/kvshim tests

echo "== mypy"
# tests/ and tests/vllm each have a conftest.py and put themselves on
# sys.path (rig, harness): two runs, so each sees its own top-level modules.
export MYPY_CACHE_DIR="$cache/mypy"
MYPYPATH=python:tests "$lint/bin/mypy" --python-executable "$test_venv/bin/python" python/kvshim tests/*.py
MYPYPATH=python:tests/vllm "$lint/bin/mypy" --python-executable "$test_venv/bin/python" tests/vllm
# tests/e2e runs in the CPU build's venv (vLLM 0.32.0); its imports (requests,
# transformers, pytest) are in the test venv as well, and it imports nothing
# of vLLM's.
MYPYPATH=python:tests/e2e "$lint/bin/mypy" --python-executable "$test_venv/bin/python" tests/e2e
