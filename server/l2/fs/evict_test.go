package fs_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/l2/l2test"
)

// Capacity: max_bytes with LRU eviction (doc.go, "Capacity").

const (
	objPayload = 8 << 10
	objFile    = objPayload + 16 // the trailer
)

// openAtDir opens an fs adapter on dir (another "server" when called twice).
func openAtDir(t *testing.T, dir, extra string) (*l2.Adapter, *fs.Backend) {
	t.Helper()
	a, err := l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q,"num_workers":2%s}`, dir, extra),
		l2.Options{Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.DiscardHandler)})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, a.Close()) })
	b := a.Backend().(*fs.Backend)
	// Stores before the first scan has ended are not held back: start
	// from a known usage.
	assert.NilError(t, b.Rescan(context.Background()))
	return a, b
}

// samples are a's unlabelled numbers, by name, as STATS and /metrics show
// them (Adapter.Samples: the backend's l2.Sampler included), read once.
func samples(a *l2.Adapter) map[string]float64 {
	m := map[string]float64{}
	for _, s := range a.Samples() {
		if s.Labels == "adapter="+a.Name() {
			m[s.Name] = s.Value
		}
	}
	return m
}

// walkUsage is what the directory holds: the bytes and number of object
// files, and the bytes of temporary files (writes in flight, evictions
// under way).
func walkUsage(t *testing.T, dir string) (objects, tmp int64, n int) {
	t.Helper()
	err := filepath.WalkDir(dir, func(path string, d iofs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil // removed meanwhile
		}
		switch {
		case strings.HasSuffix(d.Name(), ".kv") && !strings.HasPrefix(d.Name(), "."):
			objects += info.Size()
			n++
		case strings.HasPrefix(d.Name(), ".tmp."), strings.HasPrefix(d.Name(), ".evict."):
			tmp += info.Size()
		}
		return nil
	})
	assert.NilError(t, err)
	return objects, tmp, n
}

func present(t *testing.T, b *fs.Backend, k kv.Key) bool {
	_, err := os.Stat(b.Path(k))
	if errors.Is(err, os.ErrNotExist) {
		return false
	}
	assert.NilError(t, err)
	return true
}

func storeAll(t *testing.T, a *l2.Adapter, keys []kv.Key, seed int) {
	t.Helper()
	bufs := make([][]byte, len(keys))
	for i := range keys {
		bufs[i] = l2test.Payload(seed+i, objPayload)
	}
	for i, r := range l2test.Wait(t, a.Store(context.Background(), keys, bufs)) {
		assert.Equal(t, r.Status, l2.StatusOK, "key %d: %v", i, r.Err)
	}
}

// hit loads k (as a prefetch does: lookup with a hold, load, release) and
// checks its bytes.
func hit(t *testing.T, a *l2.Adapter, k kv.Key, seed int) {
	t.Helper()
	ctx := context.Background()
	look := a.LookupAndHold(ctx, []kv.Key{k})
	l2test.Wait(t, look)
	assert.Equal(t, look.Bitmap().Count(), 1, "%s is not in L2", k)
	dst := make([]byte, objPayload)
	res := l2test.Wait(t, a.Load(ctx, []kv.Key{k}, [][]byte{dst}))
	a.Release([]kv.Key{k})
	assert.Equal(t, res[0].Status, l2.StatusOK, "%v", res[0].Err)
	assert.Assert(t, bytes.Equal(dst, l2test.Payload(seed, objPayload)))
}

func keyRange(from, n int) []kv.Key {
	ks := make([]kv.Key, n)
	for i := range ks {
		ks[i] = l2test.Key(from + i)
	}
	return ks
}

func TestCapacityConfig(t *testing.T) {
	dir := t.TempDir()
	for _, ok := range []string{
		`,"max_bytes":1048576`,
		`,"max_bytes":1048576,"eviction":{"eviction_policy":"LRU"}`,
		`,"max_bytes":1048576,"eviction":{"eviction_policy":"lru"},"scan_interval_s":5,"touch_interval_ms":0`,
		`,"eviction":null`,
	} {
		a, err := l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q%s}`, dir, ok), l2.Options{})
		assert.NilError(t, err, ok)
		assert.NilError(t, a.Close())
	}
	for _, tc := range []struct{ extra, key, why string }{
		{`,"max_bytes":1048576,"eviction":{"eviction_policy":"LFU"}`, `"eviction.eviction_policy"`, "not implemented"},
		{`,"max_bytes":1048576,"eviction":{"eviction_policy":"LRU","eviction_ratio":0.1}`, `"eviction.eviction_ratio"`, "unknown"},
		{`,"max_bytes":1048576,"eviction":"LRU"`, `"eviction"`, "want an object"},
		{`,"max_bytes":1048576,"eviction":{"eviction_policy":1}`, `"eviction.eviction_policy"`, "want a string"},
		{`,"eviction":{"eviction_policy":"LRU"}`, `"eviction"`, `without "max_bytes"`},
		{`,"scan_interval_s":5`, `"scan_interval_s"`, `without "max_bytes"`},
		{`,"touch_interval_ms":0`, `"touch_interval_ms"`, `without "max_bytes"`},
		{`,"max_bytes":0`, `"max_bytes"`, "want 1.."},
		{`,"max_bytes":"10GiB"`, `"max_bytes"`, "want an integer"},
		{`,"max_bytes":1048576,"scan_interval_s":0`, `"scan_interval_s"`, "want 1.."},
	} {
		_, err := l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q%s}`, dir, tc.extra), l2.Options{})
		assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%s: %v", tc.extra, err)
		assert.Assert(t, is.Contains(err.Error(), tc.key), tc.extra)
		assert.Assert(t, is.Contains(err.Error(), tc.why), tc.extra)
	}
}

// A stream of stores into a directory with room for 12 objects: after
// every batch the object files stay within max_bytes, the object used
// between batches (a load touches it) stays, the oldest unused ones go.
func TestMaxBytesKeepsRecentlyUsed(t *testing.T) {
	dir := t.TempDir()
	const room = 12
	a, b := openAtDir(t, dir, fmt.Sprintf(`,"max_bytes":%d,"touch_interval_ms":0,"eviction":{"eviction_policy":"LRU"}`, room*objFile))
	hot := l2test.Key(1000)
	storeAll(t, a, []kv.Key{hot}, 1000)
	for batch := range 20 {
		time.Sleep(2 * time.Millisecond) // mtimes from a coarse clock: keep batches apart
		storeAll(t, a, keyRange(batch*4, 4), batch*4)
		objects, _, _ := walkUsage(t, dir)
		assert.Assert(t, objects <= room*objFile, "batch %d: %d bytes of objects, max_bytes %d", batch, objects, room*objFile)
		hit(t, a, hot, 1000)
	}
	st := b.EvictStats()
	assert.Assert(t, st.Evicted >= 80+1-room, "%+v", st)
	assert.Equal(t, st.Full, int64(0))
	assert.Equal(t, st.TouchErrors, int64(0))
	// The same numbers are the adapter's samples (nothing evicts between
	// the two reads: no store runs and the next periodic scan is a minute
	// away).
	m := samples(a)
	assert.Equal(t, m["kvshim_l2_fs_evicted_objects_total"], float64(st.Evicted))
	assert.Equal(t, m["kvshim_l2_fs_evicted_bytes_total"], float64(st.Evicted*objFile))
	assert.Equal(t, m["kvshim_l2_fs_max_bytes"], float64(room*objFile))
	assert.Equal(t, m["kvshim_l2_fs_used_bytes"], float64(st.Used))
	assert.Equal(t, m["kvshim_l2_fs_scans_total"], float64(st.Scans))
	assert.Equal(t, m["kvshim_l2_fs_evict_skipped_total"], float64(st.Skipped))
	assert.Equal(t, m["kvshim_l2_fs_full_stores_total"], 0.0)
	_, ok := m["kvshim_l2_fs_touch_errors_total"]
	assert.Assert(t, ok && m["kvshim_l2_fs_touch_errors_total"] == 0, "%v", m)
	assert.Assert(t, present(t, b, hot), "the object used after every batch was evicted")
	assert.Assert(t, !present(t, b, l2test.Key(0)), "the oldest unused object was kept")
	for _, k := range keyRange(76, 4) { // the last batch
		assert.Assert(t, present(t, b, k))
	}
	objects, _, n := walkUsage(t, dir)
	assert.Equal(t, objects, int64(n)*objFile)
	// The estimate never lags (a file published while a scan walked may be
	// counted twice until the next scan); a quiet scan is exact.
	assert.Assert(t, st.Used >= objects, "estimate %d, files %d", st.Used, objects)
	assert.NilError(t, b.Rescan(context.Background()))
	assert.Equal(t, b.EvictStats().Used, objects)
	after := samples(a)
	assert.Equal(t, after["kvshim_l2_fs_used_bytes"], float64(objects))
	assert.Assert(t, after["kvshim_l2_fs_scans_total"] > m["kvshim_l2_fs_scans_total"], "a rescan is not counted")
}

// A hit sets the object file's mtime (the recency eviction orders by),
// at most once per touch_interval_ms.
func TestRecencyIsTheTouchedMtime(t *testing.T) {
	a, b := openAtDir(t, t.TempDir(), fmt.Sprintf(`,"max_bytes":%d,"touch_interval_ms":0`, 100*objFile))
	k := l2test.Key(7)
	storeAll(t, a, []kv.Key{k}, 7)
	past := time.Now().Add(-time.Hour)
	assert.NilError(t, os.Chtimes(b.Path(k), past, past))
	hit(t, a, k, 7)
	st, err := os.Stat(b.Path(k))
	assert.NilError(t, err)
	assert.Assert(t, time.Since(st.ModTime()) < time.Minute, "a hit did not touch the file: mtime %v", st.ModTime())

	// Rate-limited: a file touched less than touch_interval_ms ago is not
	// touched again.
	a2, b2 := openAtDir(t, t.TempDir(), fmt.Sprintf(`,"max_bytes":%d,"touch_interval_ms":3600000`, 100*objFile))
	storeAll(t, a2, []kv.Key{k}, 7)
	recent := time.Now().Add(-time.Minute)
	assert.NilError(t, os.Chtimes(b2.Path(k), recent, recent))
	hit(t, a2, k, 7)
	st, err = os.Stat(b2.Path(k))
	assert.NilError(t, err)
	assert.Equal(t, st.ModTime().Unix(), recent.Unix())
	// A store of an object already present is a use too.
	assert.NilError(t, os.Chtimes(b.Path(k), past, past))
	storeAll(t, a, []kv.Key{k}, 7)
	st, err = os.Stat(b.Path(k))
	assert.NilError(t, err)
	assert.Assert(t, time.Since(st.ModTime()) < time.Minute)
}

// The usage and the recency order are rebuilt from the files: a server
// restarted with a smaller max_bytes evicts down to it at once, keeping
// the objects with the newest mtimes (last used before the restart).
func TestCapacitySurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	a, _ := openAtDir(t, dir, "")
	storeAll(t, a, keyRange(0, 30), 0)
	assert.NilError(t, a.Close())
	// A previous run's recency: object i was last used i minutes after
	// the first, and object 3 last of all.
	b0, err := fs.Open(fs.Config{BasePath: dir})
	assert.NilError(t, err)
	t0 := time.Now().Add(-time.Hour)
	for i := range 30 {
		at := t0.Add(time.Duration(i) * time.Minute)
		if i == 3 {
			at = t0.Add(50 * time.Minute)
		}
		assert.NilError(t, os.Chtimes(b0.Path(l2test.Key(i)), at, at))
	}
	assert.NilError(t, b0.Close())

	const room = 10
	a, err = l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q,"max_bytes":%d}`, dir, room*objFile), l2.Options{Logger: slog.New(slog.DiscardHandler)})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, a.Close()) })
	b := a.Backend().(*fs.Backend)
	// The first scan, at open, evicts: no store or rescan is needed.
	testkit.Eventually(t, 20*time.Second, "the first scan's eviction", func() bool { return b.EvictStats().Evicted == 21 })
	// A scan keeps at most half of max_bytes of candidates: evicting 21
	// objects of 30 took several.
	assert.Equal(t, b.EvictStats().Evicted, int64(21))
	objects, _, n := walkUsage(t, dir)
	assert.Assert(t, objects <= room*objFile)
	assert.Equal(t, n, 9, "evicted down to 90%% of max_bytes")
	assert.Assert(t, present(t, b, l2test.Key(3)), "the most recently used object was evicted")
	for i := 22; i < 30; i++ {
		assert.Assert(t, present(t, b, l2test.Key(i)), "object %d", i)
	}
	for i := range 22 {
		if i != 3 {
			assert.Assert(t, !present(t, b, l2test.Key(i)), "object %d was kept", i)
		}
	}
}

