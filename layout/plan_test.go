package layout

import (
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

const obj = 0x100000 // object base; payload at obj+64
const pay = obj + HeaderSize

func TestPlanHandComputed(t *testing.T) {
	const A, B = 0x10000, 0x20000
	// sp is a local copy of kv.Span, so the table can use short unkeyed
	// literals (vet refuses those for another package's struct).
	type sp struct{ Src, Dst, Len uint64 }
	tests := []struct {
		name   string
		descs  []TensorDesc
		chunk  int
		ids    []int64
		want   []sp // Save spans
		runs   int  // runs per block
		bbytes uint64
	}{
		{name: "fa-nhd consecutive", descs: []TensorDesc{faNHD("l0", A)}, chunk: 4, ids: []int64{2, 3},
			want: []sp{{A + 64, pay, 64}, {A + 128 + 64, pay + 64, 64}}, runs: 2, bbytes: 64},
		{name: "fa-nhd scattered", descs: []TensorDesc{faNHD("l0", A)}, chunk: 4, ids: []int64{3, 1},
			want: []sp{{A + 96, pay, 32}, {A + 32, pay + 32, 32}, {A + 128 + 96, pay + 64, 32}, {A + 128 + 32, pay + 96, 32}},
			runs: 2, bbytes: 64},
		{name: "fa-hnd consecutive", descs: []TensorDesc{faHND("l0", A)}, chunk: 4, ids: []int64{0, 1},
			want: []sp{{A, pay, 64}, {A + 128, pay + 64, 64}}, runs: 2, bbytes: 64},
		{name: "fa-nhd two layers", descs: []TensorDesc{faNHD("l0", A), faNHD("l1", B)}, chunk: 4, ids: []int64{1, 2},
			want: []sp{{A + 32, pay, 64}, {A + 160, pay + 64, 64}, {B + 32, pay + 128, 64}, {B + 160, pay + 192, 64}},
			runs: 4, bbytes: 128},
		{name: "fa layers back to back merge", descs: []TensorDesc{faNHD("l0", A), faNHD("l1", A+256)}, chunk: 8,
			ids: []int64{0, 1, 2, 3}, want: []sp{{A, pay, 512}}, runs: 4, bbytes: 128},
		{name: "flashinfer-nhd", descs: []TensorDesc{fiNHD("l0", A)}, chunk: 4, ids: []int64{2, 3},
			want: []sp{{A + 128, pay, 128}}, runs: 1, bbytes: 64},
		{name: "flashinfer-hnd scattered", descs: []TensorDesc{fiHND("l0", A)}, chunk: 4, ids: []int64{3, 0},
			want: []sp{{A + 192, pay, 64}, {A, pay + 64, 64}}, runs: 1, bbytes: 64},
		{name: "mla", descs: []TensorDesc{mla("l0", A), mla("l1", B)}, chunk: 4, ids: []int64{1, 2},
			want: []sp{{A + 32, pay, 64}, {B + 32, pay + 64, 64}}, runs: 2, bbytes: 64},
		{name: "cross-nhd consecutive", descs: []TensorDesc{crossNHD(A)}, chunk: 4, ids: []int64{1, 2},
			want: []sp{{A + 192, pay, 384}}, runs: 1, bbytes: 192},
		{name: "cross-nhd whole chunk of 4", descs: []TensorDesc{crossNHD(A)}, chunk: 8, ids: []int64{0, 1, 2, 3},
			want: []sp{{A, pay, 768}}, runs: 1, bbytes: 192},
		{name: "cross-hnd scattered", descs: []TensorDesc{crossHND(A)}, chunk: 4, ids: []int64{3, 1},
			want: []sp{{A + 576, pay, 192}, {A + 192, pay + 192, 192}}, runs: 1, bbytes: 192},
		{name: "cross fa-logical dims", descs: []TensorDesc{crossFALogical(A)}, chunk: 4, ids: []int64{2, 3},
			want: []sp{{A + 384, pay, 384}}, runs: 1, bbytes: 192},
		{name: "paged LBNHC consecutive", descs: []TensorDesc{pagedLBNHC("l0", A)}, chunk: 4, ids: []int64{2, 3},
			want: []sp{{A + 128, pay, 128}}, runs: 1, bbytes: 64},
		{name: "paged LBHNC scattered, two layers", descs: []TensorDesc{pagedLBHNC("l0", A), pagedLBHNC("l1", B)}, chunk: 4,
			ids: []int64{3, 0}, want: []sp{{A + 192, pay, 64}, {A, pay + 64, 64}, {B + 192, pay + 128, 64}, {B, pay + 192, 64}},
			runs: 2, bbytes: 128},
		{name: "paged BLNHC: the layers tile each block, copied as one", chunk: 4, ids: []int64{1, 2},
			descs: []TensorDesc{pagedBLNHC("l0", A, 0, 2), pagedBLNHC("l1", A, 1, 2)},
			want:  []sp{{A + 128, pay, 256}}, runs: 1, bbytes: 128},
		{name: "paged BLNHC scattered: one span per block", chunk: 4, ids: []int64{3, 0},
			descs: []TensorDesc{pagedBLNHC("l0", A, 0, 2), pagedBLNHC("l1", A, 1, 2)},
			want:  []sp{{A + 384, pay, 128}, {A, pay + 128, 128}}, runs: 1, bbytes: 128},
		{name: "paged BLNHC with a gap (a layer not registered): per layer", chunk: 4, ids: []int64{1, 2},
			descs: []TensorDesc{pagedBLNHC("l0", A, 0, 3), pagedBLNHC("l2", A, 2, 3)},
			want:  []sp{{A + 192, pay, 64}, {A + 384, pay + 64, 64}, {A + 320, pay + 128, 64}, {A + 512, pay + 192, 64}},
			runs:  2, bbytes: 128},
		{name: "per-layer views over a block-major buffer", chunk: 4, ids: []int64{0, 1},
			descs: []TensorDesc{interleaved("l0", A, 0), interleaved("l1", A, 1)},
			want:  []sp{{A, pay, 256}}, runs: 1, bbytes: 128},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l, err := New(tc.descs, tc.chunk)
			assert.NilError(t, err)
			assert.Equal(t, l.RunsPerBlock(), tc.runs)
			assert.Equal(t, l.BlockBytes(), tc.bbytes)
			save, err := l.Plan(tc.ids, obj, kv.Save)
			assert.NilError(t, err)
			got := make([]sp, len(save))
			for i, s := range save {
				got[i] = sp(s)
			}
			assert.DeepEqual(t, got, tc.want)
			load, err := l.Plan(tc.ids, obj, kv.Load)
			assert.NilError(t, err)
			assert.Equal(t, len(load), len(save))
			for i := range load {
				assert.Equal(t, load[i], kv.Span{Src: save[i].Dst, Dst: save[i].Src, Len: save[i].Len})
			}
			size, err := l.ObjectSize(tc.chunk)
			assert.NilError(t, err)
			var total uint64
			for _, s := range save {
				total += s.Len
			}
			assert.Equal(t, total+HeaderSize, size)
		})
	}
}

