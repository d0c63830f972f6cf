package shim

import (
	"errors"
	"strings"
	"testing"
)

func vllmSpec() VLLMSpec {
	four, sixteen := 4, 16
	lay := "LBNHC"
	return VLLMSpec{Model: "m", ChunkSize: 256, CacheDType: "auto", BlockSize: 16, CacheLayout: &lay, MambaCacheMode: "align",
		WorldSize: 1, TPSize: 1, Groups: []VLLMGroup{{Classes: []string{"FullAttentionSpec", "AttentionSpec"},
			Layers: []string{"a", "b"}, BlockSize: 16, DType: "torch.float16", KVHeads: &four, HeadSize: &sixteen}}}
}

// The layout string is hashed into the namespace: it must stay the one the
// Python connector wrote (json.dumps, sort_keys), byte for byte.
func TestResolveVLLMSingleGroupLayout(t *testing.T) {
	l, err := ResolveVLLM(vllmSpec())
	if err != nil {
		t.Fatal(err)
	}
	want := `{"block_size": 16, "cache_layout": "LBNHC", "head_size": 16, "kv_heads": 4, "layers": 2, "spec": "FullAttentionSpec"}`
	if l.Layout != want || l.Model != "m@main" || l.DType != "float16" || l.Groups || l.SchedBlockSize != 16 || l.DCPSize != 1 {
		t.Fatalf("got %+v", l)
	}
}

func TestResolveVLLMGroups(t *testing.T) {
	s := vllmSpec()
	s.Groups = append(s.Groups, VLLMGroup{Classes: []string{"SlidingWindowSpec"}, Layers: []string{"c"}, BlockSize: 16,
		SlidingWindow: 32, ExtraRetained: 8})
	l, err := ResolveVLLM(s)
	if err != nil {
		t.Fatal(err)
	}
	if !l.Groups || !strings.Contains(l.Layout, `{"block_size": 16, "head_size": null, "kind": "sliding_window", "kv_heads": null, "layers": 1, "spec": "SlidingWindowSpec", "window": 40}`) {
		t.Fatalf("got %+v", l)
	}
	s.Groups[1].BlockSize = 32
	if _, err := ResolveVLLM(s); err == nil || !strings.Contains(err.Error(), "blocks of [16, 32] tokens") {
		t.Fatalf("mixed block sizes: %v", err)
	}
}

func TestResolveVLLMRefusals(t *testing.T) {
	for _, tc := range []struct {
		edit func(*VLLMSpec)
		want string
	}{
		{func(s *VLLMSpec) { s.ChunkSize = 0 }, "chunk_size: 0"},
		{func(s *VLLMSpec) { s.BlockSize = -1 }, "block_size: -1"},
		{func(s *VLLMSpec) { s.WorldSize = 0 }, "world_size: 0"},
		{func(s *VLLMSpec) { s.TPSize = 0 }, "tp_size: 0"},
		{func(s *VLLMSpec) { s.DCPSize = -2 }, "dcp_size: -2"},
		{func(s *VLLMSpec) { s.Model = "" }, "model: empty"},
		{func(s *VLLMSpec) { s.Groups[0].Classes = nil }, "groups[0].classes: empty"},
		{func(s *VLLMSpec) { s.Groups[0].BlockSize = 0 }, "groups[0].block_size: 0"},
		{func(s *VLLMSpec) { // one group of another kind is read as before groups; two are refused
			s.Groups = append(s.Groups, VLLMGroup{Classes: []string{"CrossAttentionSpec"}, Layers: []string{"c", "d", "e", "f"}, BlockSize: 16})
		}, "KV-cache group 1 (CrossAttentionSpec, layers ['c', 'd', 'e']...) of model m@main: kvshim restores"},
		{func(s *VLLMSpec) {
			s.Groups[0] = VLLMGroup{Classes: []string{"MambaSpec"}, Layers: []string{"a"}, BlockSize: 16, MambaCacheMode: "none"}
		}, "holds Mamba/SSM state, which kvshim does not save or restore here: mamba_cache_mode is 'none'"},
		{func(s *VLLMSpec) {
			s.Groups[0] = VLLMGroup{Classes: []string{"MambaSpec"}, Layers: []string{"a"}, BlockSize: 16, MambaCacheMode: "align"}
			s.DCPSize = 2
		}, "context parallelism"},
	} {
		s := vllmSpec()
		tc.edit(&s)
		_, err := ResolveVLLM(s)
		if !errors.Is(err, ErrBadNamespaceSpec) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want %q, got %v", tc.want, err)
		}
	}
}
