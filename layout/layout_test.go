package layout

import (
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

func TestNewRefuses(t *testing.T) {
	mod := func(d TensorDesc, f func(*TensorDesc)) TensorDesc {
		d.Shape = append([]int64(nil), d.Shape...)
		d.Strides = append([]int64(nil), d.Strides...)
		f(&d)
		return d
	}
	base := faNHD("model.layers.0.self_attn.attn", 0x10000)
	tests := []struct {
		name  string
		descs []TensorDesc
		chunk int
		want  string // field named in the error
	}{
		{"no tensors", nil, 4, "tensors"},
		{"unknown backend", []TensorDesc{mod(base, func(d *TensorDesc) { d.Backend = "flash_attn_v9" })}, 4, "backend"},
		{"dtype size", []TensorDesc{mod(base, func(d *TensorDesc) { d.DTypeSize = 3 })}, 4, "dtype_size"},
		{"null pointer", []TensorDesc{mod(base, func(d *TensorDesc) { d.DataPtr = 0 })}, 4, "data_ptr"},
		{"device", []TensorDesc{mod(base, func(d *TensorDesc) { d.Device = Device{} })}, 4, "device"},
		{"rank", []TensorDesc{mod(base, func(d *TensorDesc) { d.Shape = d.Shape[:4]; d.Strides = d.Strides[:4] })}, 4, "shape"},
		{"strides rank", []TensorDesc{mod(base, func(d *TensorDesc) { d.Strides = d.Strides[:4] })}, 4, "strides"},
		{"zero dim", []TensorDesc{mod(base, func(d *TensorDesc) { d.Shape = []int64{2, 4, 0, 2, 4} })}, 4, "shape[block_size]"},
		{"negative dim", []TensorDesc{mod(base, func(d *TensorDesc) { d.Shape = []int64{2, -4, 2, 2, 4} })}, 4, "shape[blocks]"},
		{"kv not 2", []TensorDesc{mod(base, func(d *TensorDesc) { d.Shape = []int64{3, 4, 2, 2, 4} })}, 4, "shape[kv]"},
		{"zero stride", []TensorDesc{mod(base, func(d *TensorDesc) { d.Strides = []int64{256, 0, 16, 8, 2} })}, 4, "strides[blocks]"},
		{"odd stride", []TensorDesc{mod(base, func(d *TensorDesc) { d.Strides = []int64{256, 33, 16, 8, 2} })}, 4, "strides[blocks]"},
		{"overlapping strides", []TensorDesc{mod(base, func(d *TensorDesc) { d.Strides = []int64{256, 16, 16, 8, 2} })}, 4, "overlaps"},
		{"overlapping heads", []TensorDesc{mod(base, func(d *TensorDesc) { d.Strides = []int64{256, 32, 16, 4, 2} })}, 4, "strides[heads]"},
		{"head not contiguous", []TensorDesc{mod(base, func(d *TensorDesc) { d.Strides = []int64{512, 64, 32, 2, 4} })}, 4, "strides[head]"},
		{"outside storage", []TensorDesc{mod(base, func(d *TensorDesc) { d.StoragePtr = 0x10000; d.StorageBytes = 255 })}, 4, "extent"},
		{"before storage", []TensorDesc{mod(base, func(d *TensorDesc) { d.StoragePtr = 0x10001; d.StorageBytes = 4096 })}, 4, "extent"},
		{"address overflow", []TensorDesc{mod(base, func(d *TensorDesc) { d.DataPtr = ^uint64(0) - 100 })}, 4, "extent"},
		{"size overflow", []TensorDesc{mod(base, func(d *TensorDesc) { d.Shape[1] = 1 << 62 })}, 4, "overflows"},
		{"unknown dim", []TensorDesc{mod(base, func(d *TensorDesc) { d.Dims = []Dim{"kv", "blocks", "tokens", "heads", "head"} })}, 4, "dims"},
		{"duplicate dim", []TensorDesc{mod(base, func(d *TensorDesc) { d.Dims = []Dim{"kv", "blocks", "blocks", "heads", "head"} })}, 4, "dims"},
		{"missing dim", []TensorDesc{mod(base, func(d *TensorDesc) { d.Dims = []Dim{"kv", "blocks", "layers", "heads", "head"} })}, 4, "dims"},
		{"mixed block counts", []TensorDesc{faNHD("a", 0x10000), mod(faNHD("b", 0x20000), func(d *TensorDesc) {
			d.Shape = []int64{2, 3, 2, 2, 4}
		})}, 4, "shape[blocks]"},
		{"mixed groups", []TensorDesc{faNHD("a", 0x10000), mod(faNHD("b", 0x20000), func(d *TensorDesc) { d.Group = 1 })}, 4, "group"},
		{"mixed devices", []TensorDesc{faNHD("a", 0x10000), mod(faNHD("b", 0x20000), func(d *TensorDesc) { d.Device.Index = 1 })}, 4, "device"},
		{"mixed backends", []TensorDesc{faNHD("a", 0x10000), fiNHD("b", 0x20000)}, 4, "backend"},
		{"duplicate layer", []TensorDesc{faNHD("a", 0x10000), faNHD("a", 0x20000)}, 4, "layer"},
		{"overlapping layers", []TensorDesc{faNHD("a", 0x10000), faNHD("b", 0x10000+128)}, 4, "overlaps layer"},
		{"interleaved runs collide", []TensorDesc{interleaved("a", 0x10000, 0), interleaved("b", 0x10000+32, 0)}, 4, "overlap"},
		{"two cross-layer tensors", []TensorDesc{crossNHD(0x10000), mod(crossNHD(0x90000), func(d *TensorDesc) { d.Layer = "x" })}, 4, "cross_layer"},
		{"paged content not contiguous", []TensorDesc{mod(pagedLBNHC("p", 0x10000), func(d *TensorDesc) { d.Strides = []int64{64, 16, 32, 4} })}, 4, "overlaps"},
		{"paged rank 5", []TensorDesc{mod(pagedLBNHC("p", 0x10000), func(d *TensorDesc) {
			d.Shape, d.Strides = append(d.Shape, 1), append(d.Strides, 2)
		})}, 4, "shape"},
		{"partial chunk size", []TensorDesc{base}, 3, "chunk_tokens"},
		{"zero chunk", []TensorDesc{base}, 0, "chunk_tokens"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.descs, tc.chunk)
			assert.ErrorIs(t, err, ErrGeometry)
			assert.Check(t, is.ErrorContains(err, tc.want))
			if len(tc.descs) == 1 {
				assert.Check(t, is.ErrorContains(err, tc.descs[0].Layer))
			}
		})
	}
}

