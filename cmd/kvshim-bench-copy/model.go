package main

import (
	"encoding/binary"
	"math/rand"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
)

// blockRun is the bytes of one (block, layer, K|V) run.
func (c *config) blockRun() int64 { return c.block * c.heads * c.head * c.dtype }

// blockBytes is one block over all layers, K and V.
func (c *config) blockBytes() int64 { return 2 * c.layers * c.blockRun() }

// cacheKind is how the benchmark's KV cache is laid out and registered.
type cacheKind struct {
	name string // suffix of the JSON keys: "", "_paged", "_cross"
}

var cacheKinds = []cacheKind{
	// Per-layer FlashAttention NHD (2, blocks, 16, 8, 128): vLLM <= 0.32's
	// tensors, K and V of a block in separate runs (the "per-layer").
	{""},
	// vLLM 0.33's default (LBNHC): a (blocks, 8, 16, K|V 256) view per layer,
	// one run of K and V per block and layer.
	{"_paged"},
	// vLLM 0.33's BLNHC: the same views over a block-outermost buffer; they
	// tile each block, so layout copies a block's layers as one run.
	{"_cross"},
}

// descs describes a cache of nb blocks at base in the given kind; every
// kind covers exactly nb*blockBytes bytes from base.
func (c *config) descs(base uint64, nb int64, kind cacheKind, dev layout.Device) []layout.TensorDesc {
	run := c.blockRun()
	page := 2 * run // one block of one layer, K and V
	out := make([]layout.TensorDesc, c.layers)
	for l := range out {
		d := layout.TensorDesc{Layer: "model.layers." + itoa(l) + ".self_attn.attn", Device: dev, DTypeSize: int(c.dtype)}
		switch kind.name {
		case "":
			d.Backend, d.DataPtr = layout.FlashAttn, base+uint64(int64(l)*nb*page)
			d.Shape = []int64{2, nb, c.block, c.heads, c.head}
			d.Strides = []int64{nb * run, run, c.heads * c.head * c.dtype, c.head * c.dtype, c.dtype}
		default: // (blocks, heads, block_size, K|V), content innermost, tokens outside heads
			blockStride, layerOff := page, int64(l)*nb*page // LBNHC
			if kind.name == "_cross" {
				blockStride, layerOff = c.layers*page, int64(l)*page // BLNHC
			}
			d.Backend, d.DataPtr = layout.Paged, base+uint64(layerOff)
			d.Shape = []int64{nb, c.heads, c.block, 2 * c.head}
			d.Strides = []int64{blockStride, 2 * c.head * c.dtype, c.heads * 2 * c.head * c.dtype, c.dtype}
		}
		out[l] = d
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

// benchKey is the object key of chunk i in the benchmark (objects name
// their key; any fixed namespace will do here).
func benchKey(i int) kv.Key {
	k := kv.Key{Namespace: [16]byte{'b', 'e', 'n', 'c', 'h'}}
	binary.LittleEndian.PutUint64(k.Hash[:], uint64(i))
	return k
}
