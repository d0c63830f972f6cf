package server

import (
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
)

// Generations. A reset (OpReset: vLLM's reset_prefix_cache) must make
// every chunk a deployment stored before it miss, in every tier, for every
// instance of the deployment, at once, without touching bytes another
// session is reading. kvshim does it with a generation per namespace,
// mixed by the clients into the root of their chunk-hash chain: after a
// reset, the keys a scheduler computes are new keys, which no L1 object
// and no L2 object (written before, under the old keys) has. Nothing is
// deleted under a reader: objects held by a lookup, staged by a writer or
// pinned for an L2 write stay until released and are then ordinary LRU
// victims, and old L2 objects are never named again (their space is the
// L2's retention to reclaim). The unheld L1 objects of the namespace are
// dropped at once, only to give their memory back.
//
// The table lives in the server: every scheduler of the namespace sends
// its lookups here, and each lookup's answer says the generation in force
// when it was registered, so an instance that has not reset yet learns it
// from its next answer (which it then counts as a miss). A generation
// is the reset's wall clock in nanoseconds (or one more than the last, if
// larger), so a server that restarted and forgot its table still never
// hands out a generation a client used before: clients keep the largest
// they have seen and raise a forgetful server's (ResetReq without Bump).

// generationLocked is ns's generation (0: never reset). core.mu held.
func (core *Core) generationLocked(ns kv.Namespace) uint64 { return core.gens[ns] }

// Reset answers OpReset.
func (core *Core) Reset(s *Session, req *ipc.ResetReq) (*ipc.ResetResp, error) {
	defer core.metrics.observe(opReset, time.Now())
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, err
	}
	if core.gens == nil {
		core.gens = map[kv.Namespace]uint64{}
	}
	var r ipc.ResetResp
	now := uint64(core.now().UnixNano())
	for _, ns := range req.Namespaces {
		g := max(core.gens[ns], req.AtLeast)
		if req.Bump {
			g = max(g+1, now, req.AtLeast+1)
			if sh, ok := core.l1.Shard(ns, false); ok {
				o, b := core.l1.ClearShard(sh)
				r.Objects += o
				r.Bytes += b
			}
			core.cnt.resets++
		}
		core.gens[ns] = g
		r.Generation = max(r.Generation, g)
	}
	core.cnt.cleared += r.Objects
	core.cnt.clearedBytes += r.Bytes
	return &r, nil
}

// tierOf is the hit-source tier of an L2 adapter type.
func tierOf(adapterType string) ipc.Tier {
	if adapterType == "fs" {
		return ipc.TierDisk
	}
	return ipc.TierRemote
}