// interleaved is layer l of a 2-layer block-major buffer viewed per layer
// as FlashAttention (2, blocks, block_size, heads, head): K and V of one
// layer are adjacent, blocks are 128 bytes apart.
func interleaved(name string, base uint64, l uint64) TensorDesc {
	return TensorDesc{Layer: name, Backend: FlashAttn, Device: cuda0(), DataPtr: base + l*64, DTypeSize: tDT,
		Shape:   []int64{2, tNB, tBS, tH, tD},
		Strides: []int64{tRun, 2 * 2 * tRun, tH * tD * tDT, tD * tDT, tDT}}
}

func TestPlanAppendReuses(t *testing.T) {
	l, err := New([]TensorDesc{faNHD("l0", 0x1000)}, 4)
	assert.NilError(t, err)
	buf := make([]kv.Span, 0, 8)
	a, err := l.AppendPlan(buf, []int64{0, 1}, obj, kv.Save)
	assert.NilError(t, err)
	b, err := l.AppendPlan(a, []int64{2, 3}, obj+1024, kv.Save)
	assert.NilError(t, err)
	assert.Equal(t, len(b), 4) // the second plan never merges into the first
	assert.Equal(t, &b[0], &buf[:1][0])
}

func TestPlanRefuses(t *testing.T) {
	l, err := New([]TensorDesc{faNHD("model.layers.0.attn", 0x1000)}, 4)
	assert.NilError(t, err)
	tests := []struct {
		name string
		ids  []int64
		base uint64
		dir  kv.Direction
		want string
	}{
		{"partial chunk", []int64{1}, obj, kv.Save, "partial chunk"},
		{"too many", []int64{0, 1, 2}, obj, kv.Save, "partial chunk"},
		{"out of range", []int64{0, 4}, obj, kv.Load, "out of range"},
		{"negative", []int64{-2, 0}, obj, kv.Load, "out of range"},
		{"below skip in a save", []int64{-2, 0}, obj, kv.Save, "out of range"},
		{"repeat", []int64{2, 2}, obj, kv.Load, "repeated"},
		{"null object", []int64{0, 1}, 0, kv.Save, "object_base"},
		{"overflow", []int64{0, 1}, ^uint64(0) - 100, kv.Save, "overflows"},
		{"direction", []int64{0, 1}, obj, 7, "direction"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := l.Plan(tc.ids, tc.base, tc.dir)
			assert.ErrorIs(t, err, ErrGeometry)
			assert.Check(t, is.ErrorContains(err, tc.want))
			assert.Check(t, is.ErrorContains(err, "model.layers.0.attn"))
		})
	}
}

