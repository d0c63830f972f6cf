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

	"github.com/prometheus/client_golang/prometheus"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/fs"
)

func open(t *testing.T, extra string) (*l2.Adapter, *fs.Backend, string) {
	t.Helper()
	dir := t.TempDir()
	a, err := l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q,"num_workers":2,
		"per_op_workers":{"lookup":1}%s}`, dir, extra), l2.Options{Registerer: prometheus.NewRegistry()})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, a.Close()) })
	return a, a.Backend().(*fs.Backend), dir
}

func key(i int) l2.Key {
	k := l2.Key{Rank: uint32(i % 3)}
	k.Namespace[0] = 0x5a
	k.Hash[0], k.Hash[1], k.Hash[31] = byte(i*37), byte(i), byte(i>>8)
	return k
}

func payload(i, n int) []byte {
	b := make([]byte, n)
	for j := range b {
		b[j] = byte(i*131 + j*7)
	}
	return b
}

func wait(t *testing.T, task *l2.Task) []l2.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := task.Wait(ctx)
	assert.NilError(t, err)
	return res
}

func TestRoundTrip(t *testing.T) {
	a, _, _ := open(t, `,"fsync":true`)
	const n = 12
	keys := make([]l2.Key, n)
	src := make([][]byte, n)
	for i := range keys {
		keys[i], src[i] = key(i), payload(i, 1000+i)
	}
	ctx := context.Background()
	for _, r := range wait(t, a.Store(ctx, keys[:8], src[:8])) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	// storing again is success (immutable objects)
	assert.Equal(t, wait(t, a.Store(ctx, keys[:2], src[:2]))[1].Status, l2.StatusOK)

	look := a.LookupAndHold(ctx, keys)
	wait(t, look)
	assert.Equal(t, look.Bitmap().Prefix(), 8)
	assert.Equal(t, look.Bitmap().Count(), 8)

	dst := make([][]byte, n)
	for i := range dst {
		dst[i] = make([]byte, len(src[i]))
	}
	ld := a.Load(ctx, keys, dst)
	seen := 0
	for ev := range ld.Events() {
		seen++
		if ev.Index < 8 {
			assert.Equal(t, ev.Status, l2.StatusOK, "%v", ev.Err)
			assert.Assert(t, bytes.Equal(dst[ev.Index], src[ev.Index]))
		} else {
			assert.Equal(t, ev.Status, l2.StatusMiss)
		}
	}
	assert.Equal(t, seen, n)
	a.Release(keys)
	for _, r := range wait(t, a.Delete(ctx, keys[:10])) {
		assert.Assert(t, r.Status != l2.StatusFailed, "%v", r.Err)
	}
	assert.Equal(t, l2.BitmapOf(wait(t, a.LookupAndHold(ctx, keys))).Count(), 0)
}

func TestCorruptAndTruncatedAreMissesAndDeleted(t *testing.T) {
	a, b, _ := open(t, "")
	ctx := context.Background()
	keys := []l2.Key{key(1), key(2), key(3), key(4)}
	src := [][]byte{payload(1, 4096), payload(2, 4096), payload(3, 4096), payload(4, 4096)}
	wait(t, a.Store(ctx, keys, src))

	flip := func(path string, off int64) {
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
	flip(b.Path(keys[0]), 100)                             // payload byte
	assert.NilError(t, os.Truncate(b.Path(keys[1]), 4096)) // trailer cut off
	flip(b.Path(keys[2]), 4096+9)                          // trailer length
	dst := [][]byte{make([]byte, 4096), make([]byte, 4096), make([]byte, 4096), make([]byte, 4096)}
	res := wait(t, a.Load(ctx, keys, dst))
	for i := 0; i < 3; i++ {
		assert.Equal(t, res[i].Status, l2.StatusMiss, "key %d", i)
		assert.Assert(t, errors.Is(res[i].Err, fs.ErrCorrupt), "%v", res[i].Err)
		_, err := os.Stat(b.Path(keys[i]))
		assert.Assert(t, errors.Is(err, os.ErrNotExist), "corrupt file %d kept", i)
	}
	assert.Equal(t, res[3].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(dst[3], src[3]))
}

func TestSizeMismatchFailsAndKeepsFile(t *testing.T) {
	a, b, _ := open(t, "")
	ctx := context.Background()
	k := key(9)
	wait(t, a.Store(ctx, []l2.Key{k}, [][]byte{payload(9, 512)}))
	res := wait(t, a.Load(ctx, []l2.Key{k}, [][]byte{make([]byte, 511)}))
	assert.Equal(t, res[0].Status, l2.StatusFailed)
	assert.Assert(t, errors.Is(res[0].Err, l2.ErrBufferSize))
	_, err := os.Stat(b.Path(k))
	assert.NilError(t, err)
}

// A key whose shard directory cannot be created fails alone; the rest of
// the batch is written.
func TestPartialBatchFailureNamesTheKey(t *testing.T) {
	a, b, _ := open(t, "")
	bad := key(5)
	shard := filepath.Dir(b.Path(bad))
	assert.NilError(t, os.MkdirAll(filepath.Dir(shard), 0o755))
	assert.NilError(t, os.WriteFile(shard, []byte("not a dir"), 0o644))
	keys := []l2.Key{key(1), key(2), bad, key(7)}
	src := [][]byte{payload(1, 64), payload(2, 64), payload(5, 64), payload(7, 64)}
	task := a.Store(context.Background(), keys, src)
	wait(t, task)
	assert.DeepEqual(t, task.Failed(), []int{2})
	assert.Assert(t, is.Contains(task.Results()[2].Err.Error(), bad.String()))
}

// Many writers of the same key: all succeed, one file, no temporaries left.
func TestConcurrentWritersPublishOnce(t *testing.T) {
	a, b, _ := open(t, "")
	k := key(11)
	src := payload(11, 64<<10)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, r := range wait(t, a.Store(context.Background(), []l2.Key{k, k}, [][]byte{src, src})) {
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
	assert.Equal(t, wait(t, a.Load(context.Background(), []l2.Key{k}, [][]byte{dst}))[0].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(dst, src))
}

func TestHeldKeyIsNotDeleted(t *testing.T) {
	a, b, _ := open(t, "")
	ctx := context.Background()
	k := key(3)
	wait(t, a.Store(ctx, []l2.Key{k}, [][]byte{payload(3, 10)}))
	wait(t, a.LookupAndHold(ctx, []l2.Key{k}))
	res := wait(t, a.Delete(ctx, []l2.Key{k}))
	assert.Assert(t, errors.Is(res[0].Err, l2.ErrHeld))
	_, err := os.Stat(b.Path(k))
	assert.NilError(t, err)
	a.Release([]l2.Key{k})
	assert.Equal(t, wait(t, a.Delete(ctx, []l2.Key{k}))[0].Status, l2.StatusOK)
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
