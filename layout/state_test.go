package layout

import (
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// mambaPage is vLLM 0.33's view of a Mamba/SSM layer: (blocks, 1, 1, state
// bytes) int8, blocks a padded page apart (create_kv_cache_views).
func mambaPage(name string, base uint64, state, page int64) TensorDesc {
	return TensorDesc{Layer: name, Backend: Paged, Device: cuda0(), DataPtr: base, DTypeSize: 1,
		Shape: []int64{tNB, 1, 1, state}, Strides: []int64{page, state, state, 1}, BlockTokens: tBS}
}

// A state page stands for BlockTokens tokens of the block table: its
// chunks have as many blocks as an attention group's, and a block's copy is
// the state alone (the page's padding is left out).
func TestStatePageBlockTokens(t *testing.T) {
	l, err := New([]TensorDesc{mambaPage("mamba.0", 0x10000, 24, 64)}, 4)
	assert.NilError(t, err)
	assert.Equal(t, l.BlockSize(), tBS)
	assert.Equal(t, l.ChunkBlocks(), 4/tBS)
	s, err := l.Plan([]int64{3, -1}, obj, kv.Save)
	assert.NilError(t, err)
	assert.DeepEqual(t, s, []kv.Span{{Src: 0x10000 + 3*64, Dst: pay, Len: 24}})

	without := mambaPage("mamba.0", 0x10000, 24, 64)
	without.BlockTokens = 0
	l0, err := New([]TensorDesc{without}, 4)
	assert.NilError(t, err)
	assert.Equal(t, l0.BlockSize(), 1) // a block of one "token": chunks of 4 blocks
	assert.Check(t, l.Fingerprint() != l0.Fingerprint())

	for _, tc := range []struct {
		name string
		f    func(*TensorDesc)
	}{
		{"negative", func(d *TensorDesc) { d.BlockTokens = -1 }},
		{"tokens dim", func(d *TensorDesc) { *d = paged(d.Layer, d.DataPtr, tPage, tC*tDT, tH*tC*tDT); d.BlockTokens = tBS }},
	} {
		d := mambaPage("mamba.0", 0x10000, 24, 64)
		tc.f(&d)
		_, err := New([]TensorDesc{d}, 4)
		assert.Check(t, is.ErrorIs(err, ErrGeometry), tc.name)
		assert.Check(t, is.ErrorContains(err, "block_tokens"), tc.name)
	}
}
