package tier_test

import (
	"io"
	"os"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/tier"
)

var ns2 = kv.Namespace{0xB2}

// putIn is put for another namespace.
func (e *env) putIn(t *testing.T, ns kv.Namespace, rank uint32, hs []kv.Hash) {
	t.Helper()
	tag := kv.Tag{0x78, byte(rank)}
	sizes := make([]uint64, len(hs))
	for i := range sizes {
		sizes[i] = objSize
	}
	ar, err := e.st.Alloc(e.sess, &ipc.AllocReq{Tag: tag, Namespace: ns, Rank: rank, Hashes: hs, Sizes: sizes})
	assert.NilError(t, err)
	for i, s := range ar.Status {
		assert.Equal(t, s, ipc.StatusOK)
		copy(e.src.at(ar.Locs[i]), patternIn(ns, hs[i], rank))
	}
	_, err = e.st.Commit(e.sess, &ipc.CommitReq{Tag: tag, Namespace: ns, Rank: rank, Hashes: hs})
	assert.NilError(t, err)
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	src, err := os.Open(from)
	assert.NilError(t, err)
	defer src.Close()
	dst, err := os.Create(to)
	assert.NilError(t, err)
	_, err = io.Copy(dst, src)
	assert.NilError(t, err)
	assert.NilError(t, dst.Close())
}

// Bytes bound to keys: an operator restores a backup of
// the L2 directory, a file is copied over another, one is truncated, one
// comes from another namespace or rank. A server restarted with an empty
// L1 fills lookups from L2: every object whose header names another key is
// rejected on the fill (never served), counted, logged and deleted, the
// lookup's prefix stops at the first bad chunk, and once the right bytes
// are saved again they are served.
func TestFillRejectsObjectsOfOtherKeys(t *testing.T) {
	dir := t.TempDir()
	cfg := fsConfig(dir)
	be, err := fs.Open(fs.Config{BasePath: dir}) // only to name the files
	assert.NilError(t, err)
	const world = 2
	path := func(ns kv.Namespace, rank uint32, h kv.Hash) string { return be.Path(tier.Key(ns, rank, h)) }
	type damage struct {
		name     string
		hs       []kv.Hash
		damage   func(hs []kv.Hash) // runs while the server is down
		bad      []string           // files that must be gone after the fill
		mismatch int64              // objects that name another key
	}
	other := hashes("other prompt", 4)
	foreign := hashes("foreign namespace", 4)
	cases := []*damage{
		{name: "another prompt's chunk copied over chunk 1", hs: hashes("copied", 4), mismatch: 1},
		{name: "chunks 1 and 2 swapped", hs: hashes("swapped", 4), mismatch: 2},
		{name: "chunk 1 truncated", hs: hashes("truncated", 4)},
		{name: "chunk 1 from another namespace", hs: hashes("namespace", 4), mismatch: 1},
		{name: "rank 1's chunk 1 over rank 0's", hs: hashes("rank", 4), mismatch: 1},
	}
	cases[0].damage = func(hs []kv.Hash) { copyFile(t, path(ns1, 0, other[1]), path(ns1, 0, hs[1])) }
	cases[1].damage = func(hs []kv.Hash) {
		p1, p2 := path(ns1, 1, hs[1]), path(ns1, 1, hs[2])
		assert.NilError(t, os.Rename(p1, p1+".x"))
		assert.NilError(t, os.Rename(p2, p1))
		assert.NilError(t, os.Rename(p1+".x", p2))
	}
	cases[2].damage = func(hs []kv.Hash) {
		st, err := os.Stat(path(ns1, 0, hs[1]))
		assert.NilError(t, err)
		assert.NilError(t, os.Truncate(path(ns1, 0, hs[1]), st.Size()/2))
	}
	// The same chunk hash in another namespace: only the namespace differs.
	cases[3].hs = foreign
	cases[3].damage = func(hs []kv.Hash) { copyFile(t, path(ns2, 0, hs[1]), path(ns1, 0, hs[1])) }
	cases[4].damage = func(hs []kv.Hash) { copyFile(t, path(ns1, 1, hs[1]), path(ns1, 0, hs[1])) }
	cases[0].bad = []string{path(ns1, 0, cases[0].hs[1])}
	cases[1].bad = []string{path(ns1, 1, cases[1].hs[1]), path(ns1, 1, cases[1].hs[2])}
	// A truncated file is the fs adapter's own miss (its trailer): not
	// loaded, and replaced by the next store (step 3).
	cases[3].bad = []string{path(ns1, 0, cases[3].hs[1])}
	cases[4].bad = []string{path(ns1, 0, cases[4].hs[1])}

	// 1. Store everything, rank by rank, and stop.
	a := newEnv(t, 8, nil, server.Options{}, cfg)
	for _, hs := range [][]kv.Hash{other, cases[0].hs, cases[1].hs, cases[2].hs, cases[3].hs, cases[4].hs} {
		for r := range uint32(world) {
			a.put(t, r, hs)
		}
		a.flush(t) // stores skip objects while too many bytes are pinned
	}
	a.putIn(t, ns2, 0, foreign)
	a.flush(t)
	assert.Equal(t, a.st.Writer().Stats().Saved[0], int64(6*world*4+4))
	a.close(t)
	for _, c := range cases {
		c.damage(c.hs)
	}

	// 2. Restart with an empty L1: each lookup's prefix stops at chunk 1,
	// and chunk 0 is the right bytes.
	b := newEnv(t, 8, func(c *server.Config) { c.L2StorePolicy = tier.PolicyNone }, server.Options{}, cfg)
	var mismatches int64
	for _, c := range cases {
		id, n := b.lookup(t, world, false, c.hs)
		assert.Equal(t, n, uint32(1), c.name)
		b.check(t, id, world, false, c.hs, n)
		// Nothing past the prefix can be retrieved.
		rr, err := b.st.Retrieve(b.sess, &ipc.RetrieveReq{Owner: b.sess.ID(), LookupID: id, Rank: 0, Start: 1, End: 4})
		if err == nil {
			for i, st := range rr.Status {
				assert.Assert(t, st != ipc.StatusOK, "%s: chunk %d served past the prefix", c.name, i+1)
			}
		}
		mismatches += c.mismatch
		ps := b.st.PrefetchController().Stats()
		assert.Equal(t, ps.KeyMismatches[0], mismatches, c.name)
		for _, p := range c.bad {
			testkit.Eventually(t, 20*time.Second, c.name+": "+p+" deleted", func() bool { _, err := os.Stat(p); return os.IsNotExist(err) })
		}
	}
	ps := b.st.PrefetchController().Stats()
	assert.Equal(t, ps.ChunksRejected[0], mismatches) // the truncated file is the fs adapter's miss
	testkit.Eventually(t, 20*time.Second, "rejected objects deleted", func() bool {
		return b.st.PrefetchController().Stats().RejectedDeleted[0] == mismatches
	})
	assert.Equal(t, b.stat(t, "kvshim_l2_prefetch_key_mismatches_total{adapter=fs}"), float64(mismatches))
	assert.Equal(t, b.stat(t, "kvshim_l2_prefetch_chunks_total{adapter=fs,result=rejected}"), float64(mismatches))
	assert.Equal(t, b.stat(t, "kvshim_l2_prefetch_rejected_deletes_total{adapter=fs,result=ok}"), float64(mismatches))
	// The other prompt's and the other namespace's own objects are intact.
	id, n := b.lookup(t, world, false, other)
	assert.Equal(t, n, uint32(4))
	b.check(t, id, world, false, other, n)
	b.close(t)

	// 3. Saved again, the right bytes are stored (stores skip only keys
	// that exist) and served after the next restart.
	c := newEnv(t, 8, nil, server.Options{}, cfg)
	for _, x := range cases {
		for r := range uint32(world) {
			c.put(t, r, x.hs)
		}
		c.flush(t)
	}
	c.close(t)
	d := newEnv(t, 8, nil, server.Options{}, cfg)
	for _, x := range cases {
		id, n := d.lookup(t, world, false, x.hs)
		assert.Equal(t, n, uint32(4), x.name)
		d.check(t, id, world, false, x.hs, n)
	}
	assert.Equal(t, d.st.PrefetchController().Stats().ChunksRejected[0], int64(0))
}

