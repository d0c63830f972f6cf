#!/usr/bin/env bash
# gpu-check.sh: kvshim's device check, one timeout-guarded script (< 5 min).
#
#   build/gpu-check.sh --prepare   # on a machine with Go: build the binaries
#                                  # into build/gpu-bin/ and stop
#   build/gpu-check.sh             # on the GPU machine: (build if Go is
#                                  # there,) run the CUDA tests and the copy
#                                  # benchmark; JSON summary on the last line
#
# The GPU machine needs no Go and no network: build/gpu-bin/ (cuda.test,
# layout.test, kvshim-bench-copy; cgo binaries that dlopen libcuda.so.1 at
# run time) travels with the tree. PyTorch is optional: with it, real CUDA
# tensors shaped like vLLM's KV caches are described by
# build/torch_geometry.py and checked by layout's TestTorchGeometry; without
# it, device memory comes from cuMemAlloc in the Go tests and benchmark.
# Results go to $OUT (or /tmp/kvshim-gpu-check): logs, bench.json,
# summary.json. KVSHIM_GPU_CHECK_GIB sets the device cache of the benchmark
# (default 4). `make gpu-check-dry` runs this script here against
# internal/fakecuda (KVSHIM_LIBCUDA), so the script itself is tested before
# device time is spent on it; its figures mean nothing.
set -u
if [ -z "${KVSHIM_GPU_CHECK_INNER:-}" ]; then
	KVSHIM_GPU_CHECK_INNER=1 exec timeout -k 10 290 "$0" "$@"
fi
cd "$(dirname "$0")/.."
BIN=build/gpu-bin
RES=${OUT:-/tmp/kvshim-gpu-check}
mkdir -p "$RES"
log() { echo "gpu-check: $*" >&2; }

if command -v go >/dev/null 2>&1; then
	log "building into $BIN"
	mkdir -p "$BIN"
	CGO_ENABLED=1 go test -c -o "$BIN/cuda.test" ./cuda &&
		CGO_ENABLED=1 go test -c -o "$BIN/layout.test" ./layout &&
		CGO_ENABLED=1 go build -o "$BIN/kvshim-bench-copy" ./cmd/kvshim-bench-copy || {
		log "build failed"
		exit 1
	}
fi
if [ "${1:-}" = "--prepare" ]; then
	ls -l "$BIN" >&2
	exit 0
fi
for b in cuda.test layout.test kvshim-bench-copy; do
	[ -x "$BIN/$b" ] || {
		log "missing $BIN/$b: run build/gpu-check.sh --prepare where Go is installed, and carry $BIN"
		exit 1
	}
done

nvidia-smi -L >&2 2>/dev/null || log "nvidia-smi not available"
if [ -z "${KVSHIM_LIBCUDA:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
	for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/compat; do
		if [ -e "$d/libcuda.so.1" ]; then
			export KVSHIM_LIBCUDA="$d/libcuda.so.1"
			break
		fi
	done
fi
log "libcuda: ${KVSHIM_LIBCUDA:-libcuda.so.1 (loader path)}"

torch="missing"
if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
	if timeout 60 python3 build/torch_geometry.py --device cuda:0 "$RES/torch_geometry.json" >&2; then
		torch=$(python3 -c 'import torch; print(torch.__version__)')
		KVSHIM_TORCH_GEOMETRY="$(cd "$RES" && pwd)/torch_geometry.json"
		export KVSHIM_TORCH_GEOMETRY
	else
		torch="error"
	fi
fi
log "torch: $torch"

status() { # status LOGFILE RC -> pass | fail | skipped
	if [ "$2" -ne 0 ]; then echo fail
	elif grep -q -- '--- SKIP: TestDevice' "$1"; then echo skipped
	else echo pass; fi
}

log "cuda tests"
(cd cuda && timeout 150 "../$BIN/cuda.test" -test.v -test.count=1 -test.timeout 140s) >"$RES/cuda-tests.log" 2>&1
cuda_rc=$?
cuda_status=$(status "$RES/cuda-tests.log" $cuda_rc)
grep -E '^(=== RUN|--- (PASS|FAIL|SKIP)|    .*_test.go)' "$RES/cuda-tests.log" | grep -v '=== RUN' >&2

log "layout tests (torch geometry: ${KVSHIM_TORCH_GEOMETRY:-emulated})"
(cd layout && timeout 60 "../$BIN/layout.test" -test.v -test.count=1 -test.timeout 50s) >"$RES/layout-tests.log" 2>&1
layout_rc=$?
grep -E '^--- (FAIL|SKIP)|source:' "$RES/layout-tests.log" >&2
layout_status=pass
[ $layout_rc -eq 0 ] || layout_status=fail

log "copy benchmark"
timeout 150 "$BIN/kvshim-bench-copy" -gpu -cache-gib 1 -gpu-cache-gib "${KVSHIM_GPU_CHECK_GIB:-4}" -repeats 5 \
	>"$RES/bench.out" 2>"$RES/bench.log"
bench_rc=$?
cat "$RES/bench.log" >&2
bench=$(tail -n 1 "$RES/bench.out")
case "$bench" in "{"*) ;; *) bench='{}' ;; esac
echo "$bench" >"$RES/bench.json"

ok=true
[ "$cuda_status" = pass ] && [ "$layout_status" = pass ] && [ $bench_rc -eq 0 ] || ok=false
summary=$(printf '{"ok":%s,"cuda_tests":"%s","layout_tests":"%s","torch":"%s","bench_rc":%d,"bench":%s}' \
	"$ok" "$cuda_status" "$layout_status" "$torch" "$bench_rc" "$bench")
echo "$summary" >"$RES/summary.json"
echo "$summary"
$ok
