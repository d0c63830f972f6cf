package cuda

import (
	"bytes"
	"math/rand"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"gotest.tools/v3/assert"
)

// kvGeom is a small KV cache in any supported layout over raw memory.
type kvGeom struct {
	name  string
	descs func(base uint64) []layout.TensorDesc
	bytes int // memory the tensors span from base
}

const (
	gNB, gBS, gH, gD, gL = 16, 4, 2, 8, 3
	gRun                 = gBS * gH * gD * 2 // bf16 bytes of one (block, layer, K|V)
)

func geoms(dev layout.Device) []kvGeom {
	per := func(be layout.Backend, shape, strides []int64, layerBytes int) func(uint64) []layout.TensorDesc {
		return func(base uint64) []layout.TensorDesc {
			var out []layout.TensorDesc
			for l := 0; l < gL; l++ {
				out = append(out, layout.TensorDesc{Layer: "layers." + itoa(l), Backend: be, Device: dev,
					DataPtr: base + uint64(l*layerBytes), DTypeSize: 2, Shape: shape, Strides: strides})
			}
			return out
		}
	}
	layerBytes := 2 * gNB * gRun
	return []kvGeom{
		{"flash_attn_nhd", per(layout.FlashAttn, []int64{2, gNB, gBS, gH, gD},
			[]int64{gNB * gRun, gRun, gH * gD * 2, gD * 2, 2}, layerBytes), gL * layerBytes},
		{"flash_attn_hnd", per(layout.FlashAttn, []int64{2, gNB, gBS, gH, gD},
			[]int64{gNB * gRun, gRun, gD * 2, gBS * gD * 2, 2}, layerBytes), gL * layerBytes},
		{"flashinfer_hnd", per(layout.FlashInfer, []int64{gNB, 2, gBS, gH, gD},
			[]int64{2 * gRun, gRun, gD * 2, gBS * gD * 2, 2}, layerBytes), gL * layerBytes},
		{"mla", per(layout.MLA, []int64{gNB, gBS, 64}, []int64{gBS * 128, 128, 2}, gNB*gBS*128), gL * gNB * gBS * 128},
		{"cross_layer", func(base uint64) []layout.TensorDesc {
			return []layout.TensorDesc{{Layer: "kv", Backend: layout.CrossLayer, Device: dev, DataPtr: base, DTypeSize: 2,
				Shape:   []int64{gNB, gL, 2, gBS, gH, gD},
				Strides: []int64{gL * 2 * gRun, 2 * gRun, gRun, gH * gD * 2, gD * 2, 2}}}
		}, gL * layerBytes},
	}
}

// TestHostPlansRoundTrip saves chunks of a CPU KV cache into objects with
// layout plans and the host engine, verifies the objects, restores them into
// a zeroed cache and compares every block.
func TestHostPlansRoundTrip(t *testing.T) {
	e := NewHostEngine(2, WithMinPiece(4096))
	defer e.Close()
	for _, g := range geoms(layout.Device{Kind: layout.CPU}) {
		t.Run(g.name, func(t *testing.T) {
			cache, kvA := mmapTB(t, g.bytes, rw())
			fill(cache, 3)
			orig := append([]byte(nil), cache...)
			l, err := layout.New(g.descs(kvA), 4*gBS)
			assert.NilError(t, err)
			size, err := l.ObjectSize(l.ChunkTokens())
			assert.NilError(t, err)
			objs, objA := mmapTB(t, int(size)*3, rw())
			ids := rand.New(rand.NewSource(1)).Perm(gNB)
			chunks := [][]int64{{0, 1, 2, 3}, toI64(ids[:4]), toI64(ids[4:8])}
			for c, blocks := range chunks {
				spans, err := l.Plan(blocks, objA+uint64(c)*size, kv.Save)
				assert.NilError(t, err)
				j, err := e.Submit(spans, kv.Save)
				assert.NilError(t, err)
				assert.NilError(t, j.Wait(10*time.Second))
				o := objs[uint64(c)*size : uint64(c+1)*size]
				assert.NilError(t, l.SealObject(o, kv.Key{}))
				assert.NilError(t, l.VerifyObject(o, kv.Key{}))
			}
			clear(cache)
			for c, blocks := range chunks {
				spans, err := l.Plan(blocks, objA+uint64(c)*size, kv.Load)
				assert.NilError(t, err)
				j, err := e.Submit(spans, kv.Load)
				assert.NilError(t, err)
				assert.NilError(t, j.Wait(10*time.Second))
			}
			// Every byte of a restored block matches; the others stay zero.
			restored := map[int64]bool{}
			for _, c := range chunks {
				for _, b := range c {
					restored[b] = true
				}
			}
			want := make([]byte, len(cache))
			for _, d := range g.descs(kvA) {
				markBlocks(want, orig, kvA, d, restored)
			}
			assert.Assert(t, bytes.Equal(cache, want))
		})
	}
}

func toI64(v []int) []int64 {
	out := make([]int64, len(v))
	for i, x := range v {
		out[i] = int64(x)
	}
	return out
}

// markBlocks copies orig's bytes of the listed blocks of tensor d into want,
// walking every element by index (independent of the planner).
func markBlocks(want, orig []byte, base uint64, d layout.TensorDesc, blocks map[int64]bool) {
	names := d.Dims
	if names == nil {
		names, _ = layout.DefaultDims(d.Backend, len(d.Shape))
	}
	idx := make([]int64, len(d.Shape))
	var walk func(k int)
	walk = func(k int) {
		if k == len(idx) {
			off := int64(d.DataPtr - base)
			for i := range idx {
				off += idx[i] * d.Strides[i]
			}
			copy(want[off:off+int64(d.DTypeSize)], orig[off:])
			return
		}
		for i := int64(0); i < d.Shape[k]; i++ {
			if names[k] == layout.DimBlocks && !blocks[i] {
				continue
			}
			idx[k] = i
			walk(k + 1)
		}
	}
	walk(0)
}
