#!/usr/bin/env bash
# Usage: build/venv.sh REQUIREMENTS_FILE
# Prints the path of a virtualenv with those requirements installed. The
# virtualenv lives outside the clone, keyed by the requirements' hash and the
# Python version, so reruns and later clones reuse it.
#
# Concurrent runs (two clones, two `make test`s) share it safely: the first
# builds it while holding a lock (flock on VENV.lock, beside it), the others
# wait for that lock and reuse the result. A virtualenv is built in a
# directory of its own (VENV.build-XXXXXX; a virtualenv cannot be moved once
# built: its scripts name their directory) and published by renaming a
# symlink onto VENV, so nobody ever sees half of one, and a run that was
# killed leaves only a build directory that the next one removes.
# Everything but the printed path goes to stderr, pip's progress included.
#
# Install hook: a requirements file whose pins pip cannot install alone (the
# CPU build of vLLM: python/requirements-e2e.txt) names a script on a line
#   #!install: SCRIPT [FILE...]
# (paths relative to the repository root, or absolute). venv.sh then runs
#   SCRIPT BUILD_DIR REQUIREMENTS_FILE [FILE...]
# in place of `pip install -r`, inside the same lock and atomic publish. The
# key then also hashes SCRIPT and every FILE, so editing the installer (or a
# base requirements file a layer builds on) makes a new virtualenv. Files
# without the line keep the keys they always had.
set -euo pipefail
req=$1
py=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
hook=()
if line=$(grep -m1 '^#!install:' "$req"); then
  read -r -a hook <<<"${line#\#!install:}"
  for i in "${!hook[@]}"; do [[ ${hook[i]} == /* ]] || hook[i]=$root/${hook[i]}; done
fi
key=$( (cat "$req"; $py -c 'import sys; print(sys.version)'; [ ${#hook[@]} -eq 0 ] || cat "${hook[@]}") | sha256sum | cut -c1-16)
name=$(basename "$req" .txt)
venv=${KVSHIM_CACHE:-$HOME/.cache/kvshim}/venv-$name-$key

if [ ! -f "$venv/.complete" ]; then
  mkdir -p "$(dirname "$venv")"
  exec 9>>"$venv.lock"
  if ! flock -n 9; then
    echo "waiting for another run that is building $venv" >&2
    flock 9
  fi
  if [ ! -f "$venv/.complete" ]; then
    # We hold the lock: any build directory or unfinished virtualenv here is
    # a dead run's.
    rm -rf "$venv.build-"* "$venv.link-"*
    [ -L "$venv" ] || rm -rf "$venv"
    echo "creating $venv with $($py -c 'import sys; print("Python", sys.version.split()[0])') (first run only); it installs the newest pip, then:" >&2
    grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$req" | sed 's/^/    /' >&2
    build=$(mktemp -d "$venv.build-XXXXXX")
    chmod 755 "$build"  # mktemp makes it 0700
    $py -m venv "$build" >&2
    "$build/bin/python" -m pip install --upgrade pip >&2
    # No --quiet: pip's own progress (each package as it is collected and
    # downloaded, with its size) shows while the first run downloads.
    if [ ${#hook[@]} -gt 0 ]; then
      echo "installing with ${hook[0]#"$root/"} (the requirements file's #!install: line)" >&2
      "${hook[0]}" "$build" "$req" "${hook[@]:1}" >&2
    else
      "$build/bin/python" -m pip install -r "$req" >&2
    fi
    touch "$build/.complete"
    ln -s "$(basename "$build")" "$venv.link-$$"
    mv -T "$venv.link-$$" "$venv"  # rename(2): atomic, replaces an old symlink
    echo "created $venv" >&2
  fi
  exec 9>&-
fi
echo "$venv"
