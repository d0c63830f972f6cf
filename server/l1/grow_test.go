package l1

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
)

// readyHeap is a ReadySource over heap memory that records every segment
// it made and how (prepared ahead, or created by NewSegment).
type readyHeap struct {
	ahead uint64
	gate  chan struct{} // when set, each prepare waits for a value
	quit  chan struct{} // closed by Close

	mu       sync.Mutex
	ready    map[uint32][]byte
	made     map[uint32]uint64 // id -> size, every segment made
	total    uint64            // bytes made
	prepared []uint32          // ids, in order
	created  []uint32          // ids NewSegment created itself
	fail     int               // prepares left to fail
	closers  []func()
	closed   bool
}

func newReadyHeap(ahead uint64) *readyHeap {
	return &readyHeap{ahead: ahead, quit: make(chan struct{}), ready: map[uint32][]byte{}, made: map[uint32]uint64{}}
}

func (h *readyHeap) ReadyAhead() uint64 { return h.ahead }

func (h *readyHeap) make(id uint32, size uint64) ([]byte, error) {
	if _, dup := h.made[id]; dup {
		return nil, errors.New("segment id made twice")
	}
	h.made[id] = size
	h.total += size
	return make([]byte, size), nil
}

func (h *readyHeap) Prepare(id uint32, size uint64) error {
	if h.gate != nil {
		select {
		case <-h.gate:
		case <-h.quit:
			return errors.New("closed")
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return errors.New("prepare after Close")
	}
	if h.fail > 0 {
		h.fail--
		return errors.New("injected prepare failure")
	}
	mem, err := h.make(id, size)
	if err != nil {
		return err
	}
	for off := 0; off < len(mem); off += PageSize { // fault it in
		mem[off] = 0
	}
	h.ready[id] = mem
	h.prepared = append(h.prepared, id)
	return nil
}

func (h *readyHeap) NewSegment(id uint32, size uint64) ([]byte, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if mem, ok := h.ready[id]; ok {
		delete(h.ready, id)
		return mem, nil
	}
	h.created = append(h.created, id)
	return h.make(id, size)
}

func (h *readyHeap) OnClose(f func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closers = append(h.closers, f)
}

func (h *readyHeap) Close() error {
	h.mu.Lock()
	fs := h.closers
	if !h.closed {
		close(h.quit)
	}
	h.closed = true
	h.mu.Unlock()
	for _, f := range fs {
		f()
	}
	return nil
}

func (h *readyHeap) snapshot() (prepared, created []uint32, total uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]uint32(nil), h.prepared...), append([]uint32(nil), h.created...), h.total
}

// open lets one prepare of h through (failing t after 10 s).
func (h *readyHeap) open(t *testing.T) {
	t.Helper()
	select {
	case h.gate <- struct{}{}:
	case <-time.After(10 * time.Second):
		t.Fatal("no prepare came")
	}
}

// TestPrefaultAllocatorStartsAheadAndRefills: the allocator prepares its
// first `ahead` bytes before any alloc, adopts them in id order, and once
// the free part falls below the watermark prepares the next segment in the
// background: an alloc that fits never waits for it.
func TestPrefaultAllocatorStartsAheadAndRefills(t *testing.T) {
	const seg = 256 << 10
	h := newReadyHeap(2 * seg)
	a := newAllocator(h, 8*seg, seg, 64<<10)
	defer h.Close()
	testkit.Eventually(t, 10*time.Second, "two segments prepared at start-up", func() bool { p, _, _ := h.snapshot(); return len(p) == 2 })
	time.Sleep(20 * time.Millisecond)
	p, c, _ := h.snapshot()
	assert.DeepEqual(t, p, []uint32{1, 2})
	assert.Equal(t, len(c), 0)
	st := a.stats()
	assert.Equal(t, st.Segments, 2)
	assert.Equal(t, st.Mapped, uint64(2*seg))

	// Block the grower, then use more than the watermark allows: allocs
	// that fit the prepared segments return while it is blocked.
	h.gate = make(chan struct{})
	var announced []uint32
	a.onSegment = func(id uint32, _ []byte) { announced = append(announced, id) }
	for range 20 { // 20 × 8 KiB in segment 1: free is 352 KiB, below 512
		_, _, ok, err := a.alloc(8 << 10)
		assert.NilError(t, err)
		assert.Assert(t, ok)
	}
	assert.DeepEqual(t, announced, []uint32{1})
	p, c, _ = h.snapshot()
	assert.DeepEqual(t, p, []uint32{1, 2})
	assert.Equal(t, len(c), 0, "an alloc created a segment")
	close(h.gate) // the refill
	testkit.Eventually(t, 10*time.Second, "segment 3 prepared in the background", func() bool { p, _, _ := h.snapshot(); return len(p) == 3 })
	p, c, _ = h.snapshot()
	assert.DeepEqual(t, p, []uint32{1, 2, 3})
	assert.Equal(t, len(c), 0)
	time.Sleep(20 * time.Millisecond) // free is 3 segments less 160 KiB: above the watermark
	p, _, _ = h.snapshot()
	assert.Equal(t, len(p), 3)
}

