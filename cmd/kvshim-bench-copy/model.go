package main

import (
	"math/rand"

	"github.com/kvshim/kvshim/layout"
)

// blockRun is the bytes of one (block, layer, K|V) run.
func (c *config) blockRun() int64 { return c.block * c.heads * c.head * c.dtype }

// blockBytes is one block over all layers, K and V.
func (c *config) blockBytes() int64 { return 2 * c.layers * c.blockRun() }

// descs describes a cache of nb blocks at base: per-layer FlashAttention NHD
// (layer l at base + l*2*nb*run) or one cross-layer tensor; both cover
// exactly nb*blockBytes bytes from base.
func (c *config) descs(base uint64, nb int64, cross bool, dev layout.Device) []layout.TensorDesc {
	run := c.blockRun()
	if cross {
		return []layout.TensorDesc{{Layer: "kv_cache", Backend: layout.CrossLayer, Device: dev, DataPtr: base,
			DTypeSize: int(c.dtype), Shape: []int64{nb, c.layers, 2, c.block, c.heads, c.head},
			Strides: []int64{2 * c.layers * run, 2 * run, run, c.heads * c.head * c.dtype, c.head * c.dtype, c.dtype}}}
	}
	out := make([]layout.TensorDesc, c.layers)
	for l := range out {
		out[l] = layout.TensorDesc{Layer: "model.layers." + itoa(l) + ".self_attn.attn", Backend: layout.FlashAttn,
			Device: dev, DataPtr: base + uint64(int64(l)*2*nb*run), DTypeSize: int(c.dtype),
			Shape:   []int64{2, nb, c.block, c.heads, c.head},
			Strides: []int64{nb * run, run, c.heads * c.head * c.dtype, c.head * c.dtype, c.dtype}}
	}
	return out
}

// chunks assigns every block to a chunk: consecutive runs, or shuffled.
func (c *config) chunks(nb int64) [][]int64 {
	per := int64(c.chunk) / c.block
	ids := make([]int64, nb)
	for i := range ids {
		ids[i] = int64(i)
	}
	if c.ids == "scattered" {
		r := rand.New(rand.NewSource(42))
		r.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	}
	var out [][]int64
	for i := int64(0); i+per <= nb; i += per {
		out = append(out, ids[i:i+per])
	}
	return out
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	s := ""
	for ; n > 0; n /= 10 {
		s = string(rune('0'+n%10)) + s
	}
	return s
}
