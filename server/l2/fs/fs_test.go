package fs_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/l2/l2test"
)

func open(t testing.TB, extra string) (*l2.Adapter, *fs.Backend, string) {
	t.Helper()
	dir := t.TempDir()
	a := l2test.Open(t, fmt.Sprintf(`{"type":"fs","base_path":%q,"num_workers":2,
		"per_op_workers":{"lookup":1}%s}`, dir, extra))
	return a, a.Backend().(*fs.Backend), dir
}

// breakShard makes k's shard directory a plain file: storing k fails, and
// only k (the contract's keys have a shard each).
func breakShard(t testing.TB, a *l2.Adapter, k kv.Key) {
	t.Helper()
	shard := filepath.Dir(a.Backend().(*fs.Backend).Path(k))
	assert.NilError(t, os.MkdirAll(filepath.Dir(shard), 0o755))
	assert.NilError(t, os.WriteFile(shard, []byte("not a dir"), 0o644))
}

// flipPayloadByte damages k's object in place: a payload byte, which only
// the checksum can tell.
func flipPayloadByte(t testing.TB, a *l2.Adapter, k kv.Key) {
	t.Helper()
	flip(t, a.Backend().(*fs.Backend).Path(k), 10)
}

func flip(t testing.TB, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	assert.NilError(t, err)
	var c [1]byte
	_, err = f.ReadAt(c[:], off)
	assert.NilError(t, err)
	c[0] ^= 0x40
	_, err = f.WriteAt(c[:], off)
	assert.NilError(t, err)
	assert.NilError(t, f.Close())
}

func TestContract(t *testing.T) {
	for _, tc := range []struct{ name, extra string }{
		{"plain", ""},
		{"fsync and max_bytes", `,"fsync":true,"max_bytes":1073741824`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l2test.Run(t, l2test.Target{
				Open: func(t testing.TB) *l2.Adapter {
					a, _, _ := open(t, tc.extra)
					return a
				},
				BreakStore: breakShard,
				Corrupt:    flipPayloadByte,
			})
		})
	}
}

func TestCorruptAndTruncatedAreMissesAndDeleted(t *testing.T) {
	a, b, _ := open(t, "")
	ctx := context.Background()
	keys := []kv.Key{l2test.Key(1), l2test.Key(2), l2test.Key(3), l2test.Key(4)}
	src := [][]byte{l2test.Payload(1, 4096), l2test.Payload(2, 4096), l2test.Payload(3, 4096), l2test.Payload(4, 4096)}
	l2test.Wait(t, a.Store(ctx, keys, src))

	flip(t, b.Path(keys[0]), 100)                          // payload byte
	assert.NilError(t, os.Truncate(b.Path(keys[1]), 4096)) // trailer cut off
	flip(t, b.Path(keys[2]), 4096+9)                       // trailer length
	dst := [][]byte{make([]byte, 4096), make([]byte, 4096), make([]byte, 4096), make([]byte, 4096)}
	res := l2test.Wait(t, a.Load(ctx, keys, dst))
	for i := 0; i < 3; i++ {
		assert.Equal(t, res[i].Status, l2.StatusMiss, "key %d", i)
		assert.Assert(t, errors.Is(res[i].Err, fs.ErrCorrupt), "%v", res[i].Err)
		_, err := os.Stat(b.Path(keys[i]))
		assert.Assert(t, errors.Is(err, os.ErrNotExist), "corrupt file %d kept", i)
	}
	assert.Equal(t, res[3].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(dst[3], src[3]))
}

// Many writers of the same key: all succeed, one file, no temporaries left.
func TestConcurrentWritersPublishOnce(t *testing.T) {
	a, b, _ := open(t, "")
	k := l2test.Key(11)
	src := l2test.Payload(11, 64<<10)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, r := range l2test.Wait(t, a.Store(context.Background(), []kv.Key{k, k}, [][]byte{src, src})) {
				assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
			}
		}()
	}
	wg.Wait()
	ents, err := os.ReadDir(filepath.Dir(b.Path(k)))
	assert.NilError(t, err)
	assert.Equal(t, len(ents), 1)
	assert.Assert(t, !strings.HasPrefix(ents[0].Name(), ".tmp."))
	dst := make([]byte, len(src))
	assert.Equal(t, l2test.Wait(t, a.Load(context.Background(), []kv.Key{k}, [][]byte{dst}))[0].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(dst, src))
}

func TestConfigRefused(t *testing.T) {
	for _, tc := range []struct{ json, key string }{
		{`{"type":"fs"}`, `"base_path"`},
		{`{"type":"fs","base_path":"/tmp/x","fsynk":true}`, `"fsynk"`},
		{`{"type":"fs","base_path":3}`, `"base_path"`},
		{`{"type":"fs","base_path":"/tmp/x","dir_mode":4096}`, `"dir_mode"`},
	} {
		_, err := l2.OpenJSON(tc.json, l2.Options{})
		assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%s: %v", tc.json, err)
		assert.Assert(t, is.Contains(err.Error(), tc.key))
	}
}

func TestSweepTmp(t *testing.T) {
	_, b, dir := open(t, "")
	old := filepath.Join(dir, "ab", "cd", ".tmp.x.1.dead")
	young := filepath.Join(dir, "ab", "cd", ".tmp.y.1.live")
	assert.NilError(t, os.MkdirAll(filepath.Dir(old), 0o755))
	assert.NilError(t, os.WriteFile(old, []byte("x"), 0o644))
	assert.NilError(t, os.WriteFile(young, []byte("y"), 0o644))
	past := time.Now().Add(-2 * time.Hour)
	assert.NilError(t, os.Chtimes(old, past, past))
	n, err := b.SweepTmp(context.Background(), time.Hour)
	assert.NilError(t, err)
	assert.Equal(t, n, 1)
	_, err = os.Stat(young)
	assert.NilError(t, err)
}
