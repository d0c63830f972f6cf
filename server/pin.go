package server

import (
	"log/slog"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/tier"
)

// The core is the L1 that the L2 controllers unpin and budget against.
var _ tier.L1 = (*Core)(nil)

// Pins are read holds owned by an in-process component (the L2 writer)
// instead of a lookup: a pinned object is never evicted or
// cleared and its bytes stay valid until Unpin. With Options.OnCommit set,
// COMMIT pins every object it publishes and hands the pins over.

// pinLocked adds a pin to resident object i and describes it.
func (core *Core) pinLocked(i uint32) tier.Object {
	core.l1.Hold(i, 1)
	core.cnt.pins++
	if core.pinned == nil {
		core.pinned = map[uint32]uint32{}
	}
	core.pinned[i]++
	o := core.l1.Get(i)
	return tier.Object{Key: tier.Key(o.Namespace, o.Rank, o.Hash), Mem: core.l1.Bytes(i), Ref: uint64(i)}
}

// Pin pins the resident object (ns, rank, h) and returns it; ok is false
// when it is not resident.
func (core *Core) Pin(ns kv.Namespace, rank uint32, h kv.Hash) (o tier.Object, ok bool) {
	core.mu.Lock()
	defer core.mu.Unlock()
	if core.closed {
		return o, false
	}
	sh, found := core.l1.Shard(ns, false)
	if !found {
		return o, false
	}
	i, res := core.l1.Find(sh, &h, rank)
	if !res {
		return o, false
	}
	return core.pinLocked(i), true
}

// Unpin drops pins taken by Pin or handed over by OnCommit. Each pin must
// be dropped exactly once; after Close it does nothing.
func (core *Core) Unpin(objs []tier.Object) {
	core.mu.Lock()
	defer core.mu.Unlock()
	if core.closed {
		return
	}
	for _, p := range objs {
		i := uint32(p.Ref)
		if core.pinned[i] == 0 {
			// A caller bug; refusing keeps the hold counts consistent.
			slog.Error("server: Unpin of an object that is not pinned", "key", p.Key)
			continue
		}
		if o := core.l1.Get(i); o.Rank != p.Key.Rank || o.Hash != p.Key.Hash {
			// A caller bug; refusing keeps the hold counts consistent.
			slog.Error("server: Unpin of an object that is not pinned", "key", p.Key)
			continue
		}
		if core.pinned[i]--; core.pinned[i] == 0 {
			delete(core.pinned, i)
		}
		core.l1.Unhold(i)
		core.cnt.pins--
	}
}

// PrefetchBytes is the L1 slot bytes of prefetch staging and temporary
// objects (the prefetch admission budget counts them).
func (core *Core) PrefetchBytes() uint64 {
	core.mu.Lock()
	defer core.mu.Unlock()
	return core.l1.PrefetchBytes()
}
