package server

import (
	"errors"
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/tier"
	"gotest.tools/v3/assert"
)

func TestPinSurvivesClearAndEviction(t *testing.T) {
	st := newCore(t, 1, Options{}) // 128 objects of 8 KiB
	s := open(t, st, 0)
	hs := hashes("pin", 2)
	save(t, st, s, 1, 0, hs)
	p, ok := st.Pin(ns1, 0, hs[0])
	assert.Assert(t, ok)
	assert.Equal(t, len(p.Mem), objSize)
	assert.Equal(t, p.Key, tier.Key(ns1, 0, hs[0]))
	_, ok = st.Pin(ns1, 1, hs[0])
	assert.Assert(t, !ok)
	c, err := st.Clear(s)
	assert.NilError(t, err)
	assert.Equal(t, c.Objects, uint64(1)) // hs[1] went, the pinned one stayed
	save(t, st, s, 2, 0, hashes("fill L1", 200))
	assert.Assert(t, stat(t, st, "kvshim_l1_evictions_total") > 0)
	r := lookupNow(t, st, s, 1, 1, false, hs[:1]) // a lookup holds it too
	assert.Equal(t, r.Chunks, uint32(1))
	assert.Equal(t, stat(t, st, "kvshim_l1_pinned"), 1.0)
	st.Unpin([]tier.Object{p})
	st.Unpin([]tier.Object{p}) // a second unpin is refused (logged): the lookup's hold stays
	assert.Equal(t, stat(t, st, "kvshim_l1_pinned"), 0.0)
	assert.Equal(t, holds(t, st), 1.0)
	assert.NilError(t, st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 1}))
	assert.Equal(t, holds(t, st), 0.0)
	c, err = st.Clear(s)
	assert.NilError(t, err)
	assert.Assert(t, c.Objects > 0)
	assert.Assert(t, stat(t, st, "kvshim_l1_used_max_bytes") <= float64(1<<20))
}

func TestOnCommitPinsPublished(t *testing.T) {
	var got []tier.Object
	var st *Core
	st = newCore(t, 1, Options{OnCommit: func(objs []tier.Object) {
		got = append(got, objs...)
		_, err := st.Stats(nil) // outside the lock: calling back works
		assert.Assert(t, errors.Is(err, ErrSessionClosed))
	}})
	s := open(t, st, 0)
	hs := hashes("commit", 3)
	save(t, st, s, 1, 0, hs)
	save(t, st, s, 2, 0, hs) // already resident: nothing new
	assert.Equal(t, len(got), 3)
	assert.Equal(t, stat(t, st, "kvshim_l1_pinned"), 3.0)
	st.Unpin(got)
	assert.Equal(t, stat(t, st, "kvshim_l1_pinned"), 0.0)
	assert.Equal(t, holds(t, st), 0.0)
}

// Answer makes a pending lookup final while reservations stay; a later
// Commit frees its object instead of publishing it, Done frees the rest.
func TestFillAnswerKeepsReservations(t *testing.T) {
	pf := &manualFiller{}
	st := newCore(t, 4, Options{Filler: pf})
	s := open(t, st, 0)
	hs := hashes("answer", 3)
	save(t, st, s, 1, 0, hs[:1])
	assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: 1, Namespace: ns1, WorldSize: 2, Hashes: hs}))
	ft := pf.tasks[0]
	assert.Equal(t, ft.Start, uint32(0)) // rank 1 lacks chunk 0
	assert.DeepEqual(t, ft.Resident(), []bool{true, false, false, false, false, false})
	assert.Equal(t, ft.SizeHint(), uint64(0)) // nothing held yet
	for c := range uint32(2) {
		_, ok, err := ft.Reserve(1, c, objSize, true)
		assert.Assert(t, ok && err == nil)
	}
	assert.Equal(t, stat(t, st, "kvshim_l1_prefetch_bytes"), 2.0*objSize)
	assert.NilError(t, ft.Commit(1, 0, true))
	ft.Answer()
	r, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: 1})
	assert.NilError(t, err)
	assert.DeepEqual(t, *r, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 1, Sources: []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: 1}}})
	_, _, err = ft.Reserve(1, 2, objSize, true)
	assert.Assert(t, errors.Is(err, ErrFill))
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), 1.0) // chunk 1 still loading
	assert.NilError(t, ft.Commit(1, 1, true))                             // arrives late: freed
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=temporary}"), 1.0) // held chunk 0
	ft.Done()
	for rank := range uint32(2) {
		assert.NilError(t, st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 1, Rank: rank}))
	}
	assert.Equal(t, stat(t, st, "kvshim_l1_prefetch_bytes"), 0.0)
	assert.Equal(t, used(t, st), float64(objSize))
}
