package l1

import (
	"fmt"
	"slices"
)

// PageSize is the L1 alignment: every object starts on a 4 KiB boundary.
const PageSize = 4096

// Nil is the index of no object (an empty hold slot, a list end).
const Nil = ^uint32(0)

// extent is a free byte range of a segment.
type extent struct{ off, len uint64 }

type segment struct {
	id   uint32
	mem  []byte
	free []extent // sorted by offset, coalesced
}

// slab is a run of equal slots of one size class inside one segment.
type slab struct {
	seg     uint32 // segment id
	off     uint64 // first slot's offset in the segment
	class   *sizeClass
	slots   uint32
	used    uint32
	bump    uint32   // slots [bump, slots) have never been handed out
	free    []uint32 // freed slots, reused first
	partial int      // index in class.partial, -1 when full
}

// sizeClass groups slabs whose slots have one size (a multiple of 4 KiB).
type sizeClass struct {
	size    uint64
	partial []uint32 // slab ids with a free slot
	slabs   int
}

// allocator hands out 4 KiB-aligned slots from per-size-class slabs carved
// out of segments created on demand, or ahead of it (ReadySource). It is
// not safe for concurrent use (the Cache's owner guards it); its grower
// runs on its own goroutine.
type allocator struct {
	src        SegmentSource
	capacity   uint64
	segSize    uint64
	slabTarget uint64
	onSegment  func(id uint32, mem []byte)
	ahead      *grower // nil: lazy growth only

	segs      []*segment // index = id-1
	slabs     []*slab    // index = slab id
	freeSlabs []uint32
	classes   map[uint64]*sizeClass

	mapped    uint64 // bytes of all segments
	slabBytes uint64 // bytes carved into slabs
	usedBytes uint64 // slot bytes of live objects
	maxUsed   uint64 // high-water mark of usedBytes
	reqBytes  uint64 // requested bytes of live objects
}

func newAllocator(src SegmentSource, capacity, segSize, slabTarget uint64) *allocator {
	a := &allocator{
		src: src, capacity: capacity, segSize: segSize, slabTarget: slabTarget,
		classes: map[uint64]*sizeClass{},
	}
	if rs, ok := src.(ReadySource); ok && rs.ReadyAhead() > 0 {
		a.ahead = newGrower(rs, capacity, segSize, rs.ReadyAhead())
	}
	return a
}

// RoundPage rounds n up to a whole number of pages: an object's slot size.
func RoundPage(n uint64) uint64 { return (n + PageSize - 1) &^ (PageSize - 1) }

// maxObject is the largest object the allocator can place.
func (a *allocator) maxObject() uint64 { return a.segSize }

// alloc reserves a slot for size bytes. ok is false when no memory is free
// (the caller may evict and retry); err reports a segment source failure.
func (a *allocator) alloc(size uint64) (slabID, slot uint32, ok bool, err error) {
	csize := RoundPage(size)
	c := a.classes[csize]
	if c == nil {
		c = &sizeClass{size: csize}
		a.classes[csize] = c
	}
	if len(c.partial) == 0 {
		id, ok, err := a.newSlab(c)
		if !ok || err != nil {
			if c.slabs == 0 {
				delete(a.classes, csize)
			}
			return 0, 0, false, err
		}
		c.partial = append(c.partial, id)
		a.slabs[id].partial = len(c.partial) - 1
	}
	slabID = c.partial[len(c.partial)-1]
	s := a.slabs[slabID]
	if n := len(s.free); n > 0 {
		slot = s.free[n-1]
		s.free = s.free[:n-1]
	} else {
		slot = s.bump
		s.bump++
	}
	s.used++
	if s.used == s.slots {
		c.partial = c.partial[:len(c.partial)-1]
		s.partial = -1
	}
	a.usedBytes += csize
	a.maxUsed = max(a.maxUsed, a.usedBytes)
	a.reqBytes += size
	if a.ahead != nil {
		a.ahead.used(a.usedBytes)
	}
	return slabID, slot, true, nil
}

// free returns a slot. An empty slab goes back to its segment.
func (a *allocator) free(slabID, slot uint32, size uint64) {
	s := a.slabs[slabID]
	c := s.class
	s.used--
	a.usedBytes -= c.size
	a.reqBytes -= size
	if a.ahead != nil {
		a.ahead.usedBytes.Store(a.usedBytes)
	}
	if s.used == 0 {
		a.dropSlab(slabID)
		return
	}
	s.free = append(s.free, slot)
	if s.partial < 0 {
		c.partial = append(c.partial, slabID)
		s.partial = len(c.partial) - 1
	}
}

// loc returns the segment id and offset of a slot.
func (a *allocator) loc(slabID, slot uint32) (seg uint32, off uint64) {
	s := a.slabs[slabID]
	return s.seg, s.off + uint64(slot)*s.class.size
}

// bytes returns the memory of a slot (size bytes).
func (a *allocator) bytes(slabID, slot uint32, size uint64) []byte {
	seg, off := a.loc(slabID, slot)
	return a.segs[seg-1].mem[off : off+size : off+size]
}

