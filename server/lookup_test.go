package server

import (
	"errors"
	"testing"
	"time"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func TestRankContiguity(t *testing.T) {
	hs := hashes("prompt", 4)
	cases := []struct {
		name   string
		ranks  [][]int // chunks stored per rank
		world  uint32
		mla    bool
		chunks uint32
	}{
		{"rank0 3 rank1 2", [][]int{{0, 1, 2}, {0, 1}}, 2, false, 2},
		{"all on both", [][]int{{0, 1, 2, 3}, {0, 1, 2, 3}}, 2, false, 4},
		{"gap on rank1", [][]int{{0, 1, 2, 3}, {0, 2, 3}}, 2, false, 1},
		{"rank1 empty", [][]int{{0, 1, 2, 3}, {}}, 2, false, 0},
		{"rank2 missing", [][]int{{0, 1}, {0, 1}}, 3, false, 0},
		{"gap on rank0", [][]int{{1, 2, 3}, {0, 1, 2, 3}}, 2, false, 0},
		{"mla reads rank0 only", [][]int{{0, 1, 2}}, 8, true, 3},
		{"single rank", [][]int{{0, 1}}, 1, false, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := newCore(t, 4, Options{})
			s := open(t, st, 0)
			for r, cs := range tc.ranks {
				var sel []kv.Hash
				for _, c := range cs {
					sel = append(sel, hs[c])
				}
				save(t, st, s, byte(r+1), uint32(r), sel)
			}
			r := lookupNow(t, st, s, 7, tc.world, tc.mla, hs)
			assert.Equal(t, r.Status, ipc.StatusOK)
			assert.Equal(t, r.Chunks, tc.chunks)
			// Holds: one per reader per chunk of the prefix, nothing beyond.
			assert.Equal(t, holds(t, st), float64(tc.chunks)*float64(tc.world))
			if tc.chunks == 0 {
				// Consumed and holding nothing: forgotten at once.
				_, err := st.Retrieve(s, &ipc.RetrieveReq{Owner: s.ID(), LookupID: 7, End: ^uint32(0)})
				assert.Assert(t, errors.Is(err, ErrUnknownLookup))
				return
			}
			for rank := range tc.world {
				rr, err := st.Retrieve(s, &ipc.RetrieveReq{Owner: s.ID(), LookupID: 7, Rank: rank, Start: 0, End: ^uint32(0)})
				assert.NilError(t, err)
				assert.Equal(t, len(rr.Status), len(hs))
				for c, x := range rr.Status {
					want := ipc.StatusNotFound
					if uint32(c) < tc.chunks {
						want = ipc.StatusOK
					}
					assert.Equal(t, x, want, "rank %d chunk %d", rank, c)
				}
				assert.NilError(t, st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 7, Rank: rank}))
			}
			assert.Equal(t, holds(t, st), 0.0)
			assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0) // consumed + no holds → forgotten
		})
	}
}

func TestLookupResultConsumedOnce(t *testing.T) {
	st := newCore(t, 4, Options{})
	s := open(t, st, 0)
	hs := hashes("p", 3)
	save(t, st, s, 1, 0, hs[:2])
	assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: 1, Namespace: ns1, WorldSize: 1, Hashes: hs}))
	r1, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: 1})
	assert.NilError(t, err)
	assert.DeepEqual(t, *r1, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 2, Sources: []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: 2}}})
	r2, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: 1})
	assert.NilError(t, err)
	assert.Equal(t, r2.Status, ipc.StatusUnknown)
	// Holds survive consumption until RELEASE; then the lookup is forgotten.
	assert.Equal(t, holds(t, st), 2.0)
	assert.NilError(t, st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 1, Rank: 0}))
	assert.Equal(t, holds(t, st), 0.0)
	err = st.Free(s, &ipc.FreeReq{LookupID: 1, End: ^uint32(0)})
	assert.Assert(t, errors.Is(err, ErrUnknownLookup))
	assert.Equal(t, StatusOf(err), ipc.StatusUnknown)
	// Unknown id; duplicate live id is a bad request.
	r3, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: 99})
	assert.NilError(t, err)
	assert.Equal(t, r3.Status, ipc.StatusUnknown)
	assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: 5, Namespace: ns1, WorldSize: 1, Hashes: hs}))
	err = st.Lookup(s, &ipc.LookupReq{LookupID: 5, Namespace: ns1, WorldSize: 1, Hashes: hs})
	assert.Equal(t, StatusOf(err), ipc.StatusBadRequest)
}

// Final 0 and pending are different answers; the model's fill chooses.
func TestPendingVersusFinalZero(t *testing.T) {
	t.Run("final zero without filler", func(t *testing.T) {
		st := newCore(t, 4, Options{})
		s := open(t, st, 0)
		r := lookupNow(t, st, s, 1, 2, false, hashes("miss", 4))
		assert.DeepEqual(t, *r, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 0})
	})
	t.Run("pending while a fill runs", func(t *testing.T) {
		pf := &manualFiller{}
		st := newCore(t, 4, Options{Filler: pf})
		s := open(t, st, 0)
		r := lookupNow(t, st, s, 1, 1, false, hashes("miss", 4))
		assert.Equal(t, r.Status, ipc.StatusPending)
		assert.Equal(t, stat(t, st, "kvshim_lookups_pending"), 1.0)
		pf.tasks[0].Done() // the L2 had nothing
		r, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: 1})
		assert.NilError(t, err)
		assert.DeepEqual(t, *r, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 0})
		assert.Equal(t, stat(t, st, "kvshim_lookups_pending"), 0.0)
		assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
	})
	t.Run("full hit never asks the filler", func(t *testing.T) {
		pf := &manualFiller{}
		st := newCore(t, 4, Options{Filler: pf})
		s := open(t, st, 0)
		hs := hashes("hit", 2)
		save(t, st, s, 1, 0, hs)
		r := lookupNow(t, st, s, 1, 1, false, hs)
		assert.DeepEqual(t, *r, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 2, Sources: []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: 2}}})
		assert.Equal(t, len(pf.tasks), 0)
	})
}

