package server

import "time"

// reaper reclaims, every ReapInterval, the holds of lookups older than
// HoldTTL and the staging objects older than StagingTTL: the last resort
// for a live client that forgets to FREE, RELEASE, COMMIT or ABORT.
func (st *Core) reaper() {
	defer close(st.done)
	tick := time.NewTicker(st.cfg.ReapInterval)
	defer tick.Stop()
	for {
		select {
		case <-st.stop:
			return
		case <-tick.C:
			st.reap()
		}
	}
}

// reap runs one reclaim pass.
func (st *Core) reap() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return
	}
	now := st.now().UnixNano()
	holdBefore := now - int64(st.cfg.HoldTTL)
	for _, s := range st.sessions {
		for _, lk := range s.lookups {
			if lk.since < holdBefore {
				st.cnt.ttlHolds += lk.holds
				st.dropLookup(lk)
			}
		}
	}
	stageBefore := now - int64(st.cfg.StagingTTL)
	for k, e := range st.staging {
		if e.since < stageBefore {
			delete(st.staging, k)
			st.releaseStaging(e.owner, e.idx)
			st.cnt.ttlStaging++
		}
	}
}
