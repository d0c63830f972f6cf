package server

import (
	"errors"
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/tier"
	"gotest.tools/v3/assert"
)

// manualFiller keeps every fill for the test to drive.
type manualFiller struct{ tasks []*FillTask }

func (m *manualFiller) Fill(_ tier.FillRequest, f tier.Fill) bool {
	m.tasks = append(m.tasks, f.(*FillTask))
	return true
}

// The partial-hit counter-example: L1 has chunk 0, L2 has 0-2, chunk 3 missing;
// the L2 load of chunk 1 fails, chunk 2 succeeds → prefix is chunk 0 only.
func TestFillPrefixCounterExample(t *testing.T) {
	for _, temporary := range []bool{true, false} {
		pf := &manualFiller{}
		st := newCore(t, 4, Options{Filler: pf})
		s := open(t, st, 0)
		hs := hashes("1024 tokens", 4)
		save(t, st, s, 1, 0, hs[:1])
		base := used(t, st)
		assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: 3, Namespace: ns1, WorldSize: 1, Hashes: hs}))
		assert.Equal(t, len(pf.tasks), 1)
		ft := pf.tasks[0]
		assert.Equal(t, ft.Start, uint32(1))
		assert.Equal(t, len(ft.Hashes), 3)
		for _, c := range []uint32{1, 2} {
			mem, ok, err := ft.Reserve(0, c, objSize, temporary)
			assert.NilError(t, err)
			assert.Assert(t, ok)
			assert.Equal(t, len(mem), objSize)
			mem[0] = byte(c)
		}
		_, _, err := ft.Reserve(0, 0, objSize, temporary)
		assert.Assert(t, errors.Is(err, ErrFill))
		assert.NilError(t, ft.Commit(0, 1, false)) // load of chunk 1 failed
		assert.NilError(t, ft.Commit(0, 2, true))
		ft.Done()
		ft.Done() // idempotent
		r, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: 3})
		assert.NilError(t, err)
		assert.DeepEqual(t, *r, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 1, Sources: []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: 1}}})
		assert.Equal(t, holds(t, st), 1.0)
		if temporary {
			// Chunk 2's temporary copy had no hold: freed at once.
			assert.Equal(t, used(t, st), base)
		} else {
			assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=resident}"), 2.0)
		}
		assert.NilError(t, st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 3, Rank: 0}))
		assert.Equal(t, holds(t, st), 0.0)
	}
}

func TestFillTemporaryServedAndFreed(t *testing.T) {
	pf := &manualFiller{}
	st := newCore(t, 4, Options{Filler: pf})
	sched, worker := open(t, st, 0), open(t, st, 1)
	hs := hashes("mla", 3)
	base := used(t, st)
	assert.NilError(t, st.Lookup(sched, &ipc.LookupReq{LookupID: 1, Namespace: ns1, WorldSize: 4, MLA: true, Hashes: hs}))
	ft := pf.tasks[0]
	assert.Equal(t, ft.Ranks(), uint32(1))
	for c := range uint32(3) {
		mem, ok, err := ft.Reserve(0, c, objSize, true)
		assert.NilError(t, err)
		assert.Assert(t, ok)
		mem[0] = 0xA0 + byte(c)
		assert.NilError(t, ft.Commit(0, c, true))
	}
	ft.Done()
	r, _ := st.LookupResult(sched, &ipc.LookupResultReq{LookupID: 1})
	assert.Equal(t, r.Chunks, uint32(3))
	assert.Equal(t, holds(t, st), 12.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=temporary}"), 3.0)
	// Four readers (worker session, naming the scheduler as owner).
	for rank := range uint32(4) {
		rr, err := st.Retrieve(worker, &ipc.RetrieveReq{Owner: sched.ID(), LookupID: 1, Rank: rank, End: 3})
		assert.NilError(t, err)
		for c, l := range rr.Locs {
			assert.Equal(t, rr.Status[c], ipc.StatusOK)
			assert.Equal(t, st.memAt(l)[0], 0xA0+byte(c))
		}
		assert.NilError(t, st.Release(worker, &ipc.ReleaseReq{Owner: sched.ID(), LookupID: 1, Rank: rank}))
	}
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=temporary}"), 0.0)
	assert.Equal(t, used(t, st), base)
	assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
}

func TestFillCancelledBySessionClose(t *testing.T) {
	pf := &manualFiller{}
	st := newCore(t, 4, Options{Filler: pf})
	s := open(t, st, 0)
	hs := hashes("cancel", 2)
	assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: 1, Namespace: ns1, WorldSize: 1, Hashes: hs}))
	ft := pf.tasks[0]
	_, ok, err := ft.Reserve(0, 0, objSize, true)
	assert.Assert(t, ok && err == nil)
	assert.NilError(t, ft.Commit(0, 0, true))
	_, ok, err = ft.Reserve(0, 1, objSize, true)
	assert.Assert(t, ok && err == nil)
	st.CloseSession(s)
	// The still-reserved chunk stays until the filler lets go of it.
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), 1.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=temporary}"), 0.0)
	_, _, err = ft.Reserve(0, 1, objSize, true)
	assert.Assert(t, errors.Is(err, ErrFill))
	ft.Done()
	assert.Equal(t, used(t, st), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_lookups_pending"), 0.0)
}

// A request aborted between lookup and load releases every hold; L1 usage
// returns exactly to where it was.