// An object larger than max_bytes is refused; so is a store when every
// object is held by this server's lookups (nothing evictable): ErrFull,
// at once, not a hang.
func TestFullStoresFail(t *testing.T) {
	a, b := openAtDir(t, t.TempDir(), fmt.Sprintf(`,"max_bytes":%d`, 4*objFile))
	ctx := context.Background()
	assert.Equal(t, samples(a)["kvshim_l2_fs_full_stores_total"], 0.0)
	res := l2test.Wait(t, a.Store(ctx, []kv.Key{l2test.Key(99)}, [][]byte{l2test.Payload(99, 4*objFile)}))
	assert.Equal(t, res[0].Status, l2.StatusFailed)
	assert.Assert(t, errors.Is(res[0].Err, fs.ErrFull), "%v", res[0].Err)
	assert.Equal(t, samples(a)["kvshim_l2_fs_full_stores_total"], 1.0)

	held := keyRange(0, 4)
	storeAll(t, a, held, 0)
	l2test.Wait(t, a.LookupAndHold(ctx, held))
	start := time.Now()
	res = l2test.Wait(t, a.Store(ctx, []kv.Key{l2test.Key(5)}, [][]byte{l2test.Payload(5, objPayload)}))
	assert.Equal(t, res[0].Status, l2.StatusFailed)
	assert.Assert(t, errors.Is(res[0].Err, fs.ErrFull), "%v", res[0].Err)
	assert.Assert(t, time.Since(start) < 5*time.Second)
	for _, k := range held {
		assert.Assert(t, present(t, b, k), "a held object was evicted")
	}
	// Released, they can go (one, to make room for the new one).
	a.Release(held)
	storeAll(t, a, []kv.Key{l2test.Key(5)}, 5)
	assert.Assert(t, present(t, b, l2test.Key(5)))
	kept := 0
	for _, k := range held {
		if present(t, b, k) {
			kept++
		}
	}
	assert.Equal(t, kept, 3)
	assert.Assert(t, b.EvictStats().Full >= 2)
	m := samples(a)
	assert.Equal(t, m["kvshim_l2_fs_full_stores_total"], float64(b.EvictStats().Full))
	assert.Assert(t, m["kvshim_l2_fs_evicted_objects_total"] >= 1, "%v", m)
}

