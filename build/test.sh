#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run calls `make test`, which runs every
# part in this order). Each part also runs alone: build/test.sh PART, or its
# make target:
#   check     gofmt, go vet, go.mod tidy, the Python linters      (make check)
#   go        go test -race, Mooncake and S3 runs, C ABI test, GPU dry run (make test-go)
#   py        pytest tests/ outside tests/vllm, pyarrow traces     (make test-py)
#   vllm      pytest tests/vllm (vLLM 0.33.0's real classes)        (make test-vllm)
#   e2e       pytest tests/e2e (real `vllm serve`, CPU build 0.32.0) (make test-e2e)
# With no argument it runs all five. Every part first installs what it needs
# and this machine lacks, saying what before it installs.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${KVSHIM_CACHE:-$HOME/.cache/kvshim}

deps_go() {
  echo "== Debian packages (build/deps.sh: gcc, libc6-dev, redis-server, redis-tools, libibverbs1, libnuma1, libcurl4; no service is enabled)"
  build/deps.sh
  echo "== Go modules (go mod download, into $(go env GOMODCACHE))"
  go mod download
}

test_venv() {
  echo "== virtualenv under $cache from python/requirements-test.txt (vLLM 0.33.0 + PyTorch: ~4.6 GB and 7-8 minutes the first time, reused after)" >&2
  build/venv.sh python/requirements-test.txt
}

part_check() {
  deps_go
  echo "== gofmt"
  bad=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
  if [ -n "$bad" ]; then echo "gofmt needed: $bad"; exit 1; fi
  echo "== go vet"
  go vet ./...
  echo "== go.mod tidy (direct requirements not marked indirect, nothing unused)"
  go mod tidy -diff
  if [ -x build/lint-py.sh ]; then
    echo "== Python lint and types (build/lint-py.sh)"
    build/lint-py.sh
  fi
}

part_go() {
  deps_go
  echo "== build (with the kvshim.h check)"
  make lib
  echo "== C ABI test"
  make ctest
  echo "== go test -race (with fuzz seed corpora; the S3 tests run below)"
  go test -race -count=1 -timeout 20m -skip 'S3' ./...
  # The Mooncake Store tests need the wheel's store client and a real
  # mooncake_master; they run on their own, one package at a time, so two
  # masters and their clients never compete for the two cores.
  echo "== go test -race: Mooncake Store (real mooncake_master on loopback; venv from python/requirements-mooncake.txt)"
  mc=$(build/venv.sh python/requirements-mooncake.txt)
  KVSHIM_MOONCAKE_PYTHON="$mc/bin/python" go test -race -count=1 -p 1 -timeout 10m \
    ./server/l2/mooncake ./server/tier -run 'Mooncake|RoundTrip|HelperDeath|Config'
  KVSHIM_MOONCAKE_PYTHON="$mc/bin/python" go test -race -count=1 -p 1 -timeout 10m ./shim -run 'TwoHosts'
  # The S3 adapter's tests need a real S3 server: SeaweedFS's weed, built
  # once into the cache (build/seaweedfs.sh: ~16 minutes on 2 cores the
  # first time, reused after). On their own, one package at a time, like
  # Mooncake's: a weed server uses most of a core while it starts.
  echo "== go test -race: S3 (a real SeaweedFS S3 gateway on loopback; weed from build/seaweedfs.sh)"
  weed=$(build/seaweedfs.sh)
  KVSHIM_WEED="$weed" go test -race -count=1 -p 1 -timeout 15m -run 'S3' ./server/l2/s3 ./cmd/kvshim
  echo "== GPU check script, dry run against the emulated CUDA driver"
  make gpu-check-dry
}

pytest_env() {
  make lib
  export KVSHIM_LIBRARY="$PWD/out/libkvshim.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
}

part_py() {
  deps_go
  pytest_env
  echo "== pytest: trace files read by real pyarrow and pandas (venv from python/requirements-trace.txt)"
  tv=$(build/venv.sh python/requirements-trace.txt)
  "$tv/bin/python" -m pytest -q -rs tests/test_trace_pyarrow.py
  venv=$(test_venv)
  echo "== pytest tests/ (outside tests/vllm)"
  # No automatic rerun: a flaky test is a bug to find, not to retry.
  "$venv/bin/python" -m pytest -q -rs -rf tests --ignore=tests/vllm --ignore=tests/e2e --ignore=tests/test_trace_pyarrow.py
}

part_vllm() {
  deps_go
  pytest_env
  venv=$(test_venv)
  echo "== pytest tests/vllm"
  "$venv/bin/python" -m pytest -q -rs -rf tests/vllm
}

part_e2e() {
  deps_go
  pytest_env
  make out/kvshim
  echo "== virtualenv under $cache from python/requirements-e2e.txt (the CPU build of vLLM 0.32.0 + PyPI's torch 2.13.0: ~6.3 GB and ~13 minutes the first time, reused after)" >&2
  ev=$(build/venv.sh python/requirements-e2e.txt)
  echo "== pytest tests/e2e (real vllm serve processes of a tiny model made here)"
  "$ev/bin/python" -m pytest -q -rs -rf tests/e2e
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(check go py vllm e2e)
for p in "${parts[@]}"; do
  case $p in
    check | go | py | vllm | e2e) "part_$p" ;;
    *) echo "build/test.sh: unknown part \"$p\" (parts: check go py vllm e2e)" >&2; exit 2 ;;
  esac
done
