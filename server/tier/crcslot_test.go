package tier_test

import (
	"os"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/tier"
)

// The payload CRC slot (objfmt, kvshim.verify=l2): workers seal headers
// only; the L2 writer sets each object's payload CRC in L1 before any
// adapter reads it; fills serve only objects whose CRC is set and matches.

// bare is pattern(h, rank) as a worker under kvshim.verify=l2 seals it:
// the same header with the payload CRC slot empty.
func bare(h kv.Hash, rank uint32) []byte {
	b := pattern(h, rank)
	clear(b[objfmt.HeaderSize-8 : objfmt.HeaderSize])
	return b
}

// putObjs writes objs under chunks hs of rank into L1 (ALLOC, fill,
// COMMIT) and returns their L1 bytes (the test's view of the segments).
func (e *env) putObjs(t *testing.T, rank uint32, hs []kv.Hash, objs [][]byte) [][]byte {
	t.Helper()
	tag := kv.Tag{0x79, byte(rank)}
	sizes := make([]uint64, len(hs))
	for i := range sizes {
		sizes[i] = objSize
	}
	ar, err := e.st.Alloc(e.sess, &ipc.AllocReq{Tag: tag, Namespace: ns1, Rank: rank, Hashes: hs, Sizes: sizes})
	assert.NilError(t, err)
	mem := make([][]byte, len(hs))
	for i, s := range ar.Status {
		assert.Equal(t, s, ipc.StatusOK)
		mem[i] = e.src.at(ar.Locs[i])
		copy(mem[i], objs[i])
	}
	_, err = e.st.Commit(e.sess, &ipc.CommitReq{Tag: tag, Namespace: ns1, Rank: rank, Hashes: hs})
	assert.NilError(t, err)
	return mem
}

// Objects committed without a payload CRC get one from the L2 writer, in
// L1 (before any adapter reads them) and so in every L2 copy; a restarted
// server fills them from L2 and serves them, CRC checked.
func TestStoreSetsPayloadCRCBeforeL2(t *testing.T) {
	dir := t.TempDir()
	cfg := fsConfig(dir)
	hs := hashes("bare", 4)
	objs := make([][]byte, len(hs))
	for i, h := range hs {
		objs[i] = bare(h, 0)
		_, err := objfmt.Verify(objs[i], kv.Key{Namespace: ns1, Hash: h})
		assert.ErrorIs(t, err, objfmt.ErrNoPayloadCRC)
	}
	a := newEnv(t, 8, nil, server.Options{}, cfg)
	mem := a.putObjs(t, 0, hs, objs)
	a.flush(t)
	st := a.st.Writer().Stats()
	assert.Equal(t, st.Saved[0], int64(len(hs)))
	assert.Equal(t, st.Checksummed, int64(len(hs)))
	assert.Equal(t, a.stat(t, "kvshim_l2_store_checksummed_objects_total"), float64(len(hs)))
	assert.Equal(t, a.stat(t, "kvshim_l2_store_checksummed_bytes_total"), float64(len(hs)*(objSize-objfmt.HeaderSize)))
	for i, h := range hs {
		// In L1: the slot is set, nothing else changed.
		assert.Assert(t, string(mem[i]) == string(pattern(h, 0)), "chunk %d: L1 bytes after the store", i)
	}
	// Objects that carry a CRC already (a worker under kvshim.verify=always)
	// are stored as they are.
	full := hashes("full", 2)
	a.put(t, 0, full)
	a.flush(t)
	assert.Equal(t, a.st.Writer().Stats().Checksummed, int64(len(hs)))
	a.close(t)

	// In L2: what a restarted server fills from and serves.
	b := newEnv(t, 8, func(c *server.Config) { c.L2StorePolicy = tier.PolicyNone }, server.Options{}, cfg)
	for _, x := range [][]kv.Hash{hs, full} {
		id, n := b.lookup(t, 1, false, x)
		assert.Equal(t, n, uint32(len(x)))
		b.check(t, id, 1, false, x, n)
	}
	ps := b.st.PrefetchController().Stats()
	assert.Equal(t, ps.ChunksOK[0], int64(len(hs)+len(full)))
	assert.Equal(t, ps.ChunksRejected[0], int64(0))
}

