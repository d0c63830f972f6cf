#!/usr/bin/env bash
# Usage: build/seaweedfs.sh [--cached]
# Prints the path of a SeaweedFS `weed` binary (the S3 L2 tests' real S3
# server), building it the first time. With --cached it never builds: it
# prints the path if the binary is there and exits 1 otherwise (what the
# tests call, so a plain `go test ./...` never starts a 16-minute build). The binary lives outside the clone,
# keyed by the module version, so reruns and later clones reuse it.
#
# Why it is built this way: `go install github.com/seaweedfs/seaweedfs/weed@V`
# refuses the module (its go.mod has replace directives), so the module is
# fetched with `go mod download` (from the Go proxy, like every other Go
# dependency), copied to a writable directory and built there with its own
# go.mod. About 16 minutes and 233 MB on two busy cores, once.
#
# Concurrent runs share it as build/venv.sh's virtualenvs do: the first builds
# while holding a flock on DIR.lock, the others wait for it; the binary is
# built in a directory of its own and published by rename(2), so nobody sees
# half of one, and a killed run leaves only a build directory that the next
# run removes. Everything but the printed path goes to stderr.
set -euo pipefail
mod=github.com/seaweedfs/seaweedfs
ver=${KVSHIM_SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}
dir=${KVSHIM_CACHE:-$HOME/.cache/kvshim}/seaweedfs-$ver
weed=$dir/weed

if [ "${1:-}" = --cached ]; then
  [ -x "$weed" ] || { echo "build/seaweedfs.sh: $weed is not built (run build/seaweedfs.sh)" >&2; exit 1; }
  echo "$weed"
  exit 0
fi

if [ ! -x "$weed" ]; then
  mkdir -p "$(dirname "$dir")"
  exec 9>>"$dir.lock"
  if ! flock -n 9; then
    echo "waiting for another run that is building $weed" >&2
    flock 9
  fi
  if [ ! -x "$weed" ]; then
    rm -rf "$dir.build-"*
    echo "building SeaweedFS $mod@$ver into $weed (first run only: about 16 minutes on 2 cores, 233 MB)" >&2
    src=$(go mod download -json "$mod@$ver" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [ -n "$src" ] && [ -d "$src" ] || { echo "build/seaweedfs.sh: go mod download gave no source directory for $mod@$ver" >&2; exit 1; }
    build=$(mktemp -d "$dir.build-XXXXXX")
    chmod 755 "$build"
    # The module cache is read-only; the build writes go.sum entries.
    cp -r "$src" "$build/src"
    chmod -R u+w "$build/src"
    (cd "$build/src" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -o "$build/weed" ./weed) >&2
    mkdir -p "$dir"
    mv "$build/weed" "$weed.tmp-$$"
    mv -T "$weed.tmp-$$" "$weed"  # rename(2): atomic
    rm -rf "$build"
    echo "built $weed" >&2
  fi
  exec 9>&-
fi
echo "$weed"
