package shim

import (
	"testing"

	"github.com/kvshim/kvshim/kv"
)

// go test ./shim -run '^$' -bench . -benchmem
// (cmd/kvshim-bench-keys prints the same as JSON.)

// BenchmarkChunkHashes128K: a 128K-token prompt, 512 chunks of 256 tokens,
// into a reused slice (the connector's steady state).
func BenchmarkChunkHashes128K(b *testing.B) {
	benchChain(b, Extras{})
}

// BenchmarkChunkHashes128KExtras: the same with a salt, a LoRA and 16 images
// spread over the prompt.
func BenchmarkChunkHashes128KExtras(b *testing.B) {
	ex := Extras{CacheSalt: "tenant-a", LoRA: &LoRA{Name: "adapter", Path: "/adapters/adapter"}}
	for i := range 16 {
		ex.MM = append(ex.MM, MMInput{Hash: []byte("0123456789abcdef0123456789abcdef"), Offset: 1000 + i*8000, Length: 576})
	}
	benchChain(b, ex)
}

func benchChain(b *testing.B, ex Extras) {
	tokens := testTokens(128<<10, 0)
	dst := make([]kv.Hash, 0, 512)
	b.SetBytes(int64(4 * len(tokens)))
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if dst, err = AppendChunkHashes(dst[:0], testNS, tokens, 256, ex); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/prompt")
}

// BenchmarkExtendOneChunk: a decoding request crossing one chunk boundary.
func BenchmarkExtendOneChunk(b *testing.B) {
	tokens := testTokens(128<<10, 0)
	full, err := ChunkHashes(testNS, tokens, 256, Extras{})
	if err != nil {
		b.Fatal(err)
	}
	grown := full[:511] // a request one chunk short; the extension overwrites full[511]
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ExtendChunkHashes(testNS, grown, tokens, 256, Extras{}); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkNamespace(b *testing.B) {
	s := baseSpec()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Namespace(); err != nil {
			b.Fatal(err)
		}
	}
}
