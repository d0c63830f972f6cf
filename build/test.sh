#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
build/deps.sh
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

echo "== pytest"
venv=$(build/venv.sh python/requirements-test.txt)
export KVSHIM_LIBRARY="$PWD/out/libkvshim.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$venv/bin/python" -m pytest -q -rs tests
