package server

import (
	"errors"
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

func TestTwoWritersOneResident(t *testing.T) {
	st := newCore(t, 4, Options{})
	a, b := open(t, st, 0), open(t, st, 1)
	h := hashes("dup", 1)
	req := func(tag byte) *ipc.AllocReq {
		return &ipc.AllocReq{Tag: kv.Tag{tag}, Namespace: ns1, Hashes: h, Sizes: sizes(1)}
	}
	ra, err := st.Alloc(a, req(1))
	assert.NilError(t, err)
	rb, err := st.Alloc(b, req(2))
	assert.NilError(t, err)
	assert.Equal(t, ra.Status[0], ipc.StatusOK)
	assert.Equal(t, rb.Status[0], ipc.StatusOK) // another tag may stage the same key
	assert.Assert(t, ra.Locs[0] != rb.Locs[0])
	again, err := st.Alloc(a, req(1))
	assert.NilError(t, err)
	assert.Equal(t, again.Status[0], ipc.StatusInProgress)
	assert.Equal(t, used(t, st), 2.0*objSize)
	// Invisible while staging.
	r := lookupNow(t, st, a, 1, 1, false, h)
	assert.Equal(t, r.Chunks, uint32(0))
	cb, err := st.Commit(b, &ipc.CommitReq{Tag: kv.Tag{2}, Namespace: ns1, Hashes: h})
	assert.NilError(t, err)
	assert.Equal(t, cb.Status[0], ipc.StatusOK)
	ca, err := st.Commit(a, &ipc.CommitReq{Tag: kv.Tag{1}, Namespace: ns1, Hashes: h})
	assert.NilError(t, err)
	assert.Equal(t, ca.Status[0], ipc.StatusOK)
	assert.Equal(t, used(t, st), 1.0*objSize)
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=resident}"), 1.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_discarded_total"), 1.0)
	r = lookupNow(t, st, a, 2, 1, false, h)
	assert.Equal(t, r.Chunks, uint32(1))
	rr, err := st.Retrieve(b, &ipc.RetrieveReq{Owner: a.ID(), LookupID: 2, End: 1})
	assert.NilError(t, err)
	assert.Equal(t, rr.Locs[0], rb.Locs[0]) // the first publisher's copy
	// Resident now: a third writer skips the write.
	rc, err := st.Alloc(a, req(3))
	assert.NilError(t, err)
	assert.Equal(t, rc.Status[0], ipc.StatusResident)
	// Committing twice or someone else's staging is NotFound.
	cx, err := st.Commit(a, &ipc.CommitReq{Tag: kv.Tag{1}, Namespace: ns1, Hashes: h})
	assert.NilError(t, err)
	assert.Equal(t, cx.Status[0], ipc.StatusNotFound)
}

func TestSessionClosedMidAlloc(t *testing.T) {
	st := newCore(t, 4, Options{})
	w := open(t, st, 0)
	hs := hashes("mid", 6)
	_, err := st.Alloc(w, &ipc.AllocReq{Tag: kv.Tag{1}, Namespace: ns1, Hashes: hs, Sizes: sizes(6)})
	assert.NilError(t, err)
	assert.Equal(t, used(t, st), 6.0*objSize)
	st.CloseSession(w)
	st.CloseSession(w) // idempotent
	assert.Equal(t, used(t, st), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), 0.0)
	_, err = st.Commit(w, &ipc.CommitReq{Tag: kv.Tag{1}, Namespace: ns1, Hashes: hs})
	assert.Assert(t, errors.Is(err, ErrSessionClosed))
	// The same instance id may reconnect, and the tag is free again.
	w2, err := st.OpenSession(w.ID())
	assert.NilError(t, err)
	assert.Equal(t, save(t, st, w2, 1, 0, hs)[0], ipc.StatusOK)
	_, err = st.OpenSession(w.ID())
	assert.Assert(t, errors.Is(err, ErrDuplicateSession))
}

func TestBadRequests(t *testing.T) {
	st := newCore(t, 1, Options{})
	s := open(t, st, 0)
	h := hashes("x", 2)
	cases := []struct {
		name string
		err  error
	}{
		{"alloc length mismatch", func() error {
			_, err := st.Alloc(s, &ipc.AllocReq{Hashes: h, Sizes: sizes(1)})
			return err
		}()},
		{"alloc size 0", func() error {
			_, err := st.Alloc(s, &ipc.AllocReq{Hashes: h[:1], Sizes: []uint64{0}})
			return err
		}()},
		{"alloc larger than a segment", func() error {
			_, err := st.Alloc(s, &ipc.AllocReq{Hashes: h[:1], Sizes: []uint64{1 << 30}})
			return err
		}()},
		{"lookup world 0", st.Lookup(s, &ipc.LookupReq{LookupID: 1, Hashes: h})},
		{"lookup too many keys", st.Lookup(s, &ipc.LookupReq{LookupID: 2, WorldSize: 1, Hashes: make([]kv.Hash, ipc.MaxKeys+1)})},
		{"lookup too many cells", st.Lookup(s, &ipc.LookupReq{LookupID: 2, WorldSize: 64, Hashes: make([]kv.Hash, ipc.MaxKeys)})},
		{"free start > end", st.Free(s, &ipc.FreeReq{LookupID: 1, Start: 3, End: 2})},
	}
	for _, tc := range cases {
		assert.Equal(t, StatusOf(tc.err), ipc.StatusBadRequest, tc.name)
	}
	assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: 3, Namespace: ns1, WorldSize: 2, Hashes: h}))
	_, err := st.Retrieve(s, &ipc.RetrieveReq{Owner: s.ID(), LookupID: 3, Rank: 2, End: 1})
	assert.Equal(t, StatusOf(err), ipc.StatusBadRequest)
	_, err = st.Retrieve(s, &ipc.RetrieveReq{Owner: sessionID(42), LookupID: 3, End: 1})
	assert.Equal(t, StatusOf(err), ipc.StatusUnknown)
	err = st.Release(s, &ipc.ReleaseReq{Owner: s.ID(), LookupID: 3, Rank: 9})
	assert.Equal(t, StatusOf(err), ipc.StatusBadRequest)
	assert.Equal(t, used(t, st), 0.0)
	assert.Check(t, is.Equal(stat(t, st, "kvshim_l1_objects{state=staging}"), 0.0))
}
