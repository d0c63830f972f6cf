package shim

import (
	"bytes"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"
)

// A Mamba group keeps the state of the last token (vLLM's MambaManager:
// get_num_skipped_tokens is n-1), and its object of a chunk holds the
// chunk's last block alone: the state at the chunk's end.
func TestMambaGroupRule(t *testing.T) {
	m := GroupSpec{Kind: GroupMamba}
	assert.Check(t, m.Windowed() && m.BoundaryOnly())
	for _, g := range []GroupSpec{{Kind: GroupFull}, {Kind: GroupSlidingWindow, Window: 3}, {Kind: GroupChunkedLocal, Window: 8}} {
		assert.Check(t, !g.BoundaryOnly(), g.Kind)
	}
	for _, tc := range []struct {
		n, skipped int
	}{{0, 0}, {1, 0}, {2, 1}, {64, 63}, {192, 191}} {
		assert.Equal(t, m.Skipped(tc.n), tc.skipped, "n=%d", tc.n)
	}
	for _, tc := range []struct {
		c, chunk, bs, first int
	}{
		{0, 64, 16, 3}, {2, 64, 16, 11}, // 4 blocks a chunk: the 4th
		{0, 16, 16, 0}, {5, 16, 16, 5}, // a block a chunk: that block
		{1, 8, 4, 3},
		{1, 4, 1, 7}, // blocks of one token: the state at 8, never the one at 7
	} {
		assert.Equal(t, m.ObjectFirstBlock(tc.c, tc.chunk, tc.bs), tc.first, "%+v", tc)
	}
	spec := NamespaceSpec{Model: "m", DType: "bfloat16", ObjectFormat: 1, WorldSize: 1, ChunkSize: 64,
		LayoutFingerprint: `{"groups": [{"kind": "mamba", "shapes": [[4, 8]]}, {"kind": "full"}]}`}
	gs, err := spec.Groups()
	assert.NilError(t, err)
	assert.DeepEqual(t, gs, []GroupSpec{{Kind: GroupMamba}, {Kind: GroupFull}})
}

func mambaSpec() NamespaceSpec {
	return NamespaceSpec{Model: "m", DType: "bfloat16", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk,
		LayoutFingerprint: `{"groups": [{"kind": "full"}, {"kind": "mamba"}]}`}
}

// A chunk whose last Mamba block is vLLM's null block (no scheduler step
// ended on its boundary, or the state was retired) has no state to save:
// it is passed over, and the chunks around it are saved under their own
// keys (one SaveSpec per run of consecutive chunks).
func TestMambaSaveSkipsChunksWithoutState(t *testing.T) {
	s, err := NewScheduler(SchedulerConfig{Socket: filepath.Join(t.TempDir(), "none.sock"), Namespace: mambaSpec(), BlockSize: tBS,
		Timeout: 200 * time.Millisecond, Instance: uuid.New()})
	assert.NilError(t, err)
	defer s.Close()
	prompt := conversation(4*tChunk+1, 100)
	n, pending, err := s.Match("A", prompt, Extras{}, 0)
	assert.NilError(t, err)
	assert.Check(t, n == 0 && !pending)
	// Blocks of 4, chunks of 8: the states at 8, 24 and 32 are there (block
	// 1, 5, 7), the one at 16 (block 3) is not.
	full, state := seq(10, 9), []int64{0, 21, 0, 0, 0, 25, 0, 27, 28}
	b, err := s.BuildMeta(&Step{Requests: []StepRequest{{Req: "A", Blocks: flatGroups(full, state), Groups: 2, Scheduled: len(prompt)}}})
	assert.NilError(t, err)
	m, err := DecodeStepMeta(b, tChunk/tBS, tBlocks)
	assert.NilError(t, err)
	var got [][3]any
	for _, sv := range m.Saves {
		got = append(got, [3]any{sv.Group, sv.First, sv.Blocks})
	}
	assert.DeepEqual(t, got, [][3]any{
		{uint32(0), uint32(0), seq(10, 8)},
		{uint32(1), uint32(0), []int64{-1, 21}},
		{uint32(1), uint32(2), []int64{-1, 25, -1, 27}},
	})
	hs, err := ChunkHashes(s.ns, prompt, tChunk, Extras{})
	assert.NilError(t, err)
	assert.DeepEqual(t, m.Saves[2].Hashes, hs[2:4]) // chunk 2 is keyed as chunk 2, not 1
}

