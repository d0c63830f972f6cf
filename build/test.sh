#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${KVSHIM_CACHE:-$HOME/.cache/kvshim}
echo "== make test installs what this machine lacks, each step saying what before it installs:"
echo "   Debian packages (build/deps.sh: gcc, libc6-dev, redis-server, redis-tools, libibverbs1, libnuma1, libcurl4; no service is enabled),"
echo "   Go modules (go mod download, into $(go env GOMODCACHE)),"
echo "   virtualenvs under $cache from python/requirements-mooncake.txt, python/requirements-trace.txt and python/requirements-test.txt"
echo "   (the latter vLLM 0.33.0 + PyTorch: ~4.6 GB and 7-8 minutes the first time, reused after)."
build/deps.sh
echo "== Go modules (go mod download)"
go mod download

echo "== gofmt"
bad=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$bad" ]; then echo "gofmt needed: $bad"; exit 1; fi
echo "== go vet"
go vet ./...

echo "== build (with the kvshim.h check)"
make lib

echo "== C ABI test"
make ctest

echo "== go test -race (with fuzz seed corpora)"
go test -race -count=1 -timeout 20m ./...

# The Mooncake Store tests need the wheel's store client and a real
# mooncake_master; they run on their own, one package at a time, so two
# masters and their clients never compete for the two cores.
echo "== go test -race: Mooncake Store (real mooncake_master on loopback)"
mc=$(build/venv.sh python/requirements-mooncake.txt)
KVSHIM_MOONCAKE_PYTHON="$mc/bin/python" go test -race -count=1 -p 1 -timeout 10m \
  ./server/l2/mooncake ./server/tier -run 'Mooncake|RoundTrip|HelperDeath|Config'
KVSHIM_MOONCAKE_PYTHON="$mc/bin/python" go test -race -count=1 -p 1 -timeout 10m ./shim -run 'TwoHosts'

echo "== GPU check script, dry run against the emulated CUDA driver"
make gpu-check-dry

echo "== pytest: trace files read by real pyarrow and pandas (their own small venv)"
tv=$(build/venv.sh python/requirements-trace.txt)
"$tv/bin/python" -m pytest -q -rs tests/test_trace_pyarrow.py

echo "== pytest"
venv=$(build/venv.sh python/requirements-test.txt)
export KVSHIM_LIBRARY="$PWD/out/libkvshim.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
# No automatic rerun: a flaky test is a bug to find, not to retry.
"$venv/bin/python" -m pytest -q -rs -rf tests