// An object whose header does not verify under the key it was committed
// under (another key's bytes, garbage) is never written to L2: counted as
// skipped (corrupt) and unpinned; the chunks around it are stored.
func TestStoreSkipsObjectsThatDoNotVerify(t *testing.T) {
	dir := t.TempDir()
	hs := hashes("skip", 3)
	other := hashes("skip other", 1)
	garbage := make([]byte, objSize)
	for i := range garbage {
		garbage[i] = byte(i)
	}
	a := newEnv(t, 8, nil, server.Options{}, fsConfig(dir))
	a.putObjs(t, 0, hs, [][]byte{bare(hs[0], 0), bare(other[0], 0), garbage})
	a.flush(t)
	st := a.st.Writer().Stats()
	assert.Equal(t, st.Saved[0], int64(1))
	assert.Equal(t, st.SkippedCorrupt, int64(2))
	assert.Equal(t, st.Pending, int64(0))
	assert.Equal(t, a.stat(t, `kvshim_l2_store_skipped_total{reason=corrupt}`), float64(2))
	be, err := fs.Open(fs.Config{BasePath: dir})
	assert.NilError(t, err)
	for i, h := range hs {
		_, err := os.Stat(be.Path(tier.Key(ns1, 0, h)))
		assert.Equal(t, err == nil, i == 0, "chunk %d: %v", i, err)
	}
}

// storeRaw writes obj under (ns1, rank, h) straight through the restarted
// server's adapter, replacing what was there (a valid fs trailer for the
// new bytes: only the object check can tell).
func storeRaw(t *testing.T, e *env, be *fs.Backend, rank uint32, h kv.Hash, obj []byte) {
	t.Helper()
	assert.NilError(t, os.Remove(be.Path(tier.Key(ns1, rank, h))))
	st := e.st.L2Adapters()[0].Store(t.Context(), []kv.Key{tier.Key(ns1, rank, h)}, [][]byte{obj})
	<-st.Done()
	assert.Assert(t, st.Results()[0].OK(), "%v", st.Results()[0].Err)
}

// The partial-hit counter-example (see seedCounterExample) under the default policy, with the real fs
// adapter: chunks 0-3 saved by workers that seal headers only; in L2,
// chunk 1's payload is corrupt (its CRC, set by the core, still the
// original's) and chunk 2 is intact. The fill never serves chunk 1, and the
// prefix stops there: 1 chunk, never 3. Objects in L2 without a payload CRC
// (written by something other than the core) are rejected the same way.
func TestCorruptL2ObjectIsNeverRestored(t *testing.T) {
	dir := t.TempDir()
	cfg := faultConfig(dir)
	be, err := fs.Open(fs.Config{BasePath: dir})
	assert.NilError(t, err)
	cases := []struct {
		name   string
		damage func(h kv.Hash) []byte // chunk 1's new L2 bytes
	}{
		{"payload byte changed", func(h kv.Hash) []byte {
			b := pattern(h, 0) // what the core wrote: the slot set
			b[objfmt.HeaderSize+4000] ^= 0x08
			return b
		}},
		{"payload CRC changed", func(h kv.Hash) []byte {
			b := pattern(h, 0)
			b[objfmt.HeaderSize-7] ^= 0x01 // a CRC bit: outside the header CRC
			return b
		}},
		{"no payload CRC", func(h kv.Hash) []byte { return bare(h, 0) }},
	}
	a := newEnv(t, 8, nil, server.Options{}, cfg)
	chunks := make([][]kv.Hash, len(cases))
	for i, c := range cases {
		chunks[i] = hashes("counterexample "+c.name, 4)
		objs := make([][]byte, 4)
		for k, h := range chunks[i] {
			objs[k] = bare(h, 0)
		}
		a.putObjs(t, 0, chunks[i], objs)
		a.flush(t)
	}
	a.close(t)

	b := newEnv(t, 8, func(c *server.Config) { c.L2StorePolicy = tier.PolicyNone }, server.Options{}, cfg)
	for i, c := range cases {
		hs := chunks[i]
		storeRaw(t, b, be, 0, hs[1], c.damage(hs[1]))
		id, n := b.lookup(t, 1, false, hs)
		assert.Equal(t, n, uint32(1), c.name)
		b.check(t, id, 1, false, hs, n) // chunk 0: the right bytes
		rr, err := b.st.Retrieve(b.sess, &ipc.RetrieveReq{Owner: b.sess.ID(), LookupID: id, Rank: 0, Start: 1, End: 4})
		if err == nil {
			for k, st := range rr.Status {
				assert.Assert(t, st != ipc.StatusOK, "%s: chunk %d served past the prefix", c.name, k+1)
			}
		}
		ps := b.st.PrefetchController().Stats()
		assert.Equal(t, ps.ChunksRejected[0], int64(i+1), c.name)
		assert.Equal(t, ps.KeyMismatches[0], int64(0), c.name)
		testkit.Eventually(t, 20*time.Second, c.name+": corrupt object deleted", func() bool {
			_, err := os.Stat(be.Path(tier.Key(ns1, 0, hs[1])))
			return os.IsNotExist(err)
		})
	}
}
