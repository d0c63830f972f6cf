#!/usr/bin/env bash
# gpu-check.sh: kvshim's device check, one timeout-guarded script (< 5 min).
#
#   build/gpu-check.sh --prepare   # on a machine with Go: build the binaries
#                                  # into build/gpu-bin/ and stop
#   build/gpu-check.sh             # on the GPU machine: (build if Go is
#                                  # there,) run the CUDA tests, the copy
#                                  # benchmark and the end-to-end CUDA demo
#                                  # (LBNHC, BLNHC); JSON summary on the
#                                  # last line
#
# The GPU machine needs no Go and no network: build/gpu-bin/ (cuda.test,
# layout.test, kvshim-bench-copy: cgo binaries that dlopen libcuda.so.1 at
# run time; libkvshim.so for the demo) travels with the tree. PyTorch is
# optional: with CUDA in it, real CUDA tensors shaped like vLLM's KV caches
# are described by build/torch_geometry.py and checked by layout's
# TestTorchGeometry, and `kvshim demo --device cuda` runs the library end to
# end on torch CUDA tensors (python3 -m kvshim from python/, no vLLM, no
# numpy needed); without it, device memory comes from cuMemAlloc in the Go
# tests and benchmark and the summary says "demo_cuda": "skipped: ...".
# Every step's timeout comes out of one budget (KVSHIM_GPU_CHECK_BUDGET_S,
# default 280 s, inside the 290 s outer timeout), so the summary is always
# written; a step left without time says so. Results go to $OUT (or
# /tmp/kvshim-gpu-check): logs, bench.json, demo-cuda-*.json, summary.json.
# KVSHIM_GPU_CHECK_GIB sets the device cache of the benchmark (default 4).
# `make gpu-check-dry` runs this script here against internal/fakecuda
# (KVSHIM_LIBCUDA), so the script itself is tested before device time is
# spent on it; its figures mean nothing.
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
		CGO_ENABLED=1 go build -o "$BIN/kvshim-bench-copy" ./cmd/kvshim-bench-copy &&
		CGO_ENABLED=1 go build -buildmode=c-shared -trimpath -o "$BIN/libkvshim.so" \
			-ldflags "-s -w -X main.version=$(cat VERSION)+$(git rev-parse --short HEAD 2>/dev/null || echo nogit)" ./export || {
		log "build failed"
		exit 1
	}
fi
if [ "${1:-}" = "--prepare" ]; then
	ls -l "$BIN" >&2
	exit 0
fi
for b in cuda.test layout.test kvshim-bench-copy libkvshim.so; do
	[ -f "$BIN/$b" ] && { [ -x "$BIN/$b" ] || [ "$b" = libkvshim.so ]; } || {
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

# One budget for every step below: each timeout is what the step wants,
# cut to what is left after the reserve of the steps that follow.
BUDGET=${KVSHIM_GPU_CHECK_BUDGET_S:-280}
cap() { # cap WANT RESERVE -> seconds for this step, at least 1
	local t=$((BUDGET - SECONDS - $2))
	[ "$t" -gt "$1" ] && t=$1
	[ "$t" -lt 1 ] && t=1
	echo "$t"
}
secs=""
took() { secs="$secs${secs:+,}\"$1\":$2"; }

torch="missing"
# One probe (importing torch takes seconds): "VERSION 1" with CUDA, "VERSION 0" without.
probe=$(timeout 60 python3 -c 'import torch; print(torch.__version__, int(torch.cuda.is_available()))' 2>/dev/null)
case "$probe" in
"") torch_cuda="skipped: no torch" ;;
*" 1") torch_cuda=yes ;;
*) torch_cuda="skipped: no torch CUDA (torch ${probe% *})" ;;
esac
if [ "$torch_cuda" = yes ]; then
	if timeout 60 python3 build/torch_geometry.py --device cuda:0 "$RES/torch_geometry.json" >&2; then
		torch=${probe% *}
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
t0=$SECONDS
t=$(cap 150 130)
(cd cuda && timeout "$t" "../$BIN/cuda.test" -test.v -test.count=1 -test.timeout "$((t > 10 ? t - 10 : 1))s") >"$RES/cuda-tests.log" 2>&1
cuda_rc=$?
took cuda_tests $((SECONDS - t0))
cuda_status=$(status "$RES/cuda-tests.log" $cuda_rc)
grep -E '^(=== RUN|--- (PASS|FAIL|SKIP)|    .*_test.go)' "$RES/cuda-tests.log" | grep -v '=== RUN' >&2

