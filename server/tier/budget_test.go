package tier_test

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/l2/redis"
	"github.com/kvshim/kvshim/server/l2/redis/redisserver"
)

// L2 capacity through the real writer and prefetch controller: a stream
// of saves into an L2 far smaller than the stream.

const objFile = objSize + 16 // an fs object file: payload and trailer

// l2Bytes is what the fs directory holds, counted by inode (a file being
// published has two names for an instant): object files, and temporary
// or moved-aside ones (writes and evictions under way).
func l2Bytes(dir string) (objects, all int64) {
	seen := map[uint64]bool{}
	_ = filepath.WalkDir(dir, func(path string, d iofs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil // removed meanwhile
		}
		ino := info.Sys().(*syscall.Stat_t).Ino
		if seen[ino] {
			return nil
		}
		seen[ino] = true
		if !strings.HasPrefix(d.Name(), ".") {
			objects += info.Size()
		}
		all += info.Size()
		return nil
	})
	return objects, all
}

// lookupL2 clears L1 (so the chunks can only come from L2), looks hs up
// and, when all of them are found, checks their bytes.
func (e *env) lookupL2(t *testing.T, hs []kv.Hash) uint32 {
	t.Helper()
	_, err := e.st.Clear(e.sess)
	assert.NilError(t, err)
	id, n := e.lookup(t, 1, false, hs)
	if n > 0 {
		e.check(t, id, 1, false, hs, n)
	}
	return n
}