// TestPrefaultTakeWaitsForPreparation: an alloc that needs the segment the
// grower is preparing waits for it rather than creating another; when the
// grower fails, the alloc creates the segment itself (the last resort) and
// the grower tries again later.
func TestPrefaultTakeWaitsForPreparation(t *testing.T) {
	const seg = 64 << 10
	old := retryAfter
	retryAfter = 50 * time.Millisecond
	t.Cleanup(func() { retryAfter = old })
	h := newReadyHeap(seg)
	h.gate = make(chan struct{})
	a := newAllocator(h, 4*seg, seg, seg)
	defer h.Close()
	testkit.Eventually(t, 10*time.Second, "the grower preparing segment 1", func() bool {
		a.ahead.mu.Lock()
		defer a.ahead.mu.Unlock()
		return a.ahead.busy
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _, ok, err := a.alloc(seg)
		assert.Check(t, err == nil && ok)
	}()
	select {
	case <-done:
		t.Fatal("alloc did not wait for the segment being prepared")
	case <-time.After(30 * time.Millisecond):
	}
	h.open(t)
	<-done
	p, c, _ := h.snapshot()
	assert.DeepEqual(t, p, []uint32{1})
	assert.Equal(t, len(c), 0)

	// Segment 2: the grower fails; the alloc creates it.
	h.mu.Lock()
	h.fail = 1
	h.mu.Unlock()
	h.open(t) // the failing attempt (kicked by the alloc above)
	testkit.Eventually(t, 10*time.Second, "the failed attempt", func() bool { h.mu.Lock(); defer h.mu.Unlock(); return h.fail == 0 })
	_, _, ok, err := a.alloc(seg)
	assert.NilError(t, err)
	assert.Assert(t, ok)
	p, c, _ = h.snapshot()
	assert.DeepEqual(t, p, []uint32{1})
	assert.DeepEqual(t, c, []uint32{2})
	close(h.gate)
	testkit.Eventually(t, 10*time.Second, "segment 3 prepared after the retry delay", func() bool { p, _, _ := h.snapshot(); return len(p) == 2 })
	p, _, _ = h.snapshot()
	assert.DeepEqual(t, p, []uint32{1, 3})
}

// TestPrefaultNeverExceedsCapacity: under concurrent allocs and frees
// (the core's lock around the allocator), with a capacity that is not a
// multiple of the segment size and a watermark past it, the bytes made
// never exceed the capacity, ids are 1..n, and every segment made is one
// the allocator adopts or holds ready.
func TestPrefaultNeverExceedsCapacity(t *testing.T) {
	const seg = 128 << 10
	const capacity = 5*seg + 3*PageSize
	for _, ahead := range []uint64{PageSize, seg, 3 * seg, capacity} {
		h := newReadyHeap(ahead)
		a := newAllocator(h, capacity, seg, 32<<10)
		var mu sync.Mutex
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(g), ahead))
				type live struct {
					slab, slot uint32
					size       uint64
				}
				var lv []live
				for range 400 {
					mu.Lock()
					if len(lv) > 0 && rng.IntN(3) == 0 {
						i := rng.IntN(len(lv))
						a.free(lv[i].slab, lv[i].slot, lv[i].size)
						lv = append(lv[:i], lv[i+1:]...)
					} else {
						size := uint64(rng.IntN(24<<10) + 1)
						s, sl, ok, err := a.alloc(size)
						assert.Check(t, err)
						if ok {
							lv = append(lv, live{s, sl, size})
						}
					}
					mu.Unlock()
					if rng.IntN(50) == 0 {
						time.Sleep(time.Millisecond)
					}
				}
			}()
		}
		wg.Wait()
		// Fill L1: every byte becomes a segment, none past the capacity.
		mu.Lock()
		for {
			if _, _, ok, _ := a.alloc(PageSize); !ok {
				break
			}
		}
		st := a.stats()
		mu.Unlock()
		assert.NilError(t, h.Close())
		_, _, total := h.snapshot()
		assert.Equal(t, total, uint64(capacity), "ahead %d", ahead)
		assert.Equal(t, st.Mapped, uint64(capacity))
		h.mu.Lock()
		assert.Equal(t, len(h.made), 6)
		for id := uint32(1); id <= 6; id++ {
			want := uint64(seg)
			if id == 6 {
				want = 3 * PageSize
			}
			assert.Equal(t, h.made[id], want, "segment %d", id)
		}
		h.mu.Unlock()
	}
}
