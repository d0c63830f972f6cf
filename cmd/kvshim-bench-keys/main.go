// Command kvshim-bench-keys measures chunk-key hashing (package shim) and
// prints one JSON object as its last line.
//
//	go run ./shim/cmd/kvshim-bench-keys [-runs 200]
//
// Two views of each case: wall_us is the mean of testing.Benchmark (what a
// caller waits on an idle machine); cpu_us_min is the minimum thread CPU time
// over -runs runs, which stays meaningful on a loaded, shared machine.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/shim"
)

type result struct {
	Name      string  `json:"name"`
	Chunks    int     `json:"chunks"`
	WallUS    float64 `json:"wall_us"`
	CPUUSMin  float64 `json:"cpu_us_min"`
	NSPerChk  float64 `json:"cpu_ns_per_chunk"`
	AllocsOp  int64   `json:"allocs_per_op"`
	GBPerSecC float64 `json:"cpu_gb_per_s"`
}

func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		panic(err)
	}
	return time.Duration(ts.Nano())
}

// minCPU is the minimum over runs of the thread CPU time of batch calls of f,
// per call (batching keeps the clock's own syscall cost out of small cases).
func minCPU(runs, batch int, f func()) time.Duration {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	best := time.Duration(1 << 62)
	for range runs {
		t := threadCPU()
		for range batch {
			f()
		}
		best = min(best, threadCPU()-t)
	}
	return best / time.Duration(batch)
}

func main() {
	runs := flag.Int("runs", 200, "runs for the minimum thread CPU time")
	flag.Parse()

	const chunkSize, numTokens = 256, 128 << 10
	tokens := make([]uint32, numTokens)
	for i := range tokens {
		tokens[i] = uint32(i)*2654435761 + 1
	}
	ns, err := shim.NamespaceSpec{Model: "bench", DType: "bfloat16", LayoutFingerprint: "bench",
		ObjectFormat: 1, WorldSize: 1, ChunkSize: chunkSize}.Namespace()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	withExtras := shim.Extras{CacheSalt: "tenant-a", LoRA: &shim.LoRA{Name: "adapter", Path: "/adapters/adapter"}}
	for i := range 16 {
		withExtras.MM = append(withExtras.MM, shim.MMInput{Hash: []byte("0123456789abcdef0123456789abcdef"), Offset: 1000 + i*8000, Length: 576})
	}
	full, _ := shim.ChunkHashes(ns, tokens, chunkSize, shim.Extras{})
	dst := make([]kv.Hash, 0, numTokens/chunkSize)
	grown := append(make([]kv.Hash, 0, len(full)), full[:len(full)-1]...) // a request one chunk short

	cases := []struct {
		name   string
		chunks int
		batch  int
		f      func()
	}{
		{"chunk_hashes_128k_tokens", 512, 1, func() { dst, _ = shim.AppendChunkHashes(dst[:0], ns, tokens, chunkSize, shim.Extras{}) }},
		{"chunk_hashes_128k_tokens_salt_lora_16mm", 512, 1, func() { dst, _ = shim.AppendChunkHashes(dst[:0], ns, tokens, chunkSize, withExtras) }},
		{"extend_one_chunk", 1, 200, func() { _, _ = shim.ExtendChunkHashes(ns, grown[:511], tokens, chunkSize, shim.Extras{}) }},
	}
	var out []result
	for _, c := range cases {
		br := testing.Benchmark(func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				c.f()
			}
		})
		cpu := minCPU(*runs, c.batch, c.f)
		r := result{
			Name: c.name, Chunks: c.chunks,
			WallUS:   float64(br.NsPerOp()) / 1e3,
			CPUUSMin: float64(cpu.Nanoseconds()) / 1e3,
			NSPerChk: float64(cpu.Nanoseconds()) / float64(c.chunks),
			AllocsOp: br.AllocsPerOp(),
		}
		r.GBPerSecC = float64(4*chunkSize*c.chunks) / float64(cpu.Nanoseconds())
		fmt.Printf("%-42s wall %8.1f µs  cpu(min) %8.1f µs  %6.0f ns/chunk  %d allocs\n",
			r.Name, r.WallUS, r.CPUUSMin, r.NSPerChk, r.AllocsOp)
		out = append(out, r)
	}
	line, _ := json.Marshal(map[string]any{"bench": "shim_keys", "go": runtime.Version(), "results": out})
	fmt.Println(string(line))
}
