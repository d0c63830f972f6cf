package shim

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"flag"
	"os"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// The golden file pins the key encoding (namespace v1, root v2, chunk v1; see
// keys_hash.go). Its inputs are plain data so another implementation (the
// Python side, a future server) can check itself against it
// (testdata/keys_golden_check.py does). Regenerate only on a deliberate,
// versioned encoding change:
//
//	go test ./shim -run Golden -update-golden
var update = flag.Bool("update-golden", false, "rewrite testdata/keys_golden.json with the current outputs")

const goldenPath = "testdata/keys_golden.json"

type goldenFile struct {
	Comment    string            `json:"comment"`
	Namespaces []goldenNamespace `json:"namespaces"`
	Chunks     []goldenChunks    `json:"chunks"`
}

type goldenNamespace struct {
	Name      string        `json:"name"`
	Spec      NamespaceSpec `json:"spec"`
	Namespace string        `json:"namespace"`
}

type goldenMM struct {
	Hash   string `json:"hash"` // hashed as its UTF-8 bytes
	Offset int    `json:"offset"`
	Length int    `json:"length"`
}

// goldenLoRA is a LoRA adapter: present (even with both fields empty) or
// absent (null).
type goldenLoRA struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

type goldenChunks struct {
	Name string `json:"name"`
	// Namespace is hex; tokens are token[i] = uint32(i*2654435761 + seed).
	Namespace string      `json:"namespace"`
	NumTokens int         `json:"num_tokens"`
	Seed      uint32      `json:"seed"`
	ChunkSize int         `json:"chunk_size"`
	CacheSalt string      `json:"cache_salt,omitempty"`
	LoRA      *goldenLoRA `json:"lora,omitempty"`
	MM        []goldenMM  `json:"mm,omitempty"`
	Root      string      `json:"root"`
	Hashes    []string    `json:"hashes"`
}

func hexHashes(hs []kv.Hash) []string {
	out := make([]string, len(hs))
	for i := range hs {
		out[i] = hex.EncodeToString(hs[i][:])
	}
	return out
}

func TestGolden(t *testing.T) {
	raw, err := os.ReadFile(goldenPath)
	assert.NilError(t, err)
	var g goldenFile
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	assert.NilError(t, dec.Decode(&g))
	assert.Assert(t, len(g.Namespaces) > 0 && len(g.Chunks) > 0)

	for i, c := range g.Namespaces {
		ns, err := c.Spec.Namespace()
		assert.NilError(t, err, c.Name)
		got := hex.EncodeToString(ns[:])
		if *update {
			g.Namespaces[i].Namespace = got
			continue
		}
		assert.Check(t, is.Equal(got, c.Namespace), "namespace %q: the namespace encoding changed", c.Name)
	}
	for i, c := range g.Chunks {
		var ns kv.Namespace
		b, err := hex.DecodeString(c.Namespace)
		assert.NilError(t, err, c.Name)
		assert.Assert(t, is.Len(b, len(ns)), c.Name)
		copy(ns[:], b)
		ex := Extras{CacheSalt: c.CacheSalt}
		if c.LoRA != nil {
			ex.LoRA = &LoRA{Name: c.LoRA.Name, Path: c.LoRA.Path}
		}
		for _, m := range c.MM {
			ex.MM = append(ex.MM, MMInput{Hash: []byte(m.Hash), Offset: m.Offset, Length: m.Length})
		}
		root, err := RootHash(ns, ex)
		assert.NilError(t, err, c.Name)
		hs, err := ChunkHashes(ns, testTokens(c.NumTokens, c.Seed), c.ChunkSize, ex)
		assert.NilError(t, err, c.Name)
		if *update {
			g.Chunks[i].Root = hex.EncodeToString(root[:])
			g.Chunks[i].Hashes = hexHashes(hs)
			continue
		}
		assert.Check(t, is.Equal(hex.EncodeToString(root[:]), c.Root), "%q root: the key encoding changed", c.Name)
		assert.Check(t, is.DeepEqual(hexHashes(hs), c.Hashes), "%q hashes: the key encoding changed", c.Name)
	}
	if *update {
		out, err := json.MarshalIndent(&g, "", "  ")
		assert.NilError(t, err)
		assert.NilError(t, os.WriteFile(goldenPath, append(out, '\n'), 0o644))
	}
}