func TestPlanLoadSkipsBlocks(t *testing.T) {
	descs := []TensorDesc{{Layer: "x", Backend: CrossLayer, Device: Device{Kind: CPU}, DataPtr: 1 << 20, DTypeSize: 2,
		Shape: []int64{8, 1, 2, 4, 1, 8}, Strides: []int64{128, 128, 64, 16, 16, 2}}}
	l, err := New(descs, 16)
	assert.NilError(t, err)
	const obj = 1 << 30
	spans, err := l.Plan([]int64{Skip, 5, 6, Skip}, obj, kv.Load)
	assert.NilError(t, err)
	// Blocks 5 and 6 are adjacent on both sides: one span; the skipped
	// blocks' bytes of the object are passed over, never read or written.
	assert.DeepEqual(t, spans, []kv.Span{{Src: obj + HeaderSize + 128, Dst: 1<<20 + 5*128, Len: 256}})
	// A save skips too (a windowed group's object leaves blocks out).
	spans, err = l.Plan([]int64{Skip, 5, 6, 7}, obj, kv.Save)
	assert.NilError(t, err)
	assert.DeepEqual(t, spans, []kv.Span{{Src: 1<<20 + 5*128, Dst: obj + HeaderSize + 128, Len: 384}})
	spans, err = l.Plan([]int64{Skip, Skip, Skip, Skip}, obj, kv.Load)
	assert.NilError(t, err)
	assert.Equal(t, len(spans), 0)
}

// vLLM's kernel block split: dim 0 of a (blocks, heads, block_size, head)
// view counts kernel blocks, two per block. Described with a kernel_blocks
// dim, a block is its two kernel blocks (block size 2 × 4 tokens), and in
// this head-major page (heads outside the tokens) still one run.
func TestPlanKernelBlocks(t *testing.T) {
	const base = 1 << 20
	descs := []TensorDesc{{Layer: "x", Backend: Paged, Device: Device{Kind: CPU}, DataPtr: base, DTypeSize: 2,
		Shape:   []int64{4, 2, 2, 4, 8},
		Strides: []int64{256, 128, 64, 16, 2},
		Dims:    []Dim{DimBlocks, DimKernelBlocks, DimHeads, DimBlockSize, DimHead}}}
	l, err := New(descs, 16)
	assert.NilError(t, err)
	assert.Equal(t, l.BlockSize(), 8)
	assert.Equal(t, l.ChunkBlocks(), 2)
	assert.Equal(t, l.BlockBytes(), uint64(256))
	const obj = 1 << 30
	spans, err := l.Plan([]int64{1, 2}, obj, kv.Save)
	assert.NilError(t, err)
	assert.DeepEqual(t, spans, []kv.Span{{Src: base + 256, Dst: obj + HeaderSize, Len: 512}})
	// Without the dim the same view is 4-token blocks: another layout.
	descs[0].Shape, descs[0].Strides, descs[0].Dims = []int64{8, 2, 4, 8}, []int64{128, 64, 16, 2}, nil
	l2, err := New(descs, 16)
	assert.NilError(t, err)
	assert.Equal(t, l2.BlockSize(), 4)
	assert.Check(t, l2.Fingerprint() != l.Fingerprint())
}