log "layout tests (torch geometry: ${KVSHIM_TORCH_GEOMETRY:-emulated})"
t0=$SECONDS
t=$(cap 60 110)
(cd layout && timeout "$t" "../$BIN/layout.test" -test.v -test.count=1 -test.timeout "$((t > 10 ? t - 10 : 1))s") >"$RES/layout-tests.log" 2>&1
layout_rc=$?
took layout_tests $((SECONDS - t0))
grep -E '^--- (FAIL|SKIP)|source:' "$RES/layout-tests.log" >&2
layout_status=pass
[ $layout_rc -eq 0 ] || layout_status=fail

log "copy benchmark"
t0=$SECONDS
timeout "$(cap 150 100)" "$BIN/kvshim-bench-copy" -gpu -cache-gib 1 -gpu-cache-gib "${KVSHIM_GPU_CHECK_GIB:-4}" -repeats 5 \
	>"$RES/bench.out" 2>"$RES/bench.log"
bench_rc=$?
took bench $((SECONDS - t0))
cat "$RES/bench.log" >&2
bench=$(tail -n 1 "$RES/bench.out")
case "$bench" in "{"*) ;; *) bench='{}' ;; esac
echo "$bench" >"$RES/bench.json"

# The library end to end on torch CUDA tensors (kvshim demo --device cuda),
# once per vLLM 0.33 KVCacheLayout; each run's last line is its JSON.
demo_ok=true
if [ "$torch_cuda" = yes ]; then
	demo_cuda=""
	# LBNHC-layerwise: the same restores layer by layer (kvshim.layerwise):
	# its "layerwise" entry has the first layer's wait against the whole
	# restore, the TTFT a forward pass overlapping the copies can gain.
	for spec in LBNHC BLNHC LBNHC-layerwise; do
		lay=${spec%-layerwise}
		extra=""
		[ "$spec" = "$lay" ] || extra="--layerwise"
		case $spec in LBNHC) reserve=90 ;; BLNHC) reserve=45 ;; *) reserve=5 ;; esac
		t=$(cap 100 $reserve)
		if [ "$t" -lt 20 ]; then
			log "demo --device cuda --layout $lay $extra: skipped, ${t}s left"
			entry='"skipped: out of time"'
			[ "$spec" = "$lay" ] && demo_ok=false # the layer-wise run is a figure, not a check
		else
			log "demo --device cuda --layout $lay $extra (timeout ${t}s)"
			t0=$SECONDS
			# shellcheck disable=SC2086 # $extra is one flag or none
			PYTHONPATH="$PWD/python" KVSHIM_LIBRARY="$PWD/$BIN/libkvshim.so" timeout -k 5 "$t" \
				python3 -m kvshim demo --device cuda --layout "$lay" $extra >"$RES/demo-cuda-$spec.out" 2>"$RES/demo-cuda-$spec.log"
			rc=$?
			took "demo_cuda_$spec" $((SECONDS - t0))
			tr '\r' '\n' <"$RES/demo-cuda-$spec.log" | grep -v '^\[' | tail -n 3 >&2
			entry=$(tail -n 1 "$RES/demo-cuda-$spec.out")
			case "$entry" in "{"*) ;; *) entry='{}' ;; esac
			[ $rc -eq 0 ] && [ "$entry" != '{}' ] || demo_ok=false
			if [ $rc -ne 0 ]; then
				why=$(tr '\r' '\n' <"$RES/demo-cuda-$spec.log" | grep -v '^\[' | grep . | tail -n 1 |
					python3 -c 'import json, sys; print(json.dumps(sys.stdin.read().strip()[-300:]))' 2>/dev/null)
				entry=$(printf '{"rc":%d,"error":%s,"last":%s}' "$rc" "${why:-\"\"}" "$entry")
			fi
			echo "$entry" >"$RES/demo-cuda-$spec.json"
		fi
		demo_cuda="$demo_cuda${demo_cuda:+,}\"$spec\":$entry"
	done
	demo_cuda="{$demo_cuda}"
else
	log "demo --device cuda: $torch_cuda"
	demo_cuda="\"$torch_cuda\""
fi

ok=true
[ "$cuda_status" = pass ] && [ "$layout_status" = pass ] && [ $bench_rc -eq 0 ] && $demo_ok || ok=false
summary=$(printf '{"ok":%s,"cuda_tests":"%s","layout_tests":"%s","torch":"%s","bench_rc":%d,"seconds":{%s},"demo_cuda":%s,"bench":%s}' \
	"$ok" "$cuda_status" "$layout_status" "$torch" "$bench_rc" "$secs" "$demo_cuda" "$bench")
echo "$summary" >"$RES/summary.json"
echo "$summary"
$ok
