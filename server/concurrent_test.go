package server

import (
	"fmt"
	"sync"
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

// Many sessions at once: schedulers look up and free, workers store,
// retrieve and release, some sessions die mid-way; L1 is small enough to
// evict. Afterwards every hold and staging byte is accounted for.
func TestConcurrentSessions(t *testing.T) {
	st := newCore(t, 1, Options{}, func(c *Config) { c.HighWatermark, c.LowWatermark = 0.8, 0.5 })
	const workers, rounds, world = 8, 60, 2
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			sched, err := st.OpenSession(sessionID(1000 + w))
			if err != nil {
				errs <- err
				return
			}
			wk := make([]*Session, world)
			for r := range wk {
				wk[r], _ = st.OpenSession(sessionID(2000 + w*world + r))
			}
			for i := range rounds {
				hs := hashes(fmt.Sprint("c", i%7), 6) // shared prompts: writers race
				for r := range uint32(world) {
					tag := kv.Tag{byte(w), byte(r)}
					a, err := st.Alloc(wk[r], &ipc.AllocReq{Tag: tag, Namespace: ns1, Rank: r, Hashes: hs, Sizes: sizes(len(hs))})
					if err != nil {
						errs <- err
						return
					}
					var ok []kv.Hash
					for k, x := range a.Status {
						if x == ipc.StatusOK {
							ok = append(ok, hs[k])
						}
					}
					if i%5 == 4 {
						continue // leave it staged; session close frees it
					}
					if _, err := st.Commit(wk[r], &ipc.CommitReq{Tag: tag, Namespace: ns1, Rank: r, Hashes: ok}); err != nil {
						errs <- err
						return
					}
				}
				id := uint64(i)
				if err := st.Lookup(sched, &ipc.LookupReq{LookupID: id, Namespace: ns1, WorldSize: world, Hashes: hs}); err != nil {
					errs <- err
					return
				}
				res, _ := st.LookupResult(sched, &ipc.LookupResultReq{LookupID: id})
				if res.Status != ipc.StatusOK {
					errs <- fmt.Errorf("status %d", res.Status)
					return
				}
				if i%3 == 0 {
					st.Free(sched, &ipc.FreeReq{LookupID: id, End: ^uint32(0)})
					continue
				}
				for r := range uint32(world) {
					rr, err := st.Retrieve(wk[r], &ipc.RetrieveReq{Owner: sched.ID(), LookupID: id, Rank: r, End: res.Chunks})
					if err != nil && res.Chunks > 0 {
						errs <- err
						return
					}
					if rr != nil {
						for _, x := range rr.Status {
							if x != ipc.StatusOK {
								errs <- fmt.Errorf("held chunk not retrievable")
								return
							}
						}
					}
					if i%4 != 1 { // sometimes forget: session close cleans up
						st.Release(wk[r], &ipc.ReleaseReq{Owner: sched.ID(), LookupID: id, Rank: r})
					}
				}
				if i%10 == 9 {
					st.Stats(sched)
				}
			}
			for _, s := range wk {
				st.CloseSession(s)
			}
			st.CloseSession(sched)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NilError(t, err)
	}
	assert.Equal(t, holds(t, st), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_sessions"), 0.0)
	s := open(t, st, 0)
	_, err := st.Clear(s)
	assert.NilError(t, err)
	assert.Equal(t, used(t, st), 0.0)
}
