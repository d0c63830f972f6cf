package layout

import (
	"math/rand"
	"testing"

	"github.com/kvshim/kvshim/kv"
)

// llama8B describes Llama-3-8B on one GPU: 32 layers, 8 KV heads, head 128,
// bf16, 16-token blocks, FlashAttention NHD, numBlocks blocks per layer.
func llama8B(numBlocks int64, cross bool) []TensorDesc {
	const L, H, D, BS, dt = 32, 8, 128, 16, 2
	run := int64(BS * H * D * dt) // 32 KiB
	dev := Device{Kind: CUDA}
	if cross {
		return []TensorDesc{{Layer: "cross", Backend: CrossLayer, Device: dev, DataPtr: 1 << 32, DTypeSize: dt,
			Shape:   []int64{numBlocks, L, 2, BS, H, D},
			Strides: []int64{L * 2 * run, 2 * run, run, H * D * dt, D * dt, dt}}}
	}
	out := make([]TensorDesc, L)
	for l := range out {
		out[l] = TensorDesc{Layer: "model.layers." + string(rune('A'+l)) + ".attn", Backend: FlashAttn, Device: dev,
			DataPtr: 1<<32 + uint64(l)*uint64(2*numBlocks*run), DTypeSize: dt,
			Shape:   []int64{2, numBlocks, BS, H, D},
			Strides: []int64{numBlocks * run, run, H * D * dt, D * dt, dt}}
	}
	return out
}

func BenchmarkPlan(b *testing.B) {
	for _, bc := range []struct {
		name    string
		cross   bool
		shuffle bool
	}{{"per-layer/consecutive", false, false}, {"per-layer/scattered", false, true},
		{"cross-layer/consecutive", true, false}, {"cross-layer/scattered", true, true}} {
		b.Run(bc.name, func(b *testing.B) {
			l, err := New(llama8B(4096, bc.cross), 256)
			if err != nil {
				b.Fatal(err)
			}
			ids := make([]int64, 16)
			perm := rand.New(rand.NewSource(1)).Perm(4096)
			for i := range ids {
				ids[i] = int64(100 + i)
				if bc.shuffle {
					ids[i] = int64(perm[i])
				}
			}
			buf := make([]kv.Span, 0, 2048)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				var err error
				buf, err = l.AppendPlan(buf[:0], ids, 1<<40, kv.Save)
				if err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(buf)), "spans/chunk")
		})
	}
}
