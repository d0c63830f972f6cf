package layout

import (
	"slices"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
)

// coalesce sorts spans by source and merges neighbours contiguous on both
// sides: two plans that copy the same bytes to the same places coalesce
// to the same list.
func coalesce(in []kv.Span) []kv.Span {
	s := slices.Clone(in)
	slices.SortFunc(s, func(a, b kv.Span) int { return int(int64(a.Src - b.Src)) })
	var out []kv.Span
	for _, x := range s {
		if n := len(out); n > 0 && out[n-1].Src+out[n-1].Len == x.Src && out[n-1].Dst+out[n-1].Len == x.Dst {
			out[n-1].Len += x.Len
			continue
		}
		out = append(out, x)
	}
	return out
}

// Every layout kvshim supports: the per-tensor plans of a layer-wise load
// together are the chunk's plan (bytes exact, both directions, with a
// skipped block), each tensor's spans lie in its own layer only, and a
// layer name finds its tensor. (FuzzPlan checks the same on generated
// geometries, byte by byte.)
func TestPlanTensorUnionIsPlan(t *testing.T) {
	for _, tc := range []struct {
		name  string
		descs []TensorDesc
	}{
		{"flash_attn NHD", []TensorDesc{faNHD("l0", 0x100000), faNHD("l1", 0x900000)}},
		{"flash_attn HND", []TensorDesc{faHND("l0", 0x100000), faHND("l1", 0x900000)}},
		{"flashinfer NHD", []TensorDesc{fiNHD("l0", 0x100000), fiNHD("l1", 0x900000)}},
		{"flashinfer HND", []TensorDesc{fiHND("l0", 0x100000), fiHND("l1", 0x900000)}},
		{"mla", []TensorDesc{mla("l0", 0x100000), mla("l1", 0x900000)}},
		{"paged LBNHC", []TensorDesc{pagedLBNHC("l0", 0x100000), pagedLBNHC("l1", 0x900000)}},
		{"paged LBHNC", []TensorDesc{pagedLBHNC("l0", 0x100000), pagedLBHNC("l1", 0x900000)}},
		{"paged BLNHC views", []TensorDesc{pagedBLNHC("l0", 0x100000, 0, 2), pagedBLNHC("l1", 0x100000, 1, 2)}},
		{"cross-layer NHD", []TensorDesc{crossNHD(0x100000)}},
		{"cross-layer HND", []TensorDesc{crossHND(0x100000)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := mustNew(t, 2*tBS, tc.descs...)
			cb := l.ChunkBlocks()
			ids := make([]int64, cb)
			for i := range ids {
				ids[i] = int64(2*i + 1)
			}
			for _, dir := range []kv.Direction{kv.Save, kv.Load} {
				whole, err := l.Plan(ids, 1<<40, dir)
				assert.NilError(t, err)
				var parts []kv.Span
				for ti := range l.NumTensors() {
					before := len(parts)
					parts, err = l.AppendPlanTensor(parts, ids, 1<<40, dir, ti)
					assert.NilError(t, err)
					tt := l.tensors[ti]
					for _, sp := range parts[before:] {
						a := sp.Src
						if dir == kv.Load {
							a = sp.Dst
						}
						assert.Assert(t, a >= tt.base && a+sp.Len <= tt.base+tt.extent, "tensor %d span %+v", ti, sp)
					}
				}
				assert.DeepEqual(t, coalesce(parts), coalesce(whole))
			}
			if dir := kv.Load; cb > 1 { // a skipped block (vLLM has it) stays skipped
				skip := slices.Clone(ids)
				skip[0] = Skip
				whole, err := l.Plan(skip, 1<<40, dir)
				assert.NilError(t, err)
				var parts []kv.Span
				for ti := range l.NumTensors() {
					parts, err = l.AppendPlanTensor(parts, skip, 1<<40, dir, ti)
					assert.NilError(t, err)
				}
				assert.DeepEqual(t, coalesce(parts), coalesce(whole))
			}
			if l.NumTensors() == len(tc.descs) {
				assert.Equal(t, l.TensorIndex(tc.descs[len(tc.descs)-1].Layer), len(tc.descs)-1)
			} else { // views merged into one tensor (BLNHC): one layer-wise part, all layers
				assert.Equal(t, l.NumTensors(), 1)
			}
			assert.Equal(t, l.TensorIndex("no such layer"), -1)
			_, err := l.AppendPlanTensor(nil, ids, 1<<40, kv.Load, l.NumTensors())
			assert.ErrorIs(t, err, ErrGeometry)
		})
	}
}