// Two servers share one directory with one max_bytes, each with its own
// estimate: A uses its hot object between rounds, both store. The
// directory never holds more than twice max_bytes (each server's own
// estimate stays under it; the other's writes show at its next scan),
// every scan brings it under max_bytes, and A's hits protect its object
// from B's eviction (the mtime is the shared recency).
func TestSharedDirectoryTwoServers(t *testing.T) {
	dir := t.TempDir()
	const room = 16
	cfg := fmt.Sprintf(`,"max_bytes":%d,"touch_interval_ms":0`, room*objFile)
	a, ba := openAtDir(t, dir, cfg)
	b, bb := openAtDir(t, dir, cfg)
	ctx := context.Background()
	hot := l2test.Key(5000)
	storeAll(t, a, []kv.Key{hot}, 5000)
	for round := range 12 {
		time.Sleep(2 * time.Millisecond)
		storeAll(t, a, keyRange(round*8, 4), round*8)
		storeAll(t, b, keyRange(round*8+4, 4), round*8+4)
		objects, _, _ := walkUsage(t, dir)
		assert.Assert(t, objects <= 2*room*objFile, "round %d: %d bytes", round, objects)
		hit(t, a, hot, 5000)
		if round%3 == 2 {
			assert.NilError(t, bb.Rescan(ctx))
			objects, _, _ := walkUsage(t, dir)
			assert.Assert(t, objects <= room*objFile, "round %d, after B's scan: %d bytes", round, objects)
		}
	}
	assert.NilError(t, ba.Rescan(ctx))
	assert.NilError(t, bb.Rescan(ctx))
	objects, _, _ := walkUsage(t, dir)
	assert.Assert(t, objects <= room*objFile)
	assert.Assert(t, present(t, ba, hot), "B evicted the object A keeps using")
	assert.Assert(t, !present(t, ba, l2test.Key(0)) && !present(t, ba, l2test.Key(4)))
	assert.Assert(t, ba.EvictStats().Evicted > 0 && bb.EvictStats().Evicted > 0, "%+v %+v", ba.EvictStats(), bb.EvictStats())
}
