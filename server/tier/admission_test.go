package tier_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/tier"
)

// writeL2 stores prompts × chunks objects through a core with cfg.
func writeL2(t *testing.T, cfg string, prompts, chunks int) [][]kv.Hash {
	t.Helper()
	a := newEnv(t, 4, nil, server.Options{}, cfg)
	out := make([][]kv.Hash, prompts)
	for p := range out {
		out[p] = hashes(fmt.Sprint("prompt ", p), chunks)
		a.put(t, 0, out[p])
		a.flush(t)
	}
	a.close(t)
	return out
}

// Many concurrent lookups that all need L2 never push L1 past resident +
// budget: admission counts L1 prefetch bytes plus accepted lookups' bytes.
func TestAdmissionNeverOversubscribes(t *testing.T) {
	cfg := fsConfig(t.TempDir())
	const prompts, chunks = 12, 4
	ps := writeL2(t, cfg, prompts, chunks)
	for _, wait := range []time.Duration{5 * time.Second, -1} {
		t.Run(fmt.Sprint("wait=", wait), func(t *testing.T) {
			const budget = 2 * chunks * objSize // two lookups at a time
			b := newEnv(t, 8, func(c *server.Config) {
				c.L2StorePolicy = tier.PolicyNone
				c.L2PrefetchBudgetGB = float64(budget) / server.GiB
				c.L2AdmissionWait = wait
			}, server.Options{}, cfg)
			// A resident working set that must not be evicted.
			const resident = 32
			b.put(t, 0, hashes("resident", resident))
			base := float64(resident * objSize)
			assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), base)
			var wg sync.WaitGroup
			answers := make([]uint32, prompts)
			for p := range prompts {
				wg.Add(1)
				go func() {
					defer wg.Done()
					id := uint64(100 + p)
					if err := b.st.Lookup(b.sess, &ipc.LookupReq{LookupID: id, Namespace: ns1, WorldSize: 1, Hashes: ps[p]}); err != nil {
						t.Error(err)
						return
					}
					answers[p] = b.result(t, id)
					if answers[p] == 0 {
						return // answered and forgotten
					}
					time.Sleep(2 * time.Millisecond) // the reader's copies
					if err := b.st.Release(b.sess, &ipc.ReleaseReq{Owner: b.sess.ID(), LookupID: id}); err != nil {
						t.Error(err)
					}
				}()
			}
			wg.Wait()
			st := b.st.PrefetchController().Stats()
			t.Logf("used max %.0f KiB (resident %.0f KiB, budget %d KiB); %+v",
				b.stat(t, "kvshim_l1_used_max_bytes")/1024, base/1024, budget/1024, st)
			assert.Assert(t, b.stat(t, "kvshim_l1_used_max_bytes") <= base+budget)
			assert.Equal(t, b.stat(t, "kvshim_l1_evictions_total"), 0.0)
			assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), base)
			assert.Equal(t, st.Loaded+st.Rejected, int64(prompts))
			assert.Assert(t, st.Waited > 0)
			for p, n := range answers {
				if wait > 0 {
					assert.Equal(t, n, uint32(chunks), "prompt %d", p)
				} else {
					assert.Assert(t, n == 0 || n == chunks, "prompt %d: %d", p, n)
				}
			}
			if wait > 0 {
				assert.Equal(t, st.Rejected, int64(0))
			} else {
				assert.Assert(t, st.Rejected > 0)
			}
		})
	}
}

// A plan larger than the whole budget is trimmed to the prefix that fits.
func TestAdmissionTrimsToBudget(t *testing.T) {
	cfg := fsConfig(t.TempDir())
	ps := writeL2(t, cfg, 1, 4)
	b2 := newEnv(t, 4, func(c *server.Config) { c.L2PrefetchBudgetGB = float64(2*objSize) / server.GiB }, server.Options{}, cfg)
	id, n := b2.lookup(t, 1, false, ps[0])
	assert.Equal(t, n, uint32(2))
	b2.check(t, id, 1, false, ps[0], n)
}

// The writer's hold keeps the L1 source of a running L2 write
// from eviction; once the write ends the object is evictable again, and a
// later lookup loads it back from L2.
func TestStorePinsSourceUntilWriteEnds(t *testing.T) {
	b := newEnv(t, 1, func(c *server.Config) {
		c.L2StoreMaxInflightGB = float64(4*objSize) / server.GiB
	}, server.Options{}, faultConfig(t.TempDir()))
	fb := fault(b)
	gate := make(chan struct{})
	fb.mu.Lock()
	fb.gate = gate
	fb.mu.Unlock()
	p := hashes("pinned", 4)
	b.put(t, 0, p)
	assert.Equal(t, b.stat(t, "kvshim_l1_pinned"), 4.0)
	// Eviction pressure: 16 slots of L1, 4 pinned, 16 more objects (not
	// written to L2: over the in-flight cap, so not pinned).
	for i := range 4 {
		b.put(t, 0, hashes(fmt.Sprint("pressure ", i), 4))
	}
	wr := b.st.Writer()
	assert.Equal(t, wr.Stats().SkippedBusy, int64(16))
	assert.Assert(t, b.stat(t, "kvshim_l1_evictions_total") >= 4)
	assert.Assert(t, b.stat(t, "kvshim_l1_used_max_bytes") <= float64(1<<20))
	id, n := b.lookup(t, 1, false, p) // still resident: an L1 hit
	assert.Equal(t, n, uint32(4))
	b.check(t, id, 1, false, p, n)
	assert.Equal(t, wr.Stats().Pending, int64(4))
	assert.Equal(t, b.st.PrefetchController().Stats().Loaded, int64(0))
	close(gate)
	b.flush(t)
	assert.Equal(t, wr.Stats().Saved[0], int64(4))
	assert.Equal(t, b.stat(t, "kvshim_l1_pinned"), 0.0)
	// Now evictable: more pressure drops them, L2 brings them back.
	for i := range 4 {
		b.put(t, 0, hashes(fmt.Sprint("more pressure ", i), 4))
	}
	id, n = b.lookup(t, 1, false, p)
	assert.Equal(t, n, uint32(4))
	b.check(t, id, 1, false, p, n)
	assert.Equal(t, b.st.PrefetchController().Stats().ChunksOK[0], int64(4))
}