func TestAbortAndFreeReturnToBaseline(t *testing.T) {
	cases := []struct {
		name string
		end  func(st *Core, s *Session) error
	}{
		{"free all", func(st *Core, s *Session) error {
			return st.Free(s, &ipc.FreeReq{LookupID: 1, Start: 0, End: ^uint32(0)})
		}},
		{"free in two ranges", func(st *Core, s *Session) error {
			if err := st.Free(s, &ipc.FreeReq{LookupID: 1, Start: 2, End: 9}); err != nil {
				return err
			}
			return st.Free(s, &ipc.FreeReq{LookupID: 1, Start: 0, End: 2})
		}},
		{"release every rank", func(st *Core, s *Session) error {
			for r := range uint32(2) {
				if err := st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 1, Rank: r}); err != nil {
					return err
				}
			}
			return nil
		}},
		{"session close", func(st *Core, s *Session) error { st.CloseSession(s); return nil }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := newCore(t, 4, Options{})
			w, s := open(t, st, 1), open(t, st, 0)
			hs := hashes("abort", 5)
			save(t, st, w, 1, 0, hs)
			save(t, st, w, 2, 1, hs[:4])
			baseUsed, baseObj := used(t, st), stat(t, st, "kvshim_l1_objects{state=resident}")
			r := lookupNow(t, st, s, 1, 2, false, hs)
			assert.Equal(t, r.Chunks, uint32(4))
			assert.Equal(t, holds(t, st), 8.0)
			assert.NilError(t, tc.end(st, s))
			assert.Equal(t, holds(t, st), 0.0)
			assert.Equal(t, used(t, st), baseUsed)
			assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=resident}"), baseObj)
			assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
			// Nothing is held: CLEAR drops all and L1 returns to zero.
			c, err := st.Clear(w)
			assert.NilError(t, err)
			assert.Equal(t, c.Objects, uint64(9))
			assert.Equal(t, used(t, st), 0.0)
			assert.Equal(t, stat(t, st, "kvshim_l1_slab_bytes"), 0.0)
		})
	}
}

func TestHoldAndStagingTTL(t *testing.T) {
	st := newCore(t, 4, Options{}, func(c *Config) {
		c.HoldTTL = 30 * time.Millisecond
		c.ReapInterval = 5 * time.Millisecond
	})
	s := open(t, st, 0)
	hs := hashes("ttl", 3)
	save(t, st, s, 1, 0, hs)
	base := used(t, st)
	r := lookupNow(t, st, s, 1, 1, false, hs)
	assert.Equal(t, r.Chunks, uint32(3))
	_, err := st.Alloc(s, &ipc.AllocReq{Tag: kv.Tag{2}, Namespace: ns1, Hashes: hashes("forgot", 2), Sizes: sizes(2)})
	assert.NilError(t, err)
	testkit.Eventually(t, 5*time.Second, "holds/staging to be reclaimed", func() bool { return holds(t, st) == 0 && used(t, st) == base })
	assert.Equal(t, stat(t, st, "kvshim_l1_ttl_reclaimed_holds_total"), 3.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_ttl_reclaimed_staging_total"), 2.0)
	assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
}

// FREE while a lookup is pending: freed chunks count in the answer but
// hold nothing, now or when the fill lands.
func TestFreeWhilePending(t *testing.T) {
	pf := &manualFiller{}
	st := newCore(t, 4, Options{Filler: pf})
	s := open(t, st, 0)
	hs := hashes("pending-free", 3)
	save(t, st, s, 1, 0, hs[:1])
	assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: 1, Namespace: ns1, WorldSize: 1, Hashes: hs}))
	assert.Equal(t, holds(t, st), 1.0) // chunk 0 observed in L1 = held
	assert.NilError(t, st.Free(s, &ipc.FreeReq{LookupID: 1, Start: 0, End: 2}))
	assert.Equal(t, holds(t, st), 0.0)
	ft := pf.tasks[0]
	for _, c := range []uint32{1, 2} {
		_, ok, err := ft.Reserve(0, c, objSize, false)
		assert.Assert(t, ok && err == nil)
		assert.NilError(t, ft.Commit(0, c, true))
	}
	ft.Done()
	r, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: 1})
	assert.NilError(t, err)
	assert.Equal(t, r.Chunks, uint32(3))
	assert.Equal(t, holds(t, st), 1.0) // only chunk 2
	rr, err := st.Retrieve(s, &ipc.RetrieveReq{Owner: s.ID(), LookupID: 1, End: ^uint32(0)})
	assert.NilError(t, err)
	assert.DeepEqual(t, rr.Status, []ipc.Status{ipc.StatusNotFound, ipc.StatusNotFound, ipc.StatusOK})
	assert.NilError(t, st.Free(s, &ipc.FreeReq{LookupID: 1, Start: 2, End: ^uint32(0)}))
	assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
}
