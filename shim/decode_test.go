package shim

import (
	"bytes"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

// decodeStep runs one step in which request req, decoding, is given its
// tokens up to a chunk boundary (tokens from token from on), and returns
// the step's saves.
func decodeStep(t *testing.T, r *rig, sr StepRequest) []SaveSpec {
	t.Helper()
	b, err := r.sched.BuildMeta(&Step{Requests: []StepRequest{sr}})
	assert.NilError(t, err)
	m, err := DecodeStepMeta(b, tChunk/tBS, tBlocks)
	assert.NilError(t, err)
	w := r.workers[0]
	w.StartSaves(m, 0)
	w.wg.Wait()
	return m.Saves
}

// A decode that crosses a chunk boundary saves the chunk it completed,
// under the key a lookup of the whole token list makes, once: neither a
// repeated boundary nor the finish saves it again. A preempted request's
// new lookup over all its tokens (prompt and generated) loads it
// byte-exact into other blocks, and its finish saves only what is new.
func TestDecodeSavesChunksAtBoundaries(t *testing.T) {
	r := newRig(t, 1)
	prompt := conversation(2*tChunk+3, 100) // 2 full chunks + 3
	all := append(append([]uint32{}, prompt...), conversation(20, 900)...)
	want, err := ChunkHashes(r.sched.ns, all[:4*tChunk], tChunk, Extras{})
	assert.NilError(t, err)
	assert.Equal(t, r.match(t, "A", prompt, Extras{}, 0), 0)
	blocks := seq(10, 10)
	for _, b := range blocks {
		r.caches[0].fill(int(b), 7)
	}
	assert.NilError(t, r.sched.AfterAlloc("A", blocks[:5], 1, 0, 0))
	sv := decodeStep(t, r, StepRequest{Req: "A", Blocks: blocks[:5], Scheduled: len(prompt)})
	assert.Equal(t, len(sv), 1)
	assert.Equal(t, sv[0].First, uint32(0))

	// Decoding below the boundary: no tokens, nothing saved.
	assert.Equal(t, len(decodeStep(t, r, StepRequest{Req: "A", NewBlocks: blocks[5:6], Computed: 20, Scheduled: 1})), 0)
	// Tokens past the chunks A keyed (from 24, A keyed 16) or short of its
	// prompt do not fit: nothing saved, no error.
	assert.Equal(t, len(decodeStep(t, r, StepRequest{Req: "A", Computed: 25, Scheduled: 1, Tokens: all[24:32], TokensFrom: 24})), 0)
	assert.Equal(t, len(decodeStep(t, r, StepRequest{Req: "A", Computed: 25, Scheduled: 1, Tokens: all[:16]})), 0)
	// KV up to token 24: chunk 2 (prompt tail + answer head) is saved.
	sv = decodeStep(t, r, StepRequest{Req: "A", Computed: 25, Scheduled: 1, Tokens: all[16:24], TokensFrom: 16})
	assert.Equal(t, len(sv), 1)
	assert.Equal(t, sv[0].First, uint32(2))
	assert.DeepEqual(t, sv[0].Hashes, []kv.Hash{kv.Hash(want[2])})
	assert.DeepEqual(t, sv[0].Blocks, blocks[4:6])
	// The same boundary again: no second save.
	assert.Equal(t, len(decodeStep(t, r, StepRequest{Req: "A", Computed: 26, Scheduled: 1, Tokens: all[16:24], TokensFrom: 16})), 0)
	assert.Equal(t, r.workers[0].Stats().SavedChunks, uint64(3))

	// Preempted at 30 computed tokens: a new lookup of all 30 tokens hits
	// chunks 0-2, loaded into other blocks.
	_, err = r.sched.BuildMeta(&Step{Preempted: []string{"A"}})
	assert.NilError(t, err)
	assert.Equal(t, r.sched.Requests(), 0)
	assert.Equal(t, r.match(t, "A", all[:30], Extras{}, 0), 3*tChunk)
	dst := seq(30, 10)
	assert.NilError(t, r.sched.AfterAlloc("A", dst[:8], 1, -1, 3*tChunk))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv["A"], 1)
	assert.Equal(t, len(errs), 0)
	for i := range tLayers {
		for k := range 6 {
			assert.Assert(t, bytes.Equal(r.caches[0].block(i, int(dst[k])), r.caches[0].block(i, int(blocks[k]))), "layer %d block %d", i, k)
		}
	}
	for _, b := range dst[6:] {
		r.caches[0].fill(int(b), 9)
	}
	// It recomputes tokens 24-29 and decodes on; its finish (38 of 39
	// tokens computed) saves chunk 3 only.
	assert.Equal(t, len(decodeStep(t, r, StepRequest{Req: "A", Blocks: dst[:8], Computed: 24, Scheduled: 6})), 0)
	delay, m, err := finishMeta(t, r, "A", &FinishState{Tokens: all[24:], First: 24, Computed: len(all) - 1, Blocks: dst})
	assert.NilError(t, err)
	assert.Equal(t, delay, true) // the finish's save reads the blocks
	assert.Equal(t, len(m.Saves), 1)
	assert.Equal(t, m.Saves[0].First, uint32(3))
	assert.DeepEqual(t, m.Saves[0].Hashes, []kv.Hash{kv.Hash(want[3])})
	assert.DeepEqual(t, m.Saves[0].Blocks, dst[6:8])
	assert.Equal(t, r.sched.Requests(), 0)
}

// A request whose prompt holds no full chunk saves the chunks its decode
// completes, keyed from the namespace's root.
func TestDecodeSavesChunksOfAShortPrompt(t *testing.T) {
	r := newRig(t, 1)
	all := conversation(3*tChunk, 500)
	assert.Equal(t, r.match(t, "A", all[:5], Extras{}, 0), 0)
	blocks := seq(10, 6)
	assert.NilError(t, r.sched.AfterAlloc("A", blocks[:2], 1, 0, 0))
	assert.Equal(t, len(decodeStep(t, r, StepRequest{Req: "A", Blocks: blocks[:2], Scheduled: 5})), 0)
	sv := decodeStep(t, r, StepRequest{Req: "A", NewBlocks: blocks[2:5], Computed: 17, Scheduled: 1, Tokens: all[:16]})
	want, err := ChunkHashes(r.sched.ns, all[:16], tChunk, Extras{})
	assert.NilError(t, err)
	assert.Equal(t, len(sv), 1)
	assert.Equal(t, sv[0].First, uint32(0))
	assert.DeepEqual(t, sv[0].Hashes, []kv.Hash{kv.Hash(want[0]), kv.Hash(want[1])})
	assert.DeepEqual(t, sv[0].Blocks, blocks[:4])
	assert.Equal(t, r.sched.Finished("A"), true)
	assert.Equal(t, r.match(t, "B", all[:20], Extras{}, 0), 2*tChunk)
	assert.NilError(t, r.sched.AfterAlloc("B", seq(40, 5), 1, -1, 0))
	assert.Equal(t, r.sched.Finished("B"), false)
}
