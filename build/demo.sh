#!/usr/bin/env bash
# The README's first command: run the demo on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(build/venv.sh python/requirements-demo.txt)
export KVSHIM_LIBRARY="$PWD/out/libkvshim.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/python" -m kvshim demo "$@"
