package server

import (
	"crypto/sha256"
	"encoding/binary"
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l1"
	"gotest.tools/v3/assert"
)

const objSize = 8 << 10 // 8 KiB test objects

// newCore returns a core of capMiB MiB (segments of a quarter of it,
// slabs of 64 KiB) that is closed when the test ends.
func newCore(t testing.TB, capMiB float64, o Options, tweak ...func(*Config)) *Core {
	t.Helper()
	cfg := DefaultConfig()
	cfg.L1SizeGB = capMiB / 1024
	cfg.SegmentSize = uint64(capMiB*(1<<20)/4) &^ (l1.PageSize - 1)
	cfg.SlabSize = 64 << 10
	for _, f := range tweak {
		f(&cfg)
	}
	st, err := NewCore(cfg, o)
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, st.Close()) })
	return st
}

func sessionID(n int) kv.Tag {
	var t kv.Tag
	binary.LittleEndian.PutUint64(t[:], uint64(n)+1)
	return t
}

func open(t testing.TB, st *Core, n int) *Session {
	t.Helper()
	s, err := st.OpenSession(sessionID(n))
	assert.NilError(t, err)
	return s
}

var ns1 = kv.Namespace{1}

// hashes returns n chained test hashes for a prompt seed.
func hashes(seed string, n int) []kv.Hash {
	out := make([]kv.Hash, n)
	prev := sha256.Sum256([]byte(seed))
	for i := range out {
		var b [36]byte
		copy(b[:], prev[:])
		binary.LittleEndian.PutUint32(b[32:], uint32(i))
		prev = sha256.Sum256(b[:])
		out[i] = prev
	}
	return out
}

// save writes chunks hs on rank (alloc + fill + commit) as writer tag.
func save(t testing.TB, st *Core, s *Session, tag byte, rank uint32, hs []kv.Hash) []ipc.Status {
	t.Helper()
	req := &ipc.AllocReq{Tag: kv.Tag{tag}, Namespace: ns1, Rank: rank, Hashes: hs, Sizes: sizes(len(hs))}
	resp, err := st.Alloc(s, req)
	assert.NilError(t, err)
	var ok []kv.Hash
	for i, stt := range resp.Status {
		if stt == ipc.StatusOK {
			ok = append(ok, hs[i])
		}
	}
	c, err := st.Commit(s, &ipc.CommitReq{Tag: kv.Tag{tag}, Namespace: ns1, Rank: rank, Hashes: ok})
	assert.NilError(t, err)
	for _, stt := range c.Status {
		assert.Equal(t, stt, ipc.StatusOK)
	}
	return resp.Status
}

func sizes(n int) []uint64 {
	s := make([]uint64, n)
	for i := range s {
		s[i] = objSize
	}
	return s
}

// result registers a lookup and returns its LOOKUP_RESULT answer.
func lookupNow(t testing.TB, st *Core, s *Session, id uint64, world uint32, mla bool, hs []kv.Hash) *ipc.LookupResultResp {
	t.Helper()
	assert.NilError(t, st.Lookup(s, &ipc.LookupReq{LookupID: id, Namespace: ns1, WorldSize: world, MLA: mla, Hashes: hs}))
	r, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: id})
	assert.NilError(t, err)
	return r
}

func stat(t testing.TB, st *Core, name string) float64 {
	t.Helper()
	v, ok := st.Stat(name)
	assert.Assert(t, ok, "no stat %s", name)
	return v
}

func used(t testing.TB, st *Core) float64  { return stat(t, st, "kvshim_l1_used_bytes") }
func holds(t testing.TB, st *Core) float64 { return stat(t, st, "kvshim_l1_holds") }
