# kvshim build. `make` builds out/libkvshim.so; `make demo` and `make test`
# are the README's two set-up commands.
GO      ?= go
PYTHON  ?= python3
OUT     := out
LIB     := $(OUT)/libkvshim.so
VERSION := $(shell cat VERSION)+$(shell git rev-parse --short HEAD 2>/dev/null || echo nogit)
SOURCES := $(shell find . -path ./$(OUT) -prune -o \( -name '*.go' -o -name '*.c' -o -name '*.h' \) -print) go.mod go.sum
# The stamp holds VERSION+commit and is rewritten only when that changes, so
# a new commit rebuilds what carries the stamp (the .so and out/kvshim).
STAMP   := $(OUT)/version.stamp
$(shell mkdir -p $(OUT); [ "$$(cat $(STAMP) 2>/dev/null)" = "$(VERSION)" ] || echo "$(VERSION)" > $(STAMP))

.PHONY: all lib ctest test check test-go test-py test-vllm test-e2e chaos demo wheel bench-ipc bench-match bench-server bench-copy bench-l2 bench-keys gpu-check gpu-check-dry clean

all: lib

lib: $(LIB)

$(LIB): $(SOURCES) $(STAMP)
	@mkdir -p $(OUT)
	CGO_ENABLED=1 $(GO) build -buildmode=c-shared -trimpath \
		-ldflags "-X main.version=$(VERSION)" -o $(LIB) ./export
	$(PYTHON) build/check-header.py export/kvshim.h $(OUT)/libkvshim.h
	$(PYTHON) build/gen-abi.py export/kvshim.h python/kvshim/_abi.py

# The C ABI test: compiled against the handwritten header, linked to the .so.
# Run twice: with no CUDA driver (KVSHIM_ENOTSUP), then its device tests
# against the emulated driver with slow copies (KVSHIM_ETIMEDOUT).
ctest: $(LIB)
	$(CC) -std=c11 -Wall -Wextra -Werror -Iexport -o $(OUT)/abi_test tests/c/abi_test.c \
		-L$(OUT) -lkvshim -Wl,-rpath,'$$ORIGIN' -pthread -ldl
	$(CC) -std=c11 -O1 -shared -fPIC -pthread -o $(OUT)/libcuda-fake.so internal/fakecuda/testdata/fakecuda.c
	KVSHIM_LIBCUDA=/nonexistent/libcuda.so.1 $(OUT)/abi_test
	KVSHIM_LIBCUDA=$(CURDIR)/$(OUT)/libcuda-fake.so FAKECUDA_COPY_DELAY_US=100000 $(OUT)/abi_test

# Everything CI runs: installs what a fresh machine lacks, then the four
# parts below in order (e2e last). Each part runs alone as well (build/test.sh PART).
test:
	build/test.sh

# gofmt, go vet, go.mod tidy, the Python linters.
check:
	build/test.sh check

# go test -race (every package, Mooncake against a real master), the C ABI
# test, the GPU check's dry run.
test-go:
	build/test.sh go

# pytest outside tests/vllm (library, CLI, demo, wheel, traces).
test-py:
	build/test.sh py

# pytest tests/vllm: the connector through vLLM 0.33.0's real classes.
test-vllm:
	build/test.sh vllm

# pytest tests/e2e: real `vllm serve` (the CPU build of vLLM 0.32.0, its own
# cached venv) of a tiny model made here, with kvshim; docs/e2e.md.
test-e2e:
	build/test.sh e2e

# The fault tests at the issue's counts (make test runs a few rounds of
# each): a writer frozen past its heartbeat, the server SIGKILLed mid-copy.
chaos:
	KVSHIM_CHAOS_ROUNDS=$${KVSHIM_CHAOS_ROUNDS:-100} $(GO) test -count=1 -timeout 30m -run 'Chaos' -v ./shim

# The main job on the embedded default: store and restore a model-shaped KV
# cache and verify it byte for byte.
demo: $(LIB)
	build/demo.sh

# One wheel for CPython >= 3.10: py3-none-manylinux_2_NN_ARCH (setup.py runs
# `make lib` and reads NN from the .so's glibc symbol versions).
wheel:
	@mkdir -p $(OUT)/dist
	rm -f $(OUT)/dist/kvshim-*.whl
	$(PYTHON) -m pip wheel --no-deps -w $(OUT)/dist .
	@ls $(OUT)/dist/kvshim-*.whl