// Through the real server and a worker: full attention (layer0) and a
// Mamba group (layer1). A saved the full group's 3 chunks and the states at
// chunks 0 and 2 only. A hit must end on a boundary whose state is stored
// and short of the prompt's end:
//   - B (3 chunks and a token more) hits all 3: the Mamba group loads the
//     state block at 24 alone, into B's own block;
//   - C (exactly A's 3 chunks) can hit at most 2 chunks (vLLM computes the
//     last token itself), where no state is stored (chunk 1): C falls back
//     to 1 chunk, where one is.
func TestMambaHitEndsOnAStoredState(t *testing.T) {
	r, c := groupRig(t, mambaSpec().LayoutFingerprint, true)
	s, w, srv := r.sched, r.workers[0], r.srv

	tokens := conversation(3*tChunk+1, 100)
	assert.Equal(t, r.match(t, "A", tokens, Extras{}, 0), 0)
	a0, a1 := seq(10, 7), []int64{0, 21, 0, 0, 0, 25, 26}
	for _, b := range append(slices.Clone(a0), a1...) {
		if b > 0 {
			c.fill(int(b), 7)
		}
	}
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: flatGroups(a0, a1), Groups: 2, Scheduled: len(tokens)}}})
	assert.Equal(t, w.Stats().SavedChunks, uint64(3+2))

	assert.Equal(t, r.match(t, "B", tokens, Extras{}, 0), 3*tChunk)
	// vLLM's blocks for a hit of 24: nulls below the state block (Skipped(24) = 23).
	b0, b1 := seq(30, 7), []int64{0, 0, 0, 0, 0, 45, 46}
	assert.NilError(t, s.AfterAlloc("B", append(slices.Clone(b0), b1...), 2, 0, 3*tChunk))
	recving, errBlocks := r.step(t, &Step{})
	assert.DeepEqual(t, recving, map[string]int{"B": 1})
	assert.Equal(t, len(errBlocks), 0)
	for i := range 6 {
		assert.Check(t, bytes.Equal(c.block(0, int(b0[i])), c.block(0, int(a0[i]))), "group 0 block %d", i)
	}
	assert.Check(t, bytes.Equal(c.block(1, 45), c.block(1, 25)))
	assert.Equal(t, w.Stats().LoadedChunks, uint64(3+1))
	assert.Equal(t, holds(t, srv), 0.0)

	assert.Equal(t, r.match(t, "C", tokens[:3*tChunk], Extras{}, 0), tChunk)
	assert.Check(t, s.Finished("C") == false)
	assert.Equal(t, holds(t, srv), 0.0)
}

// An attention-free model: one Mamba group, listed in the layout, and
// vLLM's block tables in the single-group arrays (Step.Blocks, AfterAlloc)
// with its null block as id 0. Null blocks are no state: A saves the
// states at chunks 0 and 2 only (never block 0's bytes as chunk 1's
// state); B (3 chunks and a token more) loads the state at 24 alone into
// its own block; C (exactly 3 chunks) falls back to chunk 0, where a state
// is stored, and never to the missing one at 16.
func TestLoneMambaGroupNullBlocksHoldNoState(t *testing.T) {
	r, c := groupRig(t, `{"groups": [{"kind": "mamba"}]}`, false)
	s, w, srv := r.sched, r.workers[0], r.srv
	assert.DeepEqual(t, s.Groups(), []GroupSpec{{Kind: GroupMamba}})

	tokens := conversation(3*tChunk+1, 300)
	assert.Equal(t, r.match(t, "A", tokens, Extras{}, 0), 0)
	a := []int64{0, 21, 0, 0, 0, 25, 26} // states at 8 and 24, the running one at 25
	for _, b := range []int{0, 21, 25, 26} {
		c.fill(b, 11) // the null block too: its bytes must never become a state
	}
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: a, Scheduled: len(tokens)}}})
	assert.Equal(t, w.Stats().SavedChunks, uint64(2))

	assert.Equal(t, r.match(t, "B", tokens, Extras{}, 0), 3*tChunk)
	b := []int64{0, 0, 0, 0, 0, 45, 46} // vLLM's blocks for a hit of 24: nulls below the state block
	assert.NilError(t, s.AfterAlloc("B", b, 1, 0, 3*tChunk))
	recving, errBlocks := r.step(t, &Step{})
	assert.DeepEqual(t, recving, map[string]int{"B": 1})
	assert.Equal(t, len(errBlocks), 0)
	for l := range tLayers {
		assert.Check(t, bytes.Equal(c.block(l, 45), c.block(l, 25)), "layer %d", l)
	}
	assert.Equal(t, w.Stats().LoadedChunks, uint64(1))
	assert.Equal(t, holds(t, srv), 0.0)

	assert.Equal(t, r.match(t, "C", tokens[:3*tChunk], Extras{}, 0), tChunk)
	assert.Check(t, s.Finished("C") == false)
	assert.Equal(t, holds(t, srv), 0.0)

	// A finishes: its block table still has the null block at chunk 1's
	// end (and B's at chunks 0 and 1): nothing more is saved.
	delay, err := s.FinishedSaving("A", &FinishState{Tokens: tokens, Computed: len(tokens), Blocks: a})
	assert.NilError(t, err)
	assert.Check(t, delay) // its step's saves were dispatched
	r.step(t, &Step{})
	assert.Equal(t, w.Stats().SavedChunks, uint64(2))
}
