package l1

import (
	"encoding/binary"

	"github.com/kvshim/kvshim/kv"
)

// object is one L1 object's metadata (80 bytes; the table adds a 16-byte
// map slot per chunk hash, shared by all ranks). Indices, not pointers, so the arena is
// never scanned by the garbage collector.
type object struct {
	hash  kv.Hash // chunk hash
	shard uint32  // namespace shard index
	rank  uint32
	slab  uint32
	slot  uint32
	holds uint32 // read holds (all lookups, all readers)
	prev  uint32 // LRU neighbours (resident only); Nil at the ends
	next  uint32
	coll  uint32 // next resident object of the shard with the same table key
	// (the same chunk on other ranks, or a rare key collision)
	state State
	fill  bool   // staged or temporary for a prefetch (counted in prefetchBytes)
	size  uint64 // requested bytes (Loc.Size)
}

// shard is the resident objects of one namespace. Its map is keyed by a
// seeded 64-bit hash of the chunk hash (a fast uint64 map with no 32-byte
// compares); the objects sharing a key — one per rank holding the chunk,
// plus rare key collisions — are chained through object.coll and told
// apart by (hash, rank). A lookup of C chunks on R ranks thus costs C map
// probes, not C×R.
type shard struct {
	ns kv.Namespace
	m  map[uint64]uint32
}

// tableKey is the shard map key of h: 64 bits of the chunk hash itself
// (already uniform: SHA-256), mixed with a per-cache seed so a client
// cannot line keys up across restarts.
func (c *Cache) tableKey(h *kv.Hash) uint64 {
	return (binary.LittleEndian.Uint64(h[:8]) ^ c.seed64) & c.keyMask
}

// sameHash compares two chunk hashes word by word (inlined; a [32]byte ==
// is a call to memequal).
func sameHash(a, b *kv.Hash) bool {
	return binary.LittleEndian.Uint64(a[:8]) == binary.LittleEndian.Uint64(b[:8]) &&
		binary.LittleEndian.Uint64(a[8:16]) == binary.LittleEndian.Uint64(b[8:16]) &&
		binary.LittleEndian.Uint64(a[16:24]) == binary.LittleEndian.Uint64(b[16:24]) &&
		binary.LittleEndian.Uint64(a[24:]) == binary.LittleEndian.Uint64(b[24:])
}

// find returns the resident object (h, rank) of sh (sh may be nil).
func (c *Cache) find(sh *shard, h *kv.Hash, rank uint32) (uint32, bool) {
	if sh == nil {
		return Nil, false
	}
	i, ok := sh.m[c.tableKey(h)]
	for ok && i != Nil {
		o := c.objs.get(i)
		if o.rank == rank && sameHash(&o.hash, h) {
			return i, true
		}
		i = o.coll
	}
	return Nil, false
}

// findRanks sets out[r] to the resident object (h, r) of sh for every rank
// r < len(out), Nil where absent, with one map probe.
func (c *Cache) findRanks(sh *shard, h *kv.Hash, out []uint32) {
	for r := range out {
		out[r] = Nil
	}
	if sh == nil {
		return
	}
	i, ok := sh.m[c.tableKey(h)]
	for ok && i != Nil {
		o := c.objs.get(i)
		if o.rank < uint32(len(out)) && sameHash(&o.hash, h) {
			out[o.rank] = i
		}
		i = o.coll
	}
}

// insert adds resident object i to its shard's table.
func (c *Cache) insert(i uint32) {
	o := c.objs.get(i)
	sh := &c.shards[o.shard]
	k := c.tableKey(&o.hash)
	o.coll = Nil
	if head, ok := sh.m[k]; ok {
		o.coll = head
	}
	sh.m[k] = i
}

// unlink removes resident object i from its shard's table.
func (c *Cache) unlink(i uint32) {
	o := c.objs.get(i)
	sh := &c.shards[o.shard]
	k := c.tableKey(&o.hash)
	head := sh.m[k]
	if head == i {
		if o.coll == Nil {
			delete(sh.m, k)
		} else {
			sh.m[k] = o.coll
		}
		return
	}
	for p := head; p != Nil; p = c.objs.get(p).coll {
		if po := c.objs.get(p); po.coll == i {
			po.coll = o.coll
			return
		}
	}
}

const arenaShift = 12

// arena stores objects in fixed chunks so indices stay valid as it grows.
type arena struct {
	chunks [][]object
	free   []uint32
	n      uint32
}

func (a *arena) get(i uint32) *object {
	return &a.chunks[i>>arenaShift][i&(1<<arenaShift-1)]
}

func (a *arena) new() uint32 {
	if k := len(a.free); k > 0 {
		i := a.free[k-1]
		a.free = a.free[:k-1]
		return i
	}
	if int(a.n>>arenaShift) == len(a.chunks) {
		a.chunks = append(a.chunks, make([]object, 1<<arenaShift))
	}
	i := a.n
	a.n++
	return i
}

func (a *arena) release(i uint32) {
	*a.get(i) = object{}
	a.free = append(a.free, i)
}

// lru is a doubly linked list through object.prev/next; head is the most
// recently used.
type lru struct{ head, tail uint32 }

func (l *lru) init() { l.head, l.tail = Nil, Nil }

func (l *lru) pushHead(a *arena, i uint32) {
	o := a.get(i)
	o.prev, o.next = Nil, l.head
	if l.head != Nil {
		a.get(l.head).prev = i
	} else {
		l.tail = i
	}
	l.head = i
}

func (l *lru) remove(a *arena, i uint32) {
	o := a.get(i)
	if o.prev != Nil {
		a.get(o.prev).next = o.next
	} else {
		l.head = o.next
	}
	if o.next != Nil {
		a.get(o.next).prev = o.prev
	} else {
		l.tail = o.prev
	}
	o.prev, o.next = Nil, Nil
}

// placeAfter moves i right after at (at = Nil: to the head). Moving a
// sequence to the front is a run of placeAfter(previous, next); when the
// sequence is already there (a repeated hit) each step only reads i.prev.
func (l *lru) placeAfter(a *arena, at, i uint32) {
	if at == i {
		return
	}
	o := a.get(i)
	if at == Nil {
		if l.head != i {
			l.remove(a, i)
			l.pushHead(a, i)
		}
		return
	}
	if o.prev == at {
		return
	}
	l.remove(a, i)
	ao := a.get(at)
	o.prev, o.next = at, ao.next
	if ao.next != Nil {
		a.get(ao.next).prev = i
	} else {
		l.tail = i
	}
	ao.next = i
}
