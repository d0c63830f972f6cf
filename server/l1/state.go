package l1

import (
	"errors"
	"fmt"

	"github.com/kvshim/kvshim/kv"
)

// State is an object's place in its life cycle (see the package doc).
type State uint8

// Object states.
const (
	Free      State = iota // arena slot unused
	Staging                // reserved for one writer, invisible to readers
	Resident               // published, readable, evictable when unheld
	Temporary              // loaded for one lookup, freed when unheld
	Fenced                 // a possibly-alive writer's slot: unused until it is known dead
	NumStates
)

var stateNames = [NumStates]string{"free", "staging", "resident", "temporary", "fenced"}

// String is the state's name, the "state" label of kvshim_l1_objects.
func (s State) String() string {
	if s < NumStates {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// ErrTransition: a state change the object state machine does not allow
// (a caller bug). The object is left as it was.
var ErrTransition = errors.New("l1: invalid object state transition")

// transitions are the changes between live states that an operation may
// make; leaving for Free is Cache.Free (any state, no holds).
var transitions = [NumStates][NumStates]bool{
	Staging: {Resident: true, Temporary: true, Fenced: true},
}

// move changes object i's state to `to`, keeping the counters.
func (c *Cache) move(i uint32, to State) error {
	o := c.objs.get(i)
	if !transitions[o.state][to] {
		return fmt.Errorf("%w: object %d: %v → %v", ErrTransition, i, o.state, to)
	}
	c.cnt.objects[o.state]--
	c.cnt.objBytes[o.state] -= o.size
	o.state = to
	c.cnt.objects[to]++
	c.cnt.objBytes[to] += o.size
	return nil
}

// Reserve allocates size bytes for (shard, rank, h) in state Staging,
// evicting LRU objects when L1 is full; ok is false when no space could be
// made. fill marks a prefetch's reservation: its slot bytes count in
// Stats.PrefetchBytes until it is published resident or freed. The object
// is invisible to Find until Publish.
func (c *Cache) Reserve(shard Shard, rank uint32, h *kv.Hash, size uint64, fill bool) (uint32, bool) {
	for {
		slab, slot, ok, err := c.mem.alloc(size)
		if err != nil {
			c.cnt.segmentErrors++
			c.lastSegErr = err
			return Nil, false
		}
		if ok {
			i := c.objs.new()
			o := c.objs.get(i)
			*o = object{hash: *h, shard: uint32(shard), rank: rank, slab: slab, slot: slot, size: size,
				state: Staging, prev: Nil, next: Nil, fill: fill}
			c.cnt.objects[Staging]++
			c.cnt.objBytes[Staging] += size
			if fill {
				c.cnt.prefetchBytes += RoundPage(size)
			}
			return i, true
		}
		if !c.evictOne() {
			return Nil, false
		}
	}
}

// Publish makes staging object i resident: findable, on the LRU list's
// head, evictable once unheld. The first publisher of a key wins: when
// (shard, rank, hash) is already resident, i is discarded (freed and
// counted) and Publish reports false. It does not run watermark eviction
// (MaybeEvict, once per batch).
func (c *Cache) Publish(i uint32) (bool, error) {
	o := c.objs.get(i)
	if o.state != Staging {
		return false, fmt.Errorf("%w: object %d: publish from %v", ErrTransition, i, o.state)
	}
	c.unfill(i) // resident objects are not prefetch bytes any more
	if _, dup := c.find(&c.shards[o.shard], &o.hash, o.rank); dup {
		c.cnt.discarded++
		c.cnt.discardedBytes += o.size
		c.Free(i)
		return false, nil
	}
	if err := c.move(i, Resident); err != nil {
		return false, err
	}
	c.insert(i)
	c.lru.pushHead(&c.objs, i)
	return true, nil
}

// MakeTemporary makes staging object i temporary: readable by the holds
// its lookup takes, never findable, freed when its last hold goes.
func (c *Cache) MakeTemporary(i uint32) error { return c.move(i, Temporary) }

// Fence parks staging object i: its writer is gone but may still write, so
// the slot is neither findable nor reusable until Free.
func (c *Cache) Fence(i uint32) error { return c.move(i, Fenced) }

// Free returns object i's memory from any state. A resident object also
// leaves the table and the LRU list. The caller ensures it has no holds.
func (c *Cache) Free(i uint32) {
	o := c.objs.get(i)
	if o.state == Resident {
		c.unlink(i)
		c.lru.remove(&c.objs, i)
	}
	c.unfill(i)
	c.cnt.objects[o.state]--
	c.cnt.objBytes[o.state] -= o.size
	c.mem.free(o.slab, o.slot, o.size)
	c.objs.release(i)
}

// unfill ends object i's prefetch accounting (it is freed or resident).
func (c *Cache) unfill(i uint32) {
	o := c.objs.get(i)
	if o.fill {
		o.fill = false
		c.cnt.prefetchBytes -= RoundPage(o.size)
	}
}

// Hold adds n read holds to object i.
func (c *Cache) Hold(i uint32, n uint32) {
	c.objs.get(i).holds += n
	c.cnt.holds += uint64(n)
}

// Unhold drops one read hold; an unheld temporary object is freed.
func (c *Cache) Unhold(i uint32) {
	o := c.objs.get(i)
	o.holds--
	c.cnt.holds--
	if o.holds == 0 && o.state == Temporary {
		c.Free(i)
	}
}
