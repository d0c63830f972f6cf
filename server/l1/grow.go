package l1

import (
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// ReadySource is a SegmentSource that can make segments ready ahead of
// demand: created, faulted in and announced to clients before the cache
// needs them, so that neither the request that first uses a segment nor
// the clients' registration of it (cuMemHostRegister) waits on page faults.
// server.IPCSource is one (server.Config.L1PrefaultGB).
type ReadySource interface {
	SegmentSource
	// ReadyAhead is how many bytes of L1 to keep free and ready ahead of
	// use; 0 leaves growth lazy. Read once, when the cache is created.
	ReadyAhead() uint64
	// Prepare creates segment id of size bytes, faults its memory in and
	// announces it, without handing it out: the NewSegment(id, size) that
	// follows, under the cache owner's lock, returns it. It is called from
	// the grower's goroutine, never under that lock, and never for an id
	// NewSegment already created.
	Prepare(id uint32, size uint64) error
	// OnClose registers f to run first thing in Close, before any segment
	// is unmapped (the grower stops there).
	OnClose(f func())
}

// retryAfter is how long the grower waits after a failed segment before it
// tries again (the ALLOC that finds no space still tries at once).
var retryAfter = time.Second

// grower keeps L1 ready ahead of use for a ReadySource: from the start it
// prepares segments in the background until `ahead` bytes exist, and
// whenever the free part of the segments that exist (ready or in use)
// falls below `ahead`, the next one, up to the capacity and never past it.
// Segments are prepared one at a time, in id order; the allocator adopts
// them in that order (take), so ids and sizes are the ones lazy growth
// would have given them. The allocator calls take and used under the
// cache owner's lock; the grower never takes that lock.
type grower struct {
	src                      ReadySource
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

func newGrower(src ReadySource, capacity, segSize, ahead uint64) *grower {
	g := &grower{src: src, capacity: capacity, segSize: segSize, ahead: ahead, nextID: 1,
		kick: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
	g.cond.L = &g.mu
	src.OnClose(g.stop)
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

// take is called (under the cache owner's lock) before the allocator creates
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

	err := g.src.Prepare(id, size)

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
