package server

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// pageSize is the L1 alignment: every object starts on a 4 KiB boundary.
const pageSize = 4096

const nilIdx = ^uint32(0)

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
// out of segments created on demand, or ahead of it (readySource). It is
// not safe for concurrent use (the store's mutex guards it); its grower
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
	if rs, ok := src.(readySource); ok && rs.readyAhead() > 0 {
		a.ahead = newGrower(rs, capacity, segSize, rs.readyAhead())
	}
	return a
}

func roundPage(n uint64) uint64 { return (n + pageSize - 1) &^ (pageSize - 1) }

// maxObject is the largest object the allocator can place.
func (a *allocator) maxObject() uint64 { return a.segSize }

// alloc reserves a slot for size bytes. ok is false when no memory is free
// (the caller may evict and retry); err reports a segment source failure.
func (a *allocator) alloc(size uint64) (slabID, slot uint32, ok bool, err error) {
	csize := roundPage(size)
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
		return nil, fmt.Errorf("%w: segment %d (%d bytes): %v", ErrSegment, id, size, err)
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

// readySource is a SegmentSource that can make segments ready ahead of
// demand: created, faulted in and announced to clients before the store
// needs them, so that neither the request that first uses a segment nor
// the clients' registration of it (cuMemHostRegister) waits on page faults.
// IPCSource is one (Config.L1PrefaultGB).
type readySource interface {
	SegmentSource
	// readyAhead is how many bytes of L1 to keep free and ready ahead of
	// use; 0 leaves growth lazy. Read once, when the store is created.
	readyAhead() uint64
	// prepare creates segment id of size bytes, faults its memory in and
	// announces it, without handing it out: the NewSegment(id, size) that
	// follows, under the store's lock, returns it. It is called from the
	// grower's goroutine, never under the store's lock, and never for an id
	// NewSegment already created.
	prepare(id uint32, size uint64) error
	// onClose registers f to run first thing in Close, before any segment
	// is unmapped (the grower stops there).
	onClose(f func())
}

// retryAfter is how long the grower waits after a failed segment before it
// tries again (the ALLOC that finds no space still tries at once).
var retryAfter = time.Second

// grower keeps L1 ready ahead of use for a readySource: from the start it
// prepares segments in the background until `ahead` bytes exist, and
// whenever the free part of the segments that exist (ready or in use)
// falls below `ahead`, the next one, up to the capacity and never past it.
// Segments are prepared one at a time, in id order; the allocator adopts
// them in that order (take), so ids and sizes are the ones lazy growth
// would have given them. The allocator calls take and used under the
// store's lock; the grower never takes that lock.
type grower struct {
	src                      readySource
	capacity, segSize, ahead uint64

	usedBytes atomic.Uint64 // the allocator's usedBytes, published
	reserved  atomic.Uint64 // bytes of every segment prepared, preparing or adopted
	kick      chan struct{} // capacity 1: "look at the watermark"
	quit      chan struct{}
	done      chan struct{}
	stopOnce  sync.Once

	mu       sync.Mutex
	cond     sync.Cond // broadcast when a preparation ends
	nextID   uint32    // the next id to prepare or create
	adopted  uint32    // segments 1..adopted are the allocator's
	ready    []uint64  // sizes of prepared, not yet adopted segments (ids adopted+1, ...)
	busy     bool      // a segment is being prepared or created
	closed   bool
	retry    time.Time // no background preparation before (after a failure)
	prepared uint64    // segments prepared in the background (tests)
}

func newGrower(src readySource, capacity, segSize, ahead uint64) *grower {
	g := &grower{src: src, capacity: capacity, segSize: segSize, ahead: ahead, nextID: 1,
		kick: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
	g.cond.L = &g.mu
	src.onClose(g.stop)
	g.kick <- struct{}{} // start-up: prepare the first `ahead` bytes
	go g.run()
	return g
}

// used publishes the allocator's bytes in use and wakes the grower when
// the free part of L1 that exists has fallen below the watermark.
func (g *grower) used(n uint64) {
	g.usedBytes.Store(n)
	if r := g.reserved.Load(); r < g.capacity && r-n < g.ahead {
		select {
		case g.kick <- struct{}{}:
		default:
		}
	}
}

// readyNow is the number and bytes of segments prepared and not adopted.
func (g *grower) readyNow() (n int, bytes uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, sz := range g.ready {
		bytes += sz
	}
	return len(g.ready), bytes
}

// take is called (under the store's lock) before the allocator creates
// segment id of size bytes with NewSegment. prepared: the grower has
// prepared it (waiting for a preparation in progress), and NewSegment
// returns it. Otherwise the caller creates it now, unfaulted, as lazy
// growth does (the last resort), and reports how that went with created.
func (g *grower) take(id uint32, size uint64) (prepared bool, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for g.busy && len(g.ready) == 0 {
		g.cond.Wait()
	}
	if id != g.adopted+1 {
		return false, fmt.Errorf("%w: segment %d is not the next one (%d)", ErrSegment, id, g.adopted+1)
	}
	if len(g.ready) > 0 {
		if g.ready[0] != size {
			return false, fmt.Errorf("%w: segment %d: prepared %d bytes, want %d", ErrSegment, id, g.ready[0], size)
		}
		g.ready = g.ready[1:]
		g.adopted++
		return true, nil
	}
	g.nextID++
	g.reserved.Add(size)
	g.busy = true // the grower stays away until created
	return false, nil
}

// created ends a take that was not prepared: ok when NewSegment made the
// segment (else its id and bytes are free again).
func (g *grower) created(size uint64, ok bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.busy = false
	g.cond.Broadcast()
	if ok {
		g.adopted++
		return
	}
	g.nextID--
	g.reserved.Add(-size)
}

// stop ends the background preparation (waiting for one in progress).
func (g *grower) stop() {
	g.stopOnce.Do(func() {
		g.mu.Lock()
		g.closed = true
		g.cond.Broadcast()
		g.mu.Unlock()
		close(g.quit)
		<-g.done
	})
}

func (g *grower) run() {
	defer close(g.done)
	var retry <-chan time.Time // after a failure: look again then
	for {
		select {
		case <-g.kick:
		case <-retry:
		case <-g.quit:
			return
		}
		retry = nil
		for {
			did, wait := g.prepareNext()
			if wait > 0 {
				retry = time.After(wait)
			}
			if !did {
				break
			}
			select {
			case <-g.quit:
				return
			default:
			}
		}
	}
}

// prepareNext prepares one segment when the watermark asks for one and
// reports whether it did; wait > 0: it would have, but a failure was too
// recent (try again after wait).
func (g *grower) prepareNext() (did bool, wait time.Duration) {
	g.mu.Lock()
	r := g.reserved.Load()
	if g.closed || g.busy || r >= g.capacity || r-g.usedBytes.Load() >= g.ahead {
		g.mu.Unlock()
		return false, 0
	}
	if d := time.Until(g.retry); d > 0 {
		g.mu.Unlock()
		return false, d
	}
	id, size := g.nextID, min(g.segSize, g.capacity-r)
	g.nextID++
	g.reserved.Add(size)
	g.busy = true
	g.mu.Unlock()

	err := g.src.prepare(id, size)

	g.mu.Lock()
	defer g.mu.Unlock()
	g.busy = false
	g.cond.Broadcast()
	if err != nil {
		// Nothing took the id meanwhile (busy): give it back.
		g.nextID--
		g.reserved.Add(-size)
		g.retry = time.Now().Add(retryAfter)
		if !g.closed {
			slog.Warn("kvshim: preparing an L1 segment ahead of use failed; retrying later", "segment", id, "bytes", size, "err", err)
		}
		return false, retryAfter
	}
	g.ready = append(g.ready, size)
	g.prepared++
	return true, 0
}

// faultIn allocates the pages of a new shared segment before anyone uses
// it. fallocate on its file is the cheapest way measured
// (BenchmarkFaultInMethods on a 2-core VM: 0.30-0.39 s per GiB, against
// 0.57-1.2 for MADV_POPULATE_WRITE, 0.59-1.35 for a write to every page and
// 0.95-2.1 for a MAP_POPULATE mapping): one pass in the kernel, no page
// tables, and the pages are then there for every mapping of the file, the
// clients' included; a client's first touch of a page (or its
// cuMemHostRegister) maps it instead of allocating and zeroing it. Where
// the file system cannot fallocate, or there is no file (fd < 0), it
// populates the mapping (Linux 5.14), else writes a zero to every page: the
// segment holds no object yet.
func faultIn(fd int, mem []byte) error {
	if fd >= 0 && len(mem) > 0 {
		err := unix.Fallocate(fd, 0, 0, int64(len(mem)))
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("fallocate %d bytes: %w", len(mem), err)
		}
	}
	if len(mem) == 0 {
		return nil
	}
	err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("madvise(MADV_POPULATE_WRITE) %d bytes: %w", len(mem), err)
	}
	for off := 0; off < len(mem); off += pageSize {
		mem[off] = 0
	}
	return nil
}
