package server

import "time"

// reaper reclaims, every ReapInterval, the holds of lookups older than
// HoldTTL and the staging objects older than StagingTTL: the last resort
// for a live client that forgets to FREE, RELEASE, COMMIT or ABORT.
func (core *Core) reaper() {
	defer close(core.done)
	tick := time.NewTicker(core.cfg.ReapInterval)
	defer tick.Stop()
	for {
		select {
		case <-core.stop:
			return
		case <-tick.C:
			core.reap()
		}
	}
}

// reap runs one reclaim pass.
func (core *Core) reap() {
	core.mu.Lock()
	defer core.mu.Unlock()
	if core.closed {
		return
	}
	now := core.now().UnixNano()
	holdBefore := now - int64(core.cfg.HoldTTL)
	for _, s := range core.sessions {
		for _, lk := range s.lookups {
			if lk.since < holdBefore {
				core.cnt.ttlHolds += lk.holds
				core.dropLookup(lk)
			}
		}
	}
	stageBefore := now - int64(core.cfg.StagingTTL)
	for k, e := range core.staging {
		if e.since < stageBefore {
			delete(core.staging, k)
			core.releaseStaging(e.owner, e.idx)
			core.cnt.ttlStaging++
		}
	}
}