clean:
	rm -rf $(OUT) build/lib build/bdist* *.egg-info python/*.egg-info

# Benchmarks: not tests. Each prints one JSON object as its last line.
# Python-level round trip vs pyzmq (LMCache's transport), plus the Go-only ring figures.
bench-ipc: $(LIB)
	KVSHIM_LIBRARY=$(CURDIR)/$(LIB) PYTHONPATH=$(CURDIR)/python $$(build/venv.sh python/requirements-test.txt)/bin/python build/bench_ipc.py

# get_num_new_matched_tokens from a Python token list (16K and 128K tokens),
# through vLLM's real scheduler and the embedded server; the old token
# conversion alongside, interleaved in the same run.
bench-match: $(LIB)
	KVSHIM_LIBRARY=$(CURDIR)/$(LIB) PYTHONPATH=$(CURDIR)/python $$(build/venv.sh python/requirements-test.txt)/bin/python build/bench_match.py $(BENCH_MATCH_ARGS)

# An idle `kvshim serve` with 8 sessions: its CPU and context switches, then
# an echo after 5 ms idle. BENCH_IDLE_ARGS='-server OLD/kvshim,out/kvshim
# -rounds 3' alternates two builds in one run.
.PHONY: bench-idle
bench-idle: $(OUT)/kvshim
	go run ./cmd/kvshim-bench-idle -server $(OUT)/kvshim $(BENCH_IDLE_ARGS)

bench-server:
	$(GO) run ./cmd/kvshim-bench-server

bench-copy:
	$(GO) run ./cmd/kvshim-bench-copy -cache-gib 2 -repeats 5

bench-l2:
	$(GO) run ./cmd/kvshim-bench-l2

bench-keys:
	$(GO) run ./cmd/kvshim-bench-keys

# What KV events cost per saved chunk: saves with and without events, interleaved (one JSON line).
.PHONY: bench-events
bench-events:
	$(GO) test -run '^$$' -bench '^BenchmarkEventsSave$$' -benchtime 300x ./shim/ | grep '^{\|"bench"' | sed 's/^[^{]*//'

# L2 write traffic of a prefix_repetition-shaped run: write-through vs --l2-store-after-lookups 1, 2 (one JSON line).
.PHONY: bench-l2-admission
bench-l2-admission:
	KVSHIM_BENCH_L2_ADMISSION=1 $(GO) test -count=1 -run '^TestBenchStoreAfterLookups$$' -v ./server/tier/ | grep '^{'

# kvshim serve beside the real LMCache 0.5.6 MP server (python/requirements-bench-peer.txt): lookups and 32 MiB store/retrieve.
.PHONY: bench-peer
bench-peer: $(LIB)
	KVSHIM_LIBRARY=$(CURDIR)/$(LIB) PYTHONPATH=$(CURDIR)/python KVSHIM_PEER_KVSHIM_PYTHON=$$(build/venv.sh python/requirements-test.txt)/bin/python $$(build/venv.sh python/requirements-bench-peer.txt)/bin/python build/bench_peer.py

# Real `vllm serve` (the CPU build, tests/e2e's tiny model) under seven cache
# configurations: no cache, vLLM's prefix cache, kvshim, both, a too-small
# vLLM cache with and without kvshim, LMCache 0.5.6's MP server; `vllm bench
# serve` prefix_repetition and a multi-turn chat (build/bench_serve.py,
# docs/e2e.md). Runs in python/requirements-bench-serve.txt's layer over the
# e2e venv.
.PHONY: bench-serve
bench-serve: $(LIB) $(OUT)/kvshim
	KVSHIM_LIBRARY=$(CURDIR)/$(LIB) PYTHONPATH=$(CURDIR)/python $$(build/venv.sh python/requirements-bench-serve.txt)/bin/python build/bench_serve.py $(BENCH_SERVE_ARGS)

# Builds the GPU check's binaries here; build/gpu-check.sh runs them on a GPU machine.
gpu-check:
	build/gpu-check.sh --prepare

# The GPU check run here against the emulated driver (internal/fakecuda):
# proves the script and its benchmark work before a GPU is lent.
gpu-check-dry:
	@mkdir -p $(OUT)
	$(CC) -std=c11 -O1 -shared -fPIC -pthread -o $(OUT)/libcuda-fake.so internal/fakecuda/testdata/fakecuda.c
	KVSHIM_LIBCUDA=$(CURDIR)/$(OUT)/libcuda-fake.so KVSHIM_GPU_CHECK_GIB=0.25 OUT=$(CURDIR)/$(OUT)/gpu-check-dry \
		build/gpu-check.sh | tail -n 1 | grep -q '^{"ok":true' || { cat $(OUT)/gpu-check-dry/*.log; exit 1; }

# The standalone server for storage hosts without Python:
# a static binary, no cgo (the CUDA loader lives only in the .so).
BIN := $(OUT)/kvshim
all: $(BIN)
$(BIN): $(SOURCES) $(STAMP)
	@mkdir -p $(OUT)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/kvshim

# L2 plugins (docs/l2-plugins.md): the host that runs a plugin outside
# kvshim's process (kvshim serve stays static, a plugin's crash stays in its
# host), and the example plugin that passes the L2 contract suite.
L2HOST    := $(OUT)/kvshim-l2-host
L2EXAMPLE := $(OUT)/libkvshim-l2-example_files.so
L2INC     := server/l2/plugin/include
all: $(L2HOST) $(L2EXAMPLE)
.PHONY: l2-plugins
l2-plugins: $(L2HOST) $(L2EXAMPLE)
$(L2HOST): server/l2/plugin/host/kvshim_l2_host.c $(L2INC)/kvshim_l2.h
	@mkdir -p $(OUT)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I$(L2INC) -o $@ $< -ldl -pthread
$(L2EXAMPLE): examples/l2-plugin/kvshim_l2_files.c $(L2INC)/kvshim_l2.h
	@mkdir -p $(OUT)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -shared -fPIC -I$(L2INC) -o $@ $<
