package l1

import (
	"math/rand/v2"

	"github.com/kvshim/kvshim/kv"
)

// Config sizes a Cache.
type Config struct {
	// Capacity is the most bytes of segments L1 maps.
	Capacity uint64
	// SegmentSize is the size of one segment; it bounds the largest object.
	SegmentSize uint64
	// SlabSize is the target size of one slab.
	SlabSize uint64
	// HighWatermark and LowWatermark are fractions of Capacity: MaybeEvict
	// starts above the high one and stops at the low one.
	HighWatermark, LowWatermark float64
	// OnSegment, when set, is called for every new segment (under the
	// owner's lock): it must not block or call back into the cache.
	OnSegment func(id uint32, mem []byte)
	// OnEvict, when set, is called for every object the LRU evicts, before
	// it is freed (traces, KV events).
	OnEvict func(ns kv.Namespace, rank uint32, hash kv.Hash, size uint64)
}

// Shard is the index of one namespace's table.
type Shard uint32

// NoShard names no namespace: Find on it finds nothing.
const NoShard = ^Shard(0)

// Cache is L1: the allocator, the object table (per-namespace shards), the
// LRU list and the object state machine. It is not safe for concurrent use:
// its owner (server.Core) guards it with one mutex. Objects are named by
// their uint32 arena index, valid until the object is freed.
type Cache struct {
	cfg     Config
	mem     *allocator
	objs    arena
	shards  []shard
	idx     map[kv.Namespace]Shard
	lru     lru
	cnt     counters
	seed64  uint64
	keyMask uint64 // ^0; NarrowKeys narrows it

	lastSegErr error // most recent segment source failure
}

// counters are the cache's accounting.
type counters struct {
	objects                   [NumStates]uint64
	objBytes                  [NumStates]uint64
	holds                     uint64
	evictions, evictedBytes   uint64
	discarded, discardedBytes uint64 // losing publishers
	segmentErrors             uint64
	prefetchBytes             uint64 // slot bytes of fill staging + temporary objects
}

// New returns an empty cache over src (nothing is mapped until the first
// Reserve, unless src is a ReadySource that prepares segments ahead).
func New(src SegmentSource, cfg Config) *Cache {
	c := &Cache{
		cfg:     cfg,
		mem:     newAllocator(src, cfg.Capacity, cfg.SegmentSize, cfg.SlabSize),
		idx:     map[kv.Namespace]Shard{},
		seed64:  rand.Uint64(), // a fresh seed per cache
		keyMask: ^uint64(0),
	}
	c.mem.onSegment = cfg.OnSegment
	c.lru.init()
	return c
}

// Source is the cache's segment source.
func (c *Cache) Source() SegmentSource { return c.mem.src }

// Close closes the segment source; the cache must not be used after.
func (c *Cache) Close() error { return c.mem.src.Close() }

// NarrowKeys masks the table's 64-bit keys (tests: mask 1 makes every
// chunk hash share a key, exercising the collision chains).
func (c *Cache) NarrowKeys(mask uint64) { c.keyMask = mask }

// MaxObject is the largest object size Reserve accepts.
func (c *Cache) MaxObject() uint64 { return c.mem.maxObject() }

// Shard returns the shard of namespace ns, creating it when asked.
func (c *Cache) Shard(ns kv.Namespace, create bool) (Shard, bool) {
	if i, ok := c.idx[ns]; ok {
		return i, true
	}
	if !create {
		return NoShard, false
	}
	i := Shard(len(c.shards))
	c.shards = append(c.shards, shard{ns: ns, m: map[uint64]uint32{}})
	c.idx[ns] = i
	return i, true
}

func (c *Cache) shard(sh Shard) *shard {
	if sh == NoShard {
		return nil
	}
	return &c.shards[sh]
}

// Find returns the resident object (h, rank) of sh.
func (c *Cache) Find(sh Shard, h *kv.Hash, rank uint32) (uint32, bool) {
	return c.find(c.shard(sh), h, rank)
}

// FindRanks sets out[r] to the resident object (h, r) of sh for every rank
// r < len(out), Nil where absent, with one map probe.
func (c *Cache) FindRanks(sh Shard, h *kv.Hash, out []uint32) {
	c.findRanks(c.shard(sh), h, out)
}

