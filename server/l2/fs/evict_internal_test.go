package fs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

// The eviction's delete against other servers' changes of the same name,
// driven step by step (no background pass runs: the evictor is not
// started).

func testEvictor(t *testing.T) (*Backend, *evictor) {
	t.Helper()
	b, err := Open(Config{BasePath: t.TempDir()})
	assert.NilError(t, err)
	t.Cleanup(func() { b.Close() })
	e := newEvictor(b, Config{MaxBytes: 1 << 30, TouchInterval: -1})
	return b, e
}

func testKey(i int) kv.Key {
	k := kv.Key{Rank: 1}
	k.Namespace[0], k.Hash[0], k.Hash[5] = 0x3c, byte(i), byte(i>>8)
	return k
}

// put writes an object as a store would (through another backend: another
// server), returning its file's info.
func put(t *testing.T, b *Backend, k kv.Key, fill byte) os.FileInfo {
	t.Helper()
	p := make([]byte, 1000)
	for i := range p {
		p[i] = fill
	}
	assert.NilError(t, b.store(context.Background(), k, p))
	st, err := os.Stat(b.Path(k))
	assert.NilError(t, err)
	return st
}

// replace publishes a new file (a new inode) under k's name, as another
// server healing a broken file does (rename over it).
func replace(t *testing.T, b *Backend, k kv.Key) os.FileInfo {
	t.Helper()
	other, err := Open(Config{BasePath: t.TempDir()})
	assert.NilError(t, err)
	defer other.Close()
	put(t, other, k, 0xee)
	assert.NilError(t, os.Rename(other.Path(k), b.Path(k)))
	st, err := os.Stat(b.Path(k))
	assert.NilError(t, err)
	return st
}

func scanOne(t *testing.T, e *evictor) cand {
	t.Helper()
	assert.Assert(t, e.scan(context.Background()))
	assert.Equal(t, len(e.cands), 1)
	return e.cands[0]
}

func noneAside(t *testing.T, b *Backend, k kv.Key) {
	t.Helper()
	ents, err := os.ReadDir(filepath.Dir(b.Path(k)))
	assert.NilError(t, err)
	for _, d := range ents {
		assert.Assert(t, !strings.HasPrefix(d.Name(), evictPrefix), "left aside: %s", d.Name())
	}
}

func TestEvictRemovesTheScannedFile(t *testing.T) {
	b, e := testEvictor(t)
	k := testKey(1)
	put(t, b, k, 1)
	c := scanOne(t, e)
	assert.Equal(t, c.size, int64(1000+trailerSize))
	assert.Equal(t, e.usage(), c.size)
	assert.Equal(t, e.remove(c), c.size)
	_, err := os.Stat(b.Path(k))
	assert.Assert(t, errors.Is(err, os.ErrNotExist))
	noneAside(t, b, k)
	// Gone already (another server evicted it): freed, nothing to do.
	assert.Equal(t, e.remove(c), c.size)
}

// A file replaced (another inode) or touched by a hit (another mtime)
// after the scan is not removed.
func TestEvictSkipsFilesChangedSinceTheScan(t *testing.T) {
	b, e := testEvictor(t)
	k := testKey(2)
	put(t, b, k, 2)
	c := scanOne(t, e)
	now := replace(t, b, k)
	assert.Equal(t, e.remove(c), int64(0))
	cur, err := os.Stat(b.Path(k))
	assert.NilError(t, err)
	assert.Assert(t, os.SameFile(cur, now))

	c = scanOne(t, e)
	later := time.Unix(0, c.mtime).Add(time.Second)
	assert.NilError(t, os.Chtimes(b.Path(k), later, later))
	assert.Equal(t, e.remove(c), int64(0))
	cur, err = os.Stat(b.Path(k))
	assert.NilError(t, err)
	assert.Assert(t, os.SameFile(cur, now))
	assert.Equal(t, e.skipped.Load(), int64(2))
}

// The race the rename guards: between the evictor's check and its rename
// another server publishes a new file under the name, or touches it. The
// file moved aside is not the one checked: it is put back, never removed.
func TestEvictPutsBackAFileChangedDuringTheDelete(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, b *Backend, k kv.Key) os.FileInfo
	}{
		{"replaced", replace},
		{"touched", func(t *testing.T, b *Backend, k kv.Key) os.FileInfo {
			later := time.Now().Add(time.Minute)
			assert.NilError(t, os.Chtimes(b.Path(k), later, later))
			st, err := os.Stat(b.Path(k))
			assert.NilError(t, err)
			return st
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, e := testEvictor(t)
			k := testKey(3)
			put(t, b, k, 3)
			c := scanOne(t, e)
			var now os.FileInfo
			testHookBeforeAside = func(string) { now = tc.change(t, b, k) }
			defer func() { testHookBeforeAside = nil }()
			assert.Equal(t, e.remove(c), int64(0))
			cur, err := os.Stat(b.Path(k))
			assert.NilError(t, err, "the changed file was removed")
			assert.Assert(t, os.SameFile(cur, now))
			assert.Equal(t, cur.ModTime(), now.ModTime())
			noneAside(t, b, k)
		})
	}
}

// A held key (this server's lookup found it) is skipped; the hold ends
// with its release or after holdTTL.
func TestEvictSkipsHeldKeys(t *testing.T) {
	b, e := testEvictor(t)
	k := testKey(4)
	put(t, b, k, 4)
	scanOne(t, e)
	e.hold(k)
	e.hold(k)
	assert.Equal(t, e.evictTo(context.Background(), 0), int64(0))
	assert.Assert(t, e.held(k))
	e.release([]kv.Key{k})
	assert.Assert(t, e.held(k))
	e.release([]kv.Key{k})
	assert.Assert(t, !e.held(k))
	e.hold(k)
	e.holdMu.Lock()
	e.holds[k] = hold{n: 1, until: time.Now().Add(-time.Second)}
	e.holdMu.Unlock()
	scanOne(t, e)
	assert.Equal(t, e.evictTo(context.Background(), 0), int64(1000+trailerSize))
}

// A scan removes what an evictor that died left aside (after staleEvict),
// and counts only object files in their shard directories.
func TestScanCountsObjectsOnly(t *testing.T) {
	b, e := testEvictor(t)
	k := testKey(5)
	put(t, b, k, 5)
	dir := filepath.Dir(b.Path(k))
	aside := filepath.Join(dir, evictPrefix+k.String()+".1.dead")
	assert.NilError(t, os.WriteFile(aside, make([]byte, 5000), 0o600))
	assert.NilError(t, os.WriteFile(filepath.Join(dir, ".tmp."+k.String()+".1.live"), make([]byte, 7000), 0o600))
	assert.NilError(t, os.WriteFile(filepath.Join(b.base, "notes.kv"), make([]byte, 9000), 0o600))
	misplaced := filepath.Join(b.base, "00", "00", testKey(6).String()+suffix)
	assert.NilError(t, os.MkdirAll(filepath.Dir(misplaced), 0o700))
	assert.NilError(t, os.WriteFile(misplaced, make([]byte, 11000), 0o600))
	scanOne(t, e)
	assert.Equal(t, e.usage(), int64(1000+trailerSize))
	_, err := os.Stat(aside)
	assert.NilError(t, err, "a file aside younger than staleEvict was removed")
	staleEvict = 0
	defer func() { staleEvict = time.Minute }()
	scanOne(t, e)
	_, err = os.Stat(aside)
	assert.Assert(t, errors.Is(err, os.ErrNotExist))
}
