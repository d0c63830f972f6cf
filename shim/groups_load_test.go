package shim

import (
	"bytes"
	"slices"
	"testing"

	"gotest.tools/v3/assert"
)

// A chunked local group whose attention chunk starts at the hit needs no
// chunk there: its load is empty and the scheduler has freed (and the
// server forgotten) its lookup. The worker must not read that lookup: a
// failed load would make vLLM recompute the whole request (PollFailed,
// vLLM's failed_recving with several groups).
func TestEmptyGroupLoadReadsNoLookup(t *testing.T) {
	r, c := groupRig(t, `{"groups": [{"kind": "full"}, {"kind": "chunked_local", "window": 16}]}`, true)
	s, w, srv := r.sched, r.workers[0], r.srv

	tokens, a0, _ := saveTwoGroups(t, r, c)

	// B hits 16 tokens: group 1's attention chunk starts there
	// (Skipped(16) = 16), vLLM gives it null blocks below.
	assert.Equal(t, r.match(t, "B", tokens, Extras{}, 0), 2*tChunk)
	b0, b1 := seq(30, 5), []int64{0, 0, 0, 0, 44}
	assert.NilError(t, s.AfterAlloc("B", append(slices.Clone(b0), b1...), 2, 0, 2*tChunk))
	b, err := s.BuildMeta(&Step{})
	assert.NilError(t, err)
	m, err := DecodeStepMeta(b, tChunk/tBS, tBlocks)
	assert.NilError(t, err)
	assert.Equal(t, len(m.Loads), 2)
	assert.Equal(t, m.Loads[1].Start, m.Loads[1].End)
	w.StartLoads(m)
	w.wg.Wait()
	_, rv, eb, failed := w.PollFailed()
	assert.DeepEqual(t, rv, []string{"B"})
	assert.Equal(t, len(eb), 0)
	assert.Equal(t, len(failed), 0)
	for i := range 4 {
		assert.Check(t, bytes.Equal(c.block(0, int(b0[i])), c.block(0, int(a0[i]))), "group 0 block %d", i)
	}
	assert.Equal(t, holds(t, srv), 0.0)
}
