#!/usr/bin/env bash
# Usage: build/venv.sh REQUIREMENTS_FILE
# Prints the path of a virtualenv with those requirements installed. The
# virtualenv lives outside the clone, keyed by the requirements' hash and the
# Python version, so reruns and later clones reuse it.
set -euo pipefail
req=$1
py=${PYTHON:-python3}
key=$( (cat "$req"; $py -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
name=$(basename "$req" .txt)
venv=${KVSHIM_CACHE:-$HOME/.cache/kvshim}/venv-$name-$key
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  echo "creating $venv from $req (first run only)" >&2
  $py -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --upgrade pip >&2
  "$venv/bin/pip" install --quiet -r "$req" >&2
  touch "$venv/.complete"
fi
echo "$venv"