// newSlab carves a slab for class c: from a free extent, else from a new
// segment while L1 is below capacity.
func (a *allocator) newSlab(c *sizeClass) (uint32, bool, error) {
	if c.size > a.segSize {
		return 0, false, nil
	}
	want := max(a.slabTarget/c.size, 1)
	for _, sg := range a.segs {
		if s, ok := a.carve(sg, c, want); ok {
			return s, true, nil
		}
	}
	for a.capacity-a.mapped >= c.size {
		sg, err := a.grow()
		if err != nil {
			return 0, false, err
		}
		if s, ok := a.carve(sg, c, want); ok {
			return s, true, nil
		}
	}
	return 0, false, nil
}

// grow maps one more segment (its size bounded by what is left of L1):
// the next one the grower made ready, or one created now.
func (a *allocator) grow() (*segment, error) {
	size := min(a.segSize, a.capacity-a.mapped)
	id := uint32(len(a.segs) + 1)
	prepared := false
	if a.ahead != nil {
		var err error
		if prepared, err = a.ahead.take(id, size); err != nil {
			return nil, err
		}
	}
	mem, err := a.src.NewSegment(id, size)
	if a.ahead != nil && !prepared {
		a.ahead.created(size, err == nil && uint64(len(mem)) >= size)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: segment %d (%d bytes): %w", ErrSegment, id, size, err)
	}
	if uint64(len(mem)) < size {
		return nil, fmt.Errorf("%w: segment %d: got %d bytes, want %d", ErrSegment, id, len(mem), size)
	}
	sg := &segment{id: id, mem: mem[:size:size], free: []extent{{0, size}}}
	a.segs = append(a.segs, sg)
	a.mapped += size
	if a.onSegment != nil {
		a.onSegment(id, sg.mem)
	}
	return sg, nil
}

// carve takes up to want slots of class c from the first extent of sg that
// holds at least one slot (best: one that holds all of them).
func (a *allocator) carve(sg *segment, c *sizeClass, want uint64) (uint32, bool) {
	best := -1
	for i, e := range sg.free {
		if e.len >= want*c.size {
			best = i
			break
		}
		if e.len >= c.size && (best < 0 || e.len > sg.free[best].len) {
			best = i
		}
	}
	if best < 0 {
		return 0, false
	}
	e := &sg.free[best]
	n := min(want, e.len/c.size)
	bytes := n * c.size
	s := &slab{seg: sg.id, off: e.off, class: c, slots: uint32(n), partial: -1}
	e.off += bytes
	e.len -= bytes
	if e.len == 0 {
		sg.free = slices.Delete(sg.free, best, best+1)
	}
	var id uint32
	if k := len(a.freeSlabs); k > 0 {
		id = a.freeSlabs[k-1]
		a.freeSlabs = a.freeSlabs[:k-1]
		a.slabs[id] = s
	} else {
		id = uint32(len(a.slabs))
		a.slabs = append(a.slabs, s)
	}
	c.slabs++
	a.slabBytes += bytes
	return id, true
}

// dropSlab returns an empty slab's bytes to its segment.
func (a *allocator) dropSlab(id uint32) {
	s := a.slabs[id]
	c := s.class
	if s.partial >= 0 {
		last := c.partial[len(c.partial)-1]
		c.partial[s.partial] = last
		a.slabs[last].partial = s.partial
		c.partial = c.partial[:len(c.partial)-1]
	}
	c.slabs--
	if c.slabs == 0 {
		delete(a.classes, c.size)
	}
	bytes := uint64(s.slots) * c.size
	a.slabBytes -= bytes
	a.segs[s.seg-1].release(extent{s.off, bytes})
	a.slabs[id] = nil
	a.freeSlabs = append(a.freeSlabs, id)
}

// release puts e back into the free list, merging with its neighbours.
func (sg *segment) release(e extent) {
	i, _ := slices.BinarySearchFunc(sg.free, e.off, func(x extent, off uint64) int {
		switch {
		case x.off < off:
			return -1
		case x.off > off:
			return 1
		}
		return 0
	})
	if i > 0 && sg.free[i-1].off+sg.free[i-1].len == e.off {
		sg.free[i-1].len += e.len
		if i < len(sg.free) && e.off+e.len == sg.free[i].off {
			sg.free[i-1].len += sg.free[i].len
			sg.free = slices.Delete(sg.free, i, i+1)
		}
		return
	}
	if i < len(sg.free) && e.off+e.len == sg.free[i].off {
		sg.free[i].off = e.off
		sg.free[i].len += e.len
		return
	}
	sg.free = slices.Insert(sg.free, i, e)
}

// allocStats is the allocator's accounting.
type allocStats struct {
	Capacity, Mapped, Slab, Used, Requested uint64
	Segments, Slabs, Classes                int
}

// Mapped and Segments count the segments made ready ahead of use too.
func (a *allocator) stats() allocStats {
	st := allocStats{
		Capacity: a.capacity, Mapped: a.mapped, Slab: a.slabBytes,
		Used: a.usedBytes, Requested: a.reqBytes,
		Segments: len(a.segs), Slabs: len(a.slabs) - len(a.freeSlabs), Classes: len(a.classes),
	}
	if a.ahead != nil {
		n, bytes := a.ahead.readyNow()
		st.Segments += n
		st.Mapped += bytes
	}
	return st
}
