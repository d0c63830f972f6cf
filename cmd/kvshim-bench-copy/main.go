// Command kvshim-bench-copy measures KV-cache copy plans: the host engine's
// save (KV -> objects) and restore (objects -> KV) bandwidth for a
// Llama-3-8B-shaped cache against one large memmove of the same bytes in the
// same run, the planner's cost per chunk and the CPU cost per submitted
// span. With -gpu it also measures D2H/H2D through the CUDA engine against
// one large pinned copy. The last line of output is JSON.
//
//	go run ./cmd/kvshim-bench-copy [-cache-gib 2] [-repeats 5] [-gpu]
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime"
	"sort"
	"time"
)

type config struct {
	cacheGiB    float64
	layers      int64
	heads       int64
	head        int64
	dtype       int64
	block       int64
	chunk       int
	workers     int
	repeats     int
	ids         string
	gpu         bool
	device      int
	gpuCacheGiB float64
	quiet       bool
}

func main() {
	var c config
	flag.Float64Var(&c.cacheGiB, "cache-gib", 2, "host KV cache size in GiB (objects take as much again)")
	flag.Int64Var(&c.layers, "layers", 32, "layers")
	flag.Int64Var(&c.heads, "heads", 8, "KV heads")
	flag.Int64Var(&c.head, "head", 128, "head size")
	flag.Int64Var(&c.dtype, "dtype-size", 2, "bytes per element (bf16 = 2)")
	flag.Int64Var(&c.block, "block", 16, "tokens per block")
	flag.IntVar(&c.chunk, "chunk", 256, "tokens per chunk")
	flag.IntVar(&c.workers, "workers", runtime.GOMAXPROCS(0), "host engine workers")
	flag.IntVar(&c.repeats, "repeats", 5, "repeats (medians are reported)")
	flag.StringVar(&c.ids, "ids", "scattered", "block ids per chunk: scattered (shuffled) or consecutive")
	flag.BoolVar(&c.gpu, "gpu", false, "also measure the CUDA engine")
	flag.IntVar(&c.device, "device", 0, "CUDA device ordinal for -gpu")
	flag.Float64Var(&c.gpuCacheGiB, "gpu-cache-gib", 4, "device KV cache size in GiB for -gpu")
	flag.BoolVar(&c.quiet, "q", false, "only the JSON line")
	flag.Parse()
	if c.ids != "scattered" && c.ids != "consecutive" {
		fmt.Fprintln(os.Stderr, "-ids must be scattered or consecutive")
		os.Exit(2)
	}
	res := map[string]any{"model": "llama-3-8b", "layers": c.layers, "kv_heads": c.heads, "head": c.head,
		"dtype_size": c.dtype, "block": c.block, "chunk_tokens": c.chunk, "ids": c.ids,
		"repeats": c.repeats, "workers": c.workers, "gomaxprocs": runtime.GOMAXPROCS(0)}
	if err := hostBench(&c, res); err != nil {
		fail(res, err)
	}
	if c.gpu {
		if err := gpuBench(&c, res); err != nil {
			fail(res, err)
		}
	}
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
}

func fail(res map[string]any, err error) {
	res["error"] = err.Error()
	out, _ := json.Marshal(res)
	fmt.Fprintln(os.Stderr, "kvshim-bench-copy:", err)
	fmt.Println(string(out))
	os.Exit(1)
}

func (c *config) logf(format string, args ...any) {
	if !c.quiet {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
	}
}

// median of the samples.
func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func gbps(bytes uint64, d time.Duration) float64 { return float64(bytes) / d.Seconds() / 1e9 }

func round(v float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	return float64(int64(v*p+0.5)) / p
}
