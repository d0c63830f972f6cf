package tier_test

import (
	"os"
	"syscall"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/tier"
)

// seedCounterExample prepares the partial-hit counter-example: 1,024
// tokens = 4 chunks, L2 has chunks 0-2 (chunk 3 never stored), and a restarted core whose L1
// holds chunk 0 again. hook runs between the L2 lookup and the loads.
func seedCounterExample(t *testing.T, cfg string, hook func(keys []kv.Key), tweak ...func(*server.Config)) (*env, []kv.Hash) {
	t.Helper()
	hs := hashes("1024 tokens", 4)
	a := newEnv(t, 4, nil, server.Options{}, cfg)
	a.put(t, 0, hs[:3])
	a.flush(t)
	a.close(t)
	b := newEnv(t, 4, func(c *server.Config) {
		c.L2StorePolicy = tier.PolicyNone
		for _, f := range tweak {
			f(c)
		}
	}, server.Options{L2BeforeLoad: hook}, cfg)
	b.put(t, 0, hs[:1])
	return b, hs
}

// The partial-hit counter-example with a real fault: chunk 1's file is
// corrupted after L2 found it and before it is loaded. Chunk 2 loads, yet
// the answer is 1 chunk (256 tokens), never 512; the corrupt file is
// deleted and never served.
func TestPartialFailureCorruptFile(t *testing.T) {
	dir := t.TempDir()
	be, err := fs.Open(fs.Config{BasePath: dir}) // only to name the files
	assert.NilError(t, err)
	var hs []kv.Hash
	hook := func(keys []kv.Key) {
		assert.Equal(t, len(keys), 2) // chunks 1 and 2; chunk 0 is in L1, 3 nowhere
		p := be.Path(tier.Key(ns1, 0, hs[1]))
		b, err := os.ReadFile(p)
		assert.NilError(t, err)
		b[100] ^= 0xff
		assert.NilError(t, os.WriteFile(p, b, 0o644))
	}
	b, h := seedCounterExample(t, fsConfig(dir), hook)
	hs = h
	id, n := b.lookup(t, 1, false, hs)
	assert.Equal(t, n, uint32(1))
	b.check(t, id, 1, false, hs, n)
	ps := b.st.PrefetchController().Stats()
	assert.Equal(t, ps.ChunksOK[0], int64(1))   // chunk 2 loaded ...
	assert.Equal(t, ps.ChunksMiss[0], int64(1)) // ... chunk 1 corrupt: a miss
	_, err = os.Stat(be.Path(tier.Key(ns1, 0, hs[1])))
	assert.Assert(t, os.IsNotExist(err), "corrupt object not deleted")
	// Loaded chunk 2 was dropped with the answer; L1 is back to chunk 0.
	assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), float64(objSize))
	// Never served: the next lookup finds chunk 1 nowhere.
	_, n = b.lookup(t, 1, false, hs)
	assert.Equal(t, n, uint32(1))
	assert.Equal(t, b.st.PrefetchController().Stats().NoL2, int64(1))
}

// The same with a deleted file (another host's eviction between lookup and
// load) and with a backend error (test-only faultfs adapter).
func TestPartialFailureDeletedAndFailed(t *testing.T) {
	t.Run("deleted", func(t *testing.T) {
		dir := t.TempDir()
		be, err := fs.Open(fs.Config{BasePath: dir})
		assert.NilError(t, err)
		var hs []kv.Hash
		b, h := seedCounterExample(t, fsConfig(dir), func([]kv.Key) {
			assert.NilError(t, os.Remove(be.Path(tier.Key(ns1, 0, hs[1]))))
		})
		hs = h
		id, n := b.lookup(t, 1, false, hs)
		assert.Equal(t, n, uint32(1))
		b.check(t, id, 1, false, hs, n)
	})
	t.Run("failed", func(t *testing.T) {
		var b *env
		var hs []kv.Hash
		b, hs = seedCounterExample(t, faultConfig(t.TempDir()), func([]kv.Key) {
			fb := fault(b)
			fb.mu.Lock()
			fb.failLoad[tier.Key(ns1, 0, hs[1])] = true
			fb.mu.Unlock()
		})
		id, n := b.lookup(t, 1, false, hs)
		assert.Equal(t, n, uint32(1))
		b.check(t, id, 1, false, hs, n)
		ps := b.st.PrefetchController().Stats()
		assert.Equal(t, ps.ChunksFailed[0], int64(1))
		assert.Equal(t, ps.ChunksOK[0], int64(1))
		assert.Equal(t, b.stat(t, "kvshim_l1_prefetch_bytes"), 0.0)
		// Chunk 2's temporary copy went with the answer: only chunk 0 is left.
		assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=resident}"), 1.0)
	})
}