// A fill checks the payload checksum in the object header too, whatever
// the adapter checks itself: a payload changed under an intact header and
// a valid fs trailer (rewritten by hand) is rejected and deleted.
func TestFillRejectsBadPayloadChecksum(t *testing.T) {
	dir := t.TempDir()
	cfg := faultConfig(dir)
	hs := hashes("payload", 3)
	a := newEnv(t, 4, nil, server.Options{}, cfg)
	a.put(t, 0, hs)
	a.flush(t)
	a.close(t)
	// Rewrite chunk 1's object with one payload byte changed, through the
	// fs backend (a correct trailer for the changed bytes).
	be, err := fs.Open(fs.Config{BasePath: dir})
	assert.NilError(t, err)
	obj := pattern(hs[1], 0)
	obj[len(obj)-1] ^= 0x40
	assert.NilError(t, os.Remove(be.Path(tier.Key(ns1, 0, hs[1]))))
	b := newEnv(t, 4, func(c *server.Config) { c.L2StorePolicy = tier.PolicyNone }, server.Options{}, cfg)
	ad := b.st.L2Adapters()[0]
	st := ad.Store(t.Context(), []kv.Key{tier.Key(ns1, 0, hs[1])}, [][]byte{obj})
	<-st.Done()
	assert.Assert(t, st.Results()[0].OK(), "%v", st.Results()[0].Err)
	id, n := b.lookup(t, 1, false, hs)
	assert.Equal(t, n, uint32(1))
	b.check(t, id, 1, false, hs, n)
	ps := b.st.PrefetchController().Stats()
	assert.Equal(t, ps.ChunksRejected[0], int64(1))
	assert.Equal(t, ps.KeyMismatches[0], int64(0))
	testkit.Eventually(t, 20*time.Second, "corrupt object deleted", func() bool {
		_, err := os.Stat(be.Path(tier.Key(ns1, 0, hs[1])))
		return os.IsNotExist(err)
	})
}
