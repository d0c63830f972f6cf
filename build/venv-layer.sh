#!/usr/bin/env bash
# Usage: build/venv-layer.sh VENV REQUIREMENTS_FILE BASE_REQUIREMENTS_FILE
# build/venv.sh's install hook for a layer: VENV (fresh, made by venv.sh) sees
# every package of the base venv (built from BASE_REQUIREMENTS_FILE by
# venv.sh, reused if it exists) through a .pth file, ahead of which pip
# installs REQUIREMENTS_FILE's pins with --no-deps. The base's console
# scripts (vllm) are linked into VENV/bin, running VENV's python, so they see
# the layer. venv.sh keys the layer by BASE_REQUIREMENTS_FILE too: a new base
# venv is a new layer.
set -euo pipefail
venv=$1
req=$2
base_req=$3
root=$(cd "$(dirname "$0")/.." && pwd)
base=$("$root/build/venv.sh" "$base_req")
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
echo "-- layer over $base" >&2
site "$base" >"$(site "$venv")/_kvshim_base_venv.pth"
"$venv/bin/python" -m pip install --progress-bar off --no-deps -r "$req"
for s in vllm; do
  # The __main__ guard: vLLM spawns its engine core with multiprocessing's
  # spawn, which imports this script again in the child.
  printf '#!%s\nimport sys\nfrom vllm.entrypoints.cli.main import main\nif __name__ == "__main__":\n    sys.exit(main())\n' \
    "$venv/bin/python" >"$venv/bin/$s"
  chmod +x "$venv/bin/$s"
done
"$venv/bin/python" -c 'import lmcache, vllm; print("layer imports lmcache", lmcache.__file__, "and vllm", vllm.__file__)' >&2
