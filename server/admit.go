package server

import (
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l1"
)

// Admission to L2 by reuse (--l2-store-after-lookups N, Config.
// L2StoreAfterLookups). With N = 0 (the default) every committed object is
// written through to L2 at COMMIT. With N > 0 a COMMIT writes nothing; an
// object is handed to the L2 writer once lookups have found it in L1 N
// times (vLLM's store_threshold, KVBM's "seen twice" filter), so chunks
// that are computed once and never asked for again (a one-off prompt's
// tail) cost no L2 write. The price: an object evicted from L1 before its
// N-th lookup is never in L2.
//
// The counts are kept per (namespace shard, rank, hash) in a table bounded
// by maxLookCounts: past it the table starts over (counts restart at zero,
// so an object is written later, never wrongly).

const maxLookCounts = 1 << 20

type lookKey struct {
	shard l1.Shard
	rank  uint32
	hash  kv.Hash
}

// storeAfter is the lookup count that admits an object to L2 (0: at commit).
func (core *Core) storeAfter() uint32 {
	if core.cfg.L2StoreAfterLookups <= 0 || core.onCommit == nil {
		return 0
	}
	return uint32(core.cfg.L2StoreAfterLookups)
}

// countLookups counts one lookup of each object lk holds on chunks [0, p)
// and pins, for the L2 writer, those that reach the threshold (handed over
// by the caller outside the lock: takeAdmitted). core.mu held.
func (core *Core) countLookups(lk *lookup, p uint32) {
	n := core.storeAfter()
	if n == 0 || p == 0 {
		return
	}
	sh, ok := core.l1.Shard(lk.ns, false)
	if !ok {
		return
	}
	if core.looks == nil || len(core.looks) >= maxLookCounts {
		core.looks = map[lookKey]uint32{}
	}
	for r := range lk.ranks() {
		for c := range p {
			i := lk.held[r][c]
			if i == l1.Nil {
				continue
			}
			k := lookKey{sh, r, lk.hashes[c]}
			v := core.looks[k]
			if v >= n {
				continue // handed over already
			}
			v++
			core.looks[k] = v
			if v == n {
				core.admitted = append(core.admitted, core.pinLocked(i))
				core.cnt.admittedL2++
			}
		}
	}
}

// takeAdmitted hands the objects countLookups admitted to the L2 writer.
// Called without core.mu.
func (core *Core) takeAdmitted() {
	core.mu.Lock()
	pins := core.admitted
	core.admitted = nil
	core.mu.Unlock()
	if len(pins) > 0 {
		core.onCommit(pins)
	}
}