// Object is what the cache's owner reads of one object.
type Object struct {
	Namespace kv.Namespace
	Rank      uint32
	Hash      kv.Hash
	Size      uint64 // requested bytes (Loc.Size)
	Holds     uint32
	State     State
}

// Get describes object i.
func (c *Cache) Get(i uint32) Object {
	o := c.objs.get(i)
	return Object{Namespace: c.shards[o.shard].ns, Rank: o.rank, Hash: o.hash, Size: o.size, Holds: o.holds, State: o.state}
}

// Size is object i's requested size.
func (c *Cache) Size(i uint32) uint64 { return c.objs.get(i).size }

// Holds is object i's read hold count.
func (c *Cache) Holds(i uint32) uint32 { return c.objs.get(i).holds }

// Loc is object i's location in the shared segments.
func (c *Cache) Loc(i uint32) kv.Loc {
	o := c.objs.get(i)
	seg, off := c.mem.loc(o.slab, o.slot)
	return kv.Loc{Segment: seg, Offset: off, Size: o.size}
}

// Bytes is object i's memory (Size bytes).
func (c *Cache) Bytes(i uint32) []byte {
	o := c.objs.get(i)
	return c.mem.bytes(o.slab, o.slot, o.size)
}

// At returns the bytes at loc (tests and in-process callers).
func (c *Cache) At(loc kv.Loc) []byte {
	return c.mem.segs[loc.Segment-1].mem[loc.Offset : loc.Offset+loc.Size]
}

// Touch moves resident object i right after `at` on the LRU list (at = Nil:
// to the head) and returns i; for an object that is not resident it does
// nothing and returns at. Touching a sequence in order, each after the
// previous, puts it at the head in that order.
func (c *Cache) Touch(at, i uint32) uint32 {
	if c.objs.get(i).state != Resident {
		return at
	}
	c.lru.placeAfter(&c.objs, at, i)
	return i
}

// LastSegmentError is the most recent failure of the segment source (nil
// if none).
func (c *Cache) LastSegmentError() error { return c.lastSegErr }

// Growth describes the background grower: whether the source makes
// segments ready ahead of use (a ReadySource with ReadyAhead > 0), how
// many segments it has prepared in all, and the number and bytes of those
// ready and not yet adopted by the allocator.
func (c *Cache) Growth() (ahead bool, prepared uint64, readyN int, readyBytes uint64) {
	g := c.mem.ahead
	if g == nil {
		return false, 0, 0, 0
	}
	readyN, readyBytes = g.readyNow()
	g.mu.Lock()
	defer g.mu.Unlock()
	return true, g.prepared, readyN, readyBytes
}

// Stats is the cache's accounting.
type Stats struct {
	// Allocator: the L1 size limit, bytes of segments (made ready ahead
	// of use too), carved into slabs, in slots of live objects (4 KiB
	// rounded) and its high-water mark, and requested by live objects.
	Capacity, Mapped, Slab, Used, MaxUsed, Requested uint64
	Segments, Slabs, Classes                         int

	Objects, ObjectBytes      [NumStates]uint64
	Holds                     uint64
	Evictions, EvictedBytes   uint64
	Discarded, DiscardedBytes uint64
	SegmentErrors             uint64
	// PrefetchBytes is the slot bytes of fill staging and temporary objects.
	PrefetchBytes uint64
}

// Stats returns the counters now.
func (c *Cache) Stats() Stats {
	a := c.mem.stats()
	k := &c.cnt
	return Stats{
		Capacity: a.Capacity, Mapped: a.Mapped, Slab: a.Slab, Used: a.Used, MaxUsed: c.mem.maxUsed, Requested: a.Requested,
		Segments: a.Segments, Slabs: a.Slabs, Classes: a.Classes,
		Objects: k.objects, ObjectBytes: k.objBytes, Holds: k.holds,
		Evictions: k.evictions, EvictedBytes: k.evictedBytes, Discarded: k.discarded, DiscardedBytes: k.discardedBytes,
		SegmentErrors: k.segmentErrors, PrefetchBytes: k.prefetchBytes,
	}
}

// PrefetchBytes is Stats().PrefetchBytes, without the rest.
func (c *Cache) PrefetchBytes() uint64 { return c.cnt.prefetchBytes }