// Redis killed mid-load: the keys being loaded fail, the answer is what
// L1 had, and the core keeps serving L1 (lookups and new writes).
func TestRedisKilledMidLoad(t *testing.T) {
	rs := startRedis(t)
	var killed bool
	b, hs := seedCounterExample(t, redisConfig(rs, ""), func([]kv.Key) {
		rs.Kill()
		killed = true
	})
	id, n := b.lookup(t, 1, false, hs)
	assert.Assert(t, killed)
	assert.Equal(t, n, uint32(1))
	b.check(t, id, 1, false, hs, n)
	ps := b.st.PrefetchController().Stats()
	assert.Equal(t, ps.ChunksFailed[0], int64(2))
	assert.Equal(t, b.stat(t, "kvshim_l1_prefetch_bytes"), 0.0)
	// Still serving: L1 hits, new writes (their L2 write fails, best effort).
	more := hashes("after the kill", 2)
	b.put(t, 0, more)
	id, n = b.lookup(t, 1, false, more)
	assert.Equal(t, n, uint32(2))
	b.check(t, id, 1, false, more, n)
	_, n = b.lookup(t, 1, false, hs) // L2 lookup fails fast: L1's chunk 0
	assert.Equal(t, n, uint32(1))
	assert.Equal(t, b.stat(t, "kvshim_lookups_pending"), 0.0)
}

// Past the prefetch deadline the lookup is answered with what has arrived
// (L1's chunk 0), while Redis is stopped mid-load; the staging of the hung
// loads is freed once their keys fail, never under them.
func TestDeadlineAnswersWithArrived(t *testing.T) {
	rs := startRedis(t)
	t.Cleanup(func() { _ = syscall.Kill(rs.Pid(), syscall.SIGCONT) })
	b, hs := seedCounterExample(t, redisConfig(rs, ""), func([]kv.Key) { rs.Pause() },
		func(c *server.Config) { c.L2PrefetchTimeout = 300 * time.Millisecond })
	start := time.Now()
	id, n := b.lookup(t, 1, false, hs)
	assert.Assert(t, time.Since(start) < 3*time.Second, "answered after %v", time.Since(start))
	assert.Equal(t, n, uint32(1))
	b.check(t, id, 1, false, hs, n)
	assert.Equal(t, b.st.PrefetchController().Stats().Timeouts, int64(1))
	testkit.Eventually(t, 20*time.Second, "hung loads to fail and free their staging", func() bool {
		return b.stat(t, "kvshim_l1_prefetch_bytes") == 0 && b.st.PrefetchController().Stats().Inflight == 0
	})
	assert.Equal(t, b.st.PrefetchController().Stats().ChunksFailed[0], int64(2))
	assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), float64(objSize))
}

// A load that ignores its deadline: the lookup is answered at the deadline
// with what arrived, but the staging buffers stay reserved while the load
// may still write them, and are freed when it reports.
func TestDeadlineKeepsStagingUnderStuckLoad(t *testing.T) {
	var b *env
	stuck, loading := make(chan struct{}), make(chan struct{})
	b, hs := seedCounterExample(t, faultConfig(t.TempDir()), func([]kv.Key) {
		fb := fault(b)
		fb.mu.Lock()
		fb.stuck, fb.loading = stuck, loading
		fb.mu.Unlock()
	}, func(c *server.Config) { c.L2PrefetchTimeout = 200 * time.Millisecond })
	id, n := b.lookup(t, 1, false, hs)
	assert.Equal(t, n, uint32(1))
	<-loading
	assert.Equal(t, b.stat(t, "kvshim_l1_prefetch_bytes"), float64(2*objSize)) // chunks 1, 2 still staged
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=staging}"), 2.0)
	b.check(t, id, 1, false, hs, n)
	assert.Equal(t, b.st.PrefetchController().Stats().Timeouts, int64(1))
	close(stuck)
	testkit.Eventually(t, 20*time.Second, "stuck loads to report and free their staging", func() bool {
		return b.stat(t, "kvshim_l1_prefetch_bytes") == 0 && b.st.PrefetchController().Stats().Inflight == 0
	})
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=staging}"), 0.0)
	assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), float64(objSize))
}
