package shim

import (
	"strings"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

func baseSpec() NamespaceSpec {
	return NamespaceSpec{
		Model:             "meta-llama/Llama-3.1-8B-Instruct@rev",
		DType:             "bfloat16",
		LayoutFingerprint: "flash_attn/nhd",
		ObjectFormat:      1,
		WorldSize:         4,
		TPSize:            2,
		ChunkSize:         256,
		KVGroup:           0,
	}
}

func mustNS(t *testing.T, s NamespaceSpec) kv.Namespace {
	t.Helper()
	ns, err := s.Namespace()
	assert.NilError(t, err)
	return ns
}

func TestNamespaceFieldSensitivity(t *testing.T) {
	base := mustNS(t, baseSpec())
	assert.Equal(t, mustNS(t, baseSpec()), base, "deterministic")

	tests := []struct {
		name string
		edit func(*NamespaceSpec)
	}{
		{"model", func(s *NamespaceSpec) { s.Model += "x" }},
		{"dtype", func(s *NamespaceSpec) { s.DType = "fp8_e4m3" }},
		{"layout", func(s *NamespaceSpec) { s.LayoutFingerprint = "flash_attn/hnd" }},
		{"object format", func(s *NamespaceSpec) { s.ObjectFormat = 2 }},
		{"world size", func(s *NamespaceSpec) { s.WorldSize = 8 }},
		{"tp size", func(s *NamespaceSpec) { s.TPSize = 4 }},
		{"chunk size", func(s *NamespaceSpec) { s.ChunkSize = 512 }},
		{"kv group", func(s *NamespaceSpec) { s.KVGroup = 1 }},
		{"mla", func(s *NamespaceSpec) { s.MLA = true }},
		// Length prefixes: moving bytes between adjacent strings must change it.
		{"field boundary", func(s *NamespaceSpec) { s.Model, s.DType = s.Model+"b", "float16" }},
	}
	seen := map[kv.Namespace]string{base: "base"}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := baseSpec()
			tc.edit(&s)
			ns := mustNS(t, s)
			prev, dup := seen[ns]
			assert.Check(t, !dup, "%s collides with %s", tc.name, prev)
			seen[ns] = tc.name
		})
	}
}

func TestNamespaceMLA(t *testing.T) {
	mla := func(world, tp int) NamespaceSpec {
		s := baseSpec()
		s.MLA, s.WorldSize, s.TPSize = true, world, tp
		return s
	}
	// TP does not split MLA's latent KV: any TP size of one stage shares
	// one namespace (stored once, read by all ranks) ...
	assert.Equal(t, mustNS(t, mla(2, 2)), mustNS(t, mla(8, 8)))
	assert.Equal(t, mustNS(t, mla(1, 0)), mustNS(t, mla(4, 0)))
	// ... but pipeline stages hold different layers: every rank its own
	// objects (the server's MLA lookup serves only rank-0 objects), so the
	// whole (world, TP) shape is in the namespace.
	assert.Check(t, mustNS(t, mla(4, 2)) != mustNS(t, mla(16, 8)))
	assert.Check(t, mustNS(t, mla(4, 4)) != mustNS(t, mla(4, 2)))
	// Without MLA every TP size is its own namespace.
	a, b := baseSpec(), baseSpec()
	a.WorldSize, a.TPSize, b.WorldSize, b.TPSize = 2, 2, 8, 8
	assert.Check(t, mustNS(t, a) != mustNS(t, b))
	// TPSize 0 means pure TP.
	c := baseSpec()
	c.WorldSize, c.TPSize = 8, 0
	assert.Check(t, is.Equal(mustNS(t, c), mustNS(t, b)))
	assert.Check(t, is.Equal(mla(8, 4).KVWorldSize(), 8))
	assert.Check(t, is.Equal(mla(8, 8).KVWorldSize(), 1))
	assert.Check(t, is.Equal(c.KVWorldSize(), 8))
}

func TestKVRank(t *testing.T) {
	type rank struct {
		KV     uint32
		Writer bool
	}
	collect := func(s NamespaceSpec) []rank {
		var out []rank
		for r := 0; r < s.WorldSize; r++ {
			kv, w, err := s.KVRank(r)
			assert.NilError(t, err)
			out = append(out, rank{kv, w})
		}
		return out
	}
	s := baseSpec() // world 4, tp 2
	assert.DeepEqual(t, collect(s), []rank{{0, true}, {1, true}, {2, true}, {3, true}})
	s.MLA = true // 2 stages × 2 TP ranks: the stages differ, every rank writes its own
	assert.DeepEqual(t, collect(s), []rank{{0, true}, {1, true}, {2, true}, {3, true}})
	s.TPSize = 4 // one stage: one object, written by rank 0, read by all
	assert.DeepEqual(t, collect(s), []rank{{0, true}, {0, false}, {0, false}, {0, false}})
	s.TPSize = 2

	for _, r := range []int{-1, 4} {
		_, _, err := s.KVRank(r)
		assert.Check(t, is.ErrorIs(err, ErrBadNamespaceSpec), "rank %d", r)
	}
	s.Model = ""
	_, _, err := s.KVRank(0)
	assert.Check(t, is.ErrorIs(err, ErrBadNamespaceSpec))
}

func TestNamespaceValidate(t *testing.T) {
	tests := []struct {
		edit func(*NamespaceSpec)
		want string
	}{
		{func(s *NamespaceSpec) { s.Model = "" }, "model is empty"},
		{func(s *NamespaceSpec) { s.DType = "" }, "dtype is empty"},
		{func(s *NamespaceSpec) { s.LayoutFingerprint = "" }, "layout fingerprint is empty"},
		{func(s *NamespaceSpec) { s.Model = strings.Repeat("m", MaxFieldLen+1) }, "longer than"},
		{func(s *NamespaceSpec) { s.ObjectFormat = 0 }, "object format"},
		{func(s *NamespaceSpec) { s.WorldSize = 0 }, "world size 0"},
		{func(s *NamespaceSpec) { s.WorldSize = -2 }, "world size -2"},
		{func(s *NamespaceSpec) { s.WorldSize = 1 << 20 }, "world size"},
		{func(s *NamespaceSpec) { s.TPSize = 3 }, "TP size 3 does not divide world size 4"},
		{func(s *NamespaceSpec) { s.TPSize = -1 }, "TP size -1"},
		{func(s *NamespaceSpec) { s.ChunkSize = 0 }, "chunk size 0"},
		{func(s *NamespaceSpec) { s.ChunkSize = -256 }, "chunk size -256"},
		{func(s *NamespaceSpec) { s.ChunkSize = MaxChunkSize + 1 }, "chunk size"},
		{func(s *NamespaceSpec) { s.KVGroup = -1 }, "KV group -1"},
	}
	for _, tc := range tests {
		t.Run(tc.want, func(t *testing.T) {
			s := baseSpec()
			tc.edit(&s)
			_, err := s.Namespace()
			assert.Check(t, is.ErrorIs(err, ErrBadNamespaceSpec))
			assert.Check(t, is.ErrorContains(err, tc.want))
		})
	}
	assert.NilError(t, baseSpec().Validate())
}