// scraped is the value /metrics shows for name{adapter=adapter} (the
// core's registry, gathered now); ok is false when it has no such series.
func scraped(t *testing.T, e *env, name, adapter string) (v float64, ok bool) {
	t.Helper()
	fams, err := e.st.Registry().Gather()
	assert.NilError(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) == 1 && m.GetLabel()[0].GetName() == "adapter" && m.GetLabel()[0].GetValue() == adapter {
				if c := m.GetCounter(); c != nil {
					return c.GetValue(), true
				}
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

// TestFSBudgetUnderStream: 164 objects saved into an fs L2 with room for
// 24. After every save the object files are within max_bytes, exactly.
// While the saves run, what the directory holds, the temporary files of
// the writes in flight included (the adapter counts a write from before
// its temporary file exists), is sampled: it must stay within max_bytes
// plus a stated slack of 4 objects, for the sampling walk only (it is not
// atomic: a file evicted after the walk counted it and one published
// before the walk reached its directory are both counted). The prefix
// used between saves (through L2: L1 is cleared first) always hits,
// byte-exact; the latest saves hit; the oldest unused prefix went.
func TestFSBudgetUnderStream(t *testing.T) {
	dir := t.TempDir()
	const room = 24
	const maxBytes = room * objFile
	const slack = 4 * objFile
	cfg := fmt.Sprintf(`{"type":"fs","base_path":%q,"num_workers":2,"max_bytes":%d,"touch_interval_ms":0,"eviction":{"eviction_policy":"LRU"}}`, dir, maxBytes)
	e := newEnv(t, 2, nil, server.Options{}, cfg)
	be := e.st.L2Adapters()[0].Backend().(*fs.Backend)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	assert.NilError(t, be.Rescan(ctx)) // the first scan has ended: stores are held to max_bytes

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var peak int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, all := l2Bytes(dir); all > peak {
				peak = all
			}
			time.Sleep(200 * time.Microsecond)
		}
	}()

	hot := hashes("budget hot", 4)
	e.put(t, 0, hot)
	e.flush(t)
	prefixes := make([][]kv.Hash, 40)
	for i := range prefixes {
		time.Sleep(2 * time.Millisecond) // file times come from a coarse clock
		prefixes[i] = hashes(fmt.Sprint("budget ", i), 4)
		e.put(t, 0, prefixes[i])
		e.flush(t)
		objects, _ := l2Bytes(dir)
		assert.Assert(t, objects <= maxBytes, "prefix %d: %d bytes of objects, max_bytes %d", i, objects, maxBytes)
		if i%2 == 1 {
			assert.Equal(t, e.lookupL2(t, hot), uint32(4), "prefix %d: the prefix in use was evicted", i)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("peak %d bytes (max_bytes %d + slack %d); %+v", peak, maxBytes, slack, be.EvictStats())
	assert.Assert(t, peak <= maxBytes+slack, "peak %d", peak)
	s := e.st.Writer().Stats()
	assert.Equal(t, s.Saved[0], int64(4*41))
	assert.Equal(t, s.Errors[0], int64(0))
	assert.Assert(t, be.EvictStats().Evicted >= 4*41-room)
	// The evictions are in STATS and on /metrics: the backend's numbers
	// are the adapter's samples (l2.Sampler). Nothing evicts now (no save
	// runs; the lookups below only read).
	evicted := float64(be.EvictStats().Evicted)
	assert.Equal(t, e.stat(t, "kvshim_l2_fs_evicted_objects_total{adapter=fs}"), evicted)
	assert.Equal(t, e.stat(t, "kvshim_l2_fs_evicted_bytes_total{adapter=fs}"), evicted*objFile)
	assert.Equal(t, e.stat(t, "kvshim_l2_fs_max_bytes{adapter=fs}"), float64(maxBytes))
	v, ok := scraped(t, e, "kvshim_l2_fs_evicted_objects_total", "fs")
	assert.Assert(t, ok, "no kvshim_l2_fs_evicted_objects_total{adapter=\"fs\"} on /metrics")
	assert.Equal(t, v, evicted)
	v, ok = scraped(t, e, "kvshim_l2_fs_used_bytes", "fs")
	assert.Assert(t, ok && v > 0 && v <= maxBytes, "kvshim_l2_fs_used_bytes %v %v", v, ok)
	for _, p := range prefixes[37:] {
		assert.Equal(t, e.lookupL2(t, p), uint32(4))
	}
	assert.Equal(t, e.lookupL2(t, prefixes[0]), uint32(0), "the oldest unused prefix is still in L2")
	assert.Equal(t, e.lookupL2(t, hot), uint32(4))
}

// TestRedisFullUnderStream: a Redis with a 2 MiB maxmemory and the
// noeviction policy, 10 MiB of saves through the writer. The
// saves Redis refuses are failed writes, counted; nothing hangs or
// retries; what Redis took is served to a restarted server.
func TestRedisFullUnderStream(t *testing.T) {
	rs, err := redisserver.Start(t.TempDir(), "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
	if errors.Is(err, redisserver.ErrNoBinary) {
		t.Skip(err.Error())
	}
	assert.NilError(t, err)
	t.Cleanup(rs.Kill)
	cfg := redisConfig(rs, `,"num_workers":2`)
	e := newEnv(t, 4, nil, server.Options{}, cfg)
	prefixes := make([][]kv.Hash, 40)
	for i := range prefixes {
		prefixes[i] = hashes(fmt.Sprint("full ", i), 4)
		e.put(t, 0, prefixes[i])
		e.flush(t)
	}
	s := e.st.Writer().Stats()
	rb := e.st.L2Adapters()[0].Backend().(*redis.Backend)
	t.Logf("saved %d, failed %d; %+v", s.Saved[0], s.Errors[0], rb.Stats())
	assert.Equal(t, s.Saved[0]+s.Errors[0], int64(160))
	assert.Assert(t, s.Saved[0] >= 4 && s.Errors[0] >= 100, "saved %d, failed %d", s.Saved[0], s.Errors[0])
	assert.Equal(t, e.stat(t, "kvshim_l2_store_errors_total{adapter=redis}"), float64(s.Errors[0]))
	assert.Equal(t, rb.Stats().OOM+rb.Stats().OOMSkipped, s.Errors[0])
	// The OOM answers are in STATS and on /metrics (l2.Sampler).
	oom, skipped := float64(rb.Stats().OOM), float64(rb.Stats().OOMSkipped)
	assert.Assert(t, oom >= 1)
	assert.Equal(t, e.stat(t, "kvshim_l2_redis_oom_total{adapter=redis}"), oom)
	assert.Equal(t, e.stat(t, "kvshim_l2_redis_oom_skipped_total{adapter=redis}"), skipped)
	v, ok := scraped(t, e, "kvshim_l2_redis_oom_total", "redis")
	assert.Assert(t, ok, "no kvshim_l2_redis_oom_total{adapter=\"redis\"} on /metrics")
	assert.Equal(t, v, oom)
	v, ok = scraped(t, e, "kvshim_l2_redis_oom_skipped_total", "redis")
	assert.Assert(t, ok)
	assert.Equal(t, v, skipped)
	assert.Equal(t, e.stat(t, "kvshim_l1_pinned"), 0.0)
	e.close(t)

	b := newEnv(t, 4, nil, server.Options{}, cfg)
	_, n := b.lookup(t, 1, false, prefixes[0])
	assert.Equal(t, n, uint32(4), "the first prefix, saved before Redis was full, is not served")
	id, n := b.lookup(t, 1, false, prefixes[0])
	b.check(t, id, 1, false, prefixes[0], n)
}
