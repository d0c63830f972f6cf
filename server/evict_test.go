package server

import (
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func TestEvictionSparesHeldAndStaging(t *testing.T) {
	// 256 KiB of L1 = 32 objects of 8 KiB; watermarks 0.9 / 0.5.
	st := newCore(t, 0.25, Options{}, func(c *Config) {
		c.HighWatermark, c.LowWatermark = 0.9, 0.5
	})
	s := open(t, st, 0)
	held := hashes("held", 8)
	save(t, st, s, 1, 0, held)
	r := lookupNow(t, st, s, 1, 1, false, held)
	assert.Equal(t, r.Chunks, uint32(8))
	staged := hashes("staged", 8)
	sr, err := st.Alloc(s, &ipc.AllocReq{Tag: kv.Tag{9}, Namespace: ns1, Hashes: staged, Sizes: sizes(8)})
	assert.NilError(t, err)
	for _, x := range sr.Status {
		assert.Equal(t, x, ipc.StatusOK)
	}
	// Fill the rest many times over: only the unheld residents churn.
	for i := range 10 {
		save(t, st, s, 2, 0, hashes(string(rune('a'+i)), 8))
		assert.Assert(t, used(t, st) <= 0.9*float64(256<<10))
	}
	assert.Assert(t, stat(t, st, "kvshim_l1_evictions_total") > 0)
	// Everything held is still there, byte for byte where it was.
	rr, err := st.Retrieve(s, &ipc.RetrieveReq{Owner: s.ID(), LookupID: 1, End: 8})
	assert.NilError(t, err)
	for _, x := range rr.Status {
		assert.Equal(t, x, ipc.StatusOK)
	}
	cr, err := st.Commit(s, &ipc.CommitReq{Tag: kv.Tag{9}, Namespace: ns1, Hashes: staged})
	assert.NilError(t, err)
	for _, x := range cr.Status {
		assert.Equal(t, x, ipc.StatusOK)
	}
	// With 16 pinned objects and 16 evictable, a 17-object batch fills the
	// rest after eviction and then reports NoSpace, corrupting nothing.
	assert.NilError(t, st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 1}))
	r = lookupNow(t, st, s, 2, 1, false, append(held, staged...))
	assert.Equal(t, r.Chunks, uint32(16))
	big := hashes("big", 17)
	br, err := st.Alloc(s, &ipc.AllocReq{Tag: kv.Tag{3}, Namespace: ns1, Hashes: big, Sizes: sizes(17)})
	assert.NilError(t, err)
	assert.Equal(t, br.Status[15], ipc.StatusOK)
	assert.Equal(t, br.Status[16], ipc.StatusNoSpace)
	rr, err = st.Retrieve(s, &ipc.RetrieveReq{Owner: s.ID(), LookupID: 2, End: 16})
	assert.NilError(t, err)
	for _, x := range rr.Status {
		assert.Equal(t, x, ipc.StatusOK)
	}
	_, err = st.Abort(s, &ipc.CommitReq{Tag: kv.Tag{3}, Namespace: ns1, Hashes: big})
	assert.NilError(t, err)
	assert.Equal(t, used(t, st), 16.0*objSize)
}

func TestLRUOrder(t *testing.T) {
	// 32 slots; low watermark 0 evicts everything unheld: use demand
	// eviction instead (high watermark 1).
	st := newCore(t, 0.25, Options{}, func(c *Config) { c.HighWatermark, c.LowWatermark = 1, 0.5 })
	s := open(t, st, 0)
	old, hot := hashes("old", 16), hashes("hot", 16)
	save(t, st, s, 1, 0, old)
	save(t, st, s, 1, 0, hot)
	// Touch "old" with a lookup hit, then release: old is now most recent.
	r := lookupNow(t, st, s, 1, 1, false, old)
	assert.Equal(t, r.Chunks, uint32(16))
	assert.NilError(t, st.Free(s, &ipc.FreeReq{LookupID: 1, End: ^uint32(0)}))
	save(t, st, s, 1, 0, hashes("new", 4))
	assert.Equal(t, lookupNow(t, st, s, 2, 1, false, old).Chunks, uint32(16))
	// hot's tail went first (a prefix's tail is older than its head).
	assert.Equal(t, lookupNow(t, st, s, 3, 1, false, hot).Chunks, uint32(12))
}
