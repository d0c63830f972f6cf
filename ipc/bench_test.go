package ipc

import (
	"context"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
)

// In-process round trip of an ALLOC with 64 keys (both sides spinning).
// The full benchmark (two processes, latency quantiles, idle CPU) is
// cmd/kvshim-bench-ipc.
func BenchmarkCallAlloc64(b *testing.B) {
	ts := startServer(b, &ServerConfig{Ring: RingOptions{Spin: time.Second}})
	c, err := DialConfig(ts.path, Hello{Role: RoleTool}, time.Second, &ClientConfig{Ring: RingOptions{Spin: time.Second}, Logger: quietLog})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	req := &AllocReq{Hashes: make([]kv.Hash, 64), Sizes: make([]uint64, 64)}
	for i := range req.Sizes {
		req.Sizes[i] = 16
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.Alloc(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkCodecAlloc64(b *testing.B) {
	req := &AllocReq{Hashes: make([]kv.Hash, 64), Sizes: make([]uint64, 64)}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		buf, _ = AppendAllocReq(buf[:0], req)
		if _, err := DecodeAllocReq(buf); err != nil {
			b.Fatal(err)
		}
	}
}

// Same round trip with an empty body: the ring and wakeup cost alone.
func BenchmarkCallPing(b *testing.B) {
	ts := startServer(b, &ServerConfig{Ring: RingOptions{Spin: time.Second}})
	c, err := DialConfig(ts.path, Hello{Role: RoleTool}, time.Second, &ClientConfig{Ring: RingOptions{Spin: time.Second}, Logger: quietLog})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := c.Ping(ctx); err != nil {
			b.Fatal(err)
		}
	}
}
