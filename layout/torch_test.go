package layout

import (
	"encoding/json"
	"os"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

type geometryFile struct {
	Source      string  `json:"source"`
	ChunkTokens int     `json:"chunk_tokens"`
	Consecutive []int64 `json:"consecutive_ids"`
	Scattered   []int64 `json:"scattered_ids"`
	Cases       []struct {
		Name    string       `json:"name"`
		Tensors []TensorDesc `json:"tensors"`
		Expect  struct {
			Runs        int    `json:"runs_per_block"`
			BlockBytes  uint64 `json:"block_bytes"`
			Consecutive int    `json:"consecutive_spans"`
			Scattered   int    `json:"scattered_spans"`
		} `json:"expect"`
	} `json:"cases"`
}

func readGeometry(t *testing.T, path string) *geometryFile {
	t.Helper()
	b, err := os.ReadFile(path)
	assert.NilError(t, err)
	var g geometryFile
	assert.NilError(t, json.Unmarshal(b, &g))
	return &g
}

// TestTorchGeometry checks descriptors as the Python connector reports them
// (build/torch_geometry.py). The checked-in file is emulated; on a machine
// with PyTorch, build/gpu-check.sh sets KVSHIM_TORCH_GEOMETRY to a file made
// from real tensors, which must give the same runs, spans and fingerprints.
func TestTorchGeometry(t *testing.T) {
	ref := readGeometry(t, "testdata/torch_geometry.json")
	g := ref
	if p := os.Getenv("KVSHIM_TORCH_GEOMETRY"); p != "" {
		g = readGeometry(t, p)
	}
	t.Logf("source: %s", g.Source)
	assert.Equal(t, len(g.Cases), len(ref.Cases))
	fps := map[[32]byte]string{}
	for i, c := range g.Cases {
		t.Run(c.Name, func(t *testing.T) {
			l, err := New(c.Tensors, g.ChunkTokens)
			assert.NilError(t, err)
			assert.Equal(t, l.RunsPerBlock(), c.Expect.Runs)
			assert.Equal(t, l.BlockBytes(), c.Expect.BlockBytes)
			for _, ids := range []struct {
				ids  []int64
				want int
			}{{g.Consecutive, c.Expect.Consecutive}, {g.Scattered, c.Expect.Scattered}} {
				spans, err := l.Plan(ids.ids, 1<<44, kv.Save)
				assert.NilError(t, err)
				assert.Equal(t, len(spans), ids.want, "ids %v", ids.ids)
			}
			refL, err := New(ref.Cases[i].Tensors, ref.ChunkTokens)
			assert.NilError(t, err)
			assert.Equal(t, l.FingerprintHex(), refL.FingerprintHex(), "fingerprint differs from the emulated tensors")
			if other, dup := fps[l.Fingerprint()]; dup {
				t.Errorf("same fingerprint as %s", other)
			}
			fps[l.Fingerprint()] = c.Name
		})
	}
}