func TestNewAccepts(t *testing.T) {
	// Size-1 dims may carry any stride (torch does that); storage bounds
	// that fit exactly pass.
	d := faNHD("l0", 0x10000)
	d.StoragePtr, d.StorageBytes = 0x10000, 256
	l, err := New([]TensorDesc{d}, 4)
	assert.NilError(t, err)
	assert.Equal(t, l.NumBlocks(), int64(tNB))
	assert.Equal(t, l.BlockSize(), tBS)
	assert.Equal(t, l.ChunkBlocks(), 2)
	assert.Equal(t, l.Device(), cuda0())
	assert.Equal(t, l.Backend(), FlashAttn)
	assert.Assert(t, is.Contains(l.String(), "flash_attn"))

	one := TensorDesc{Layer: "l", Backend: MLA, Device: Device{Kind: CPU}, DataPtr: 64, DTypeSize: 1,
		Shape: []int64{1, 1, 8}, Strides: []int64{0, 12345, 1}}
	l, err = New([]TensorDesc{one}, 1)
	assert.NilError(t, err)
	s, err := l.Plan([]int64{0}, obj, kv.Save)
	assert.NilError(t, err)
	assert.DeepEqual(t, s, []kv.Span{{Src: 64, Dst: pay, Len: 8}})
}

func TestNewGroups(t *testing.T) {
	// Two groups alias the same memory (vLLM's hybrid allocator): allowed.
	a := faNHD("full.0", 0x10000)
	b := faNHD("swa.0", 0x10000)
	b.Group = 1
	ls, err := NewGroups([]TensorDesc{b, a}, 4)
	assert.NilError(t, err)
	assert.Equal(t, len(ls), 2)
	assert.Equal(t, ls[0].Group(), 0)
	assert.Equal(t, ls[1].Group(), 1)
	assert.Assert(t, ls[0].Fingerprint() != ls[1].Fingerprint())

	_, err = NewGroups([]TensorDesc{a, faNHD("full.1", 0x10000+64)}, 4)
	assert.ErrorIs(t, err, ErrGeometry)
}
