package shim

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func conversation(n int, base uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

// finishMeta finishes req with fin and returns the next step's metadata.
func finishMeta(t *testing.T, r *rig, req string, fin *FinishState) (bool, *StepMeta, error) {
	t.Helper()
	delay, err := r.sched.FinishedSaving(req, fin)
	b, merr := r.sched.BuildMeta(&Step{})
	assert.NilError(t, merr)
	m, merr := DecodeStepMeta(b, tChunk/tBS, tBlocks)
	assert.NilError(t, merr)
	return delay, m, err
}

// A finished request saves every full chunk it computed, prompt and
// generated alike, under the keys a lookup of its whole token list makes:
// the next turn of the conversation hits all of them.
func TestFinishedSavesTheGeneratedChunks(t *testing.T) {
	r := newRig(t, 1)
	prompt := conversation(2*tChunk+3, 100) // 2 full chunks + 3
	assert.Equal(t, r.match(t, "A", prompt, Extras{}, 0), 0)
	blocks := seq(10, 8) // room for 32 tokens
	assert.NilError(t, r.sched.AfterAlloc("A", blocks, 1, 0, 0))
	for _, b := range blocks {
		r.caches[0].fill(int(b), 7)
	}
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: blocks[:5], Scheduled: len(prompt)}}})
	assert.Equal(t, r.workers[0].Stats().SavedChunks, uint64(2))

	// 14 tokens generated: 33 tokens, 32 computed (the last sampled one has
	// no KV): chunks 2 and 3 are new. Go gets the tokens from chunk 2 on.
	all := append(append([]uint32{}, prompt...), conversation(14, 900)...)
	first := 2 * tChunk
	delay, m, err := finishMeta(t, r, "A", &FinishState{Tokens: all[first:], First: first, Computed: len(all) - 1, Blocks: blocks})
	assert.NilError(t, err)
	assert.Equal(t, delay, true)
	want, err := ChunkHashes(r.sched.ns, all[:4*tChunk], tChunk, Extras{})
	assert.NilError(t, err)
	assert.Equal(t, len(m.Saves), 1)
	sv := m.Saves[0]
	assert.DeepEqual(t, sv.Hashes, []kv.Hash{kv.Hash(want[2]), kv.Hash(want[3])})
	assert.Equal(t, sv.First, uint32(2))
	assert.DeepEqual(t, sv.Blocks, blocks[4:8])
	assert.DeepEqual(t, m.Finished, []string{"A"})
	w := r.workers[0]
	w.Finishing(m.Finished)
	w.StartSaves(m, 0)
	w.wg.Wait()
	sending, _, _ := w.Poll()
	assert.DeepEqual(t, sending, []string{"A"})
	assert.Equal(t, w.Stats().SavedChunks, uint64(4))

	// Turn 2: the whole conversation so far + a new question hits 4 chunks,
	// restored byte for byte into other blocks.
	turn2 := append(append([]uint32{}, all...), conversation(5, 2000)...)
	assert.Equal(t, r.match(t, "B", turn2, Extras{}, 0), 4*tChunk)
	dst := seq(30, 8)
	assert.NilError(t, r.sched.AfterAlloc("B", dst, 1, -1, 4*tChunk))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv["B"], 1)
	assert.Equal(t, len(errs), 0)
	for i := range tLayers {
		for k := range 8 {
			assert.Assert(t, bytes.Equal(r.caches[0].block(i, int(dst[k])), r.caches[0].block(i, int(blocks[k]))), "layer %d block %d", i, k)
		}
	}
	assert.Equal(t, r.sched.Finished("B"), false)
	assert.Equal(t, r.sched.Requests(), 0)
}

// Only chunks whose every token has KV, and only those not saved already;
// a request finished without tokens (aborted) saves nothing new.
func TestFinishedSavesOnlyComputedUnsavedChunks(t *testing.T) {
	r := newRig(t, 1)
	ex := Extras{CacheSalt: "s"}
	prompt := conversation(tChunk+2, 300)
	all := append(append([]uint32{}, prompt...), conversation(2*tChunk-2, 700)...) // 3 chunks of tokens
	blocks := seq(20, 6)
	for _, tc := range []struct {
		name     string
		computed int
		fin      bool
		want     int // new chunks saved at the finish
	}{
		{"last token has no KV", len(all) - 1, true, 1},     // chunk 1 only
		{"every token computed", len(all), true, 2},         // chunks 1, 2
		{"fewer computed than tokens", tChunk + 5, true, 0}, // chunk 1 incomplete
		{"aborted", len(all) - 1, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, r.match(t, tc.name, prompt, ex, 0), 0)
			assert.NilError(t, r.sched.AfterAlloc(tc.name, blocks, 1, 0, 0))
			// the prompt's chunk 0 goes with the prefill step
			b, err := r.sched.BuildMeta(&Step{Requests: []StepRequest{{Req: tc.name, Blocks: blocks[:3], Scheduled: len(prompt)}}})
			assert.NilError(t, err)
			m, err := DecodeStepMeta(b, tChunk/tBS, tBlocks)
			assert.NilError(t, err)
			assert.Equal(t, len(m.Saves), 1)
			var fin *FinishState
			if tc.fin {
				fin = &FinishState{Tokens: all, Computed: tc.computed, Blocks: blocks}
			}
			delay, m, err := finishMeta(t, r, tc.name, fin)
			assert.NilError(t, err)
			assert.Equal(t, delay, true) // the prompt's save may still read the blocks
			want, _ := ChunkHashes(r.sched.ns, all[:len(all)/tChunk*tChunk], tChunk, ex)
			if tc.want == 0 {
				assert.Equal(t, len(m.Saves), 0)
				return
			}
			assert.Equal(t, len(m.Saves), 1)
			assert.Equal(t, m.Saves[0].First, uint32(1))
			assert.Equal(t, len(m.Saves[0].Hashes), tc.want)
			for i, h := range m.Saves[0].Hashes {
				assert.Equal(t, h, kv.Hash(want[1+i]))
			}
		})
	}
	assert.Equal(t, r.sched.Requests(), 0)
}

// Tokens that do not fit the request save nothing; the request is still
// finished and its delay reported.
func TestFinishedRefusesTokensThatDoNotFit(t *testing.T) {
	r := newRig(t, 1)
	prompt := conversation(tChunk+2, 300)
	for _, fin := range []*FinishState{
		{Tokens: prompt[tChunk+1:], First: tChunk + 1, Computed: 3 * tChunk, Blocks: seq(0, 6)}, // First past the keyed chunks
		{Tokens: prompt[:tChunk], Computed: tChunk, Blocks: seq(0, 6)},                          // shorter than the prompt
		{Tokens: prompt, First: -1, Computed: tChunk, Blocks: seq(0, 6)},
	} {
		assert.Equal(t, r.match(t, "A", prompt, Extras{}, 0), 0)
		delay, m, err := finishMeta(t, r, "A", fin)
		assert.Assert(t, errors.Is(err, ErrBadMeta), "%v", err)
		assert.Equal(t, delay, false)
		assert.Equal(t, len(m.Saves), 0)
		assert.Equal(t, r.sched.Requests(), 0)
	}
	// An unknown request: nothing to do.
	delay, err := r.sched.FinishedSaving("nobody", &FinishState{Tokens: prompt, Computed: len(prompt)})
	assert.NilError(t, err)
	assert.Equal(t, delay, false)
}
