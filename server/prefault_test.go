package server

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/ipc"
)

// readyHeap is a readySource over heap memory that records every segment
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

func (h *readyHeap) readyAhead() uint64 { return h.ahead }

func (h *readyHeap) make(id uint32, size uint64) ([]byte, error) {
	if _, dup := h.made[id]; dup {
		return nil, errors.New("segment id made twice")
	}
	h.made[id] = size
	h.total += size
	return make([]byte, size), nil
}

func (h *readyHeap) prepare(id uint32, size uint64) error {
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
	if err := faultIn(-1, mem); err != nil {
		return err
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

func (h *readyHeap) onClose(f func()) {
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

// eventually polls cond until it holds or 10 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for: %s", what)
		}
		time.Sleep(2 * time.Millisecond)
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
	eventually(t, "two segments prepared at start-up", func() bool { p, _, _ := h.snapshot(); return len(p) == 2 })
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
	eventually(t, "segment 3 prepared in the background", func() bool { p, _, _ := h.snapshot(); return len(p) == 3 })
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
	eventually(t, "the grower preparing segment 1", func() bool {
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
	eventually(t, "the failed attempt", func() bool { h.mu.Lock(); defer h.mu.Unlock(); return h.fail == 0 })
	_, _, ok, err := a.alloc(seg)
	assert.NilError(t, err)
	assert.Assert(t, ok)
	p, c, _ = h.snapshot()
	assert.DeepEqual(t, p, []uint32{1})
	assert.DeepEqual(t, c, []uint32{2})
	close(h.gate)
	eventually(t, "segment 3 prepared after the retry delay", func() bool { p, _, _ := h.snapshot(); return len(p) == 2 })
	p, _, _ = h.snapshot()
	assert.DeepEqual(t, p, []uint32{1, 3})
}

// TestPrefaultNeverExceedsCapacity: under concurrent allocs and frees
// (the store's lock around the allocator), with a capacity that is not a
// multiple of the segment size and a watermark past it, the bytes made
// never exceed the capacity, ids are 1..n, and every segment made is one
// the allocator adopts or holds ready.
func TestPrefaultNeverExceedsCapacity(t *testing.T) {
	const seg = 128 << 10
	const capacity = 5*seg + 3*pageSize
	for _, ahead := range []uint64{pageSize, seg, 3 * seg, capacity} {
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
			if _, _, ok, _ := a.alloc(pageSize); !ok {
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
				want = 3 * pageSize
			}
			assert.Equal(t, h.made[id], want, "segment %d", id)
		}
		h.mu.Unlock()
	}
}

// startPrefaultServer starts a memfd server of l1 MiB in 1 MiB segments
// preparing prefault MiB ahead.
func startPrefaultServer(t *testing.T, l1, prefault float64) (*Server, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvs")
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := DefaultConfig()
	cfg.L1SizeGB = l1 / 1024
	cfg.L1PrefaultGB = prefault / 1024
	cfg.SegmentSize = 1 << 20
	cfg.SlabSize = 256 << 10
	cfg.Socket = filepath.Join(dir, "run", "kvshim.sock")
	srv, err := Start(cfg, nil, Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, srv.Close()) })
	return srv, cfg.Socket
}

// allocated is the bytes of a segment's file that have pages.
func allocated(t *testing.T, seg *ipc.Segment) uint64 {
	t.Helper()
	var st unix.Stat_t
	assert.NilError(t, unix.Fstat(seg.Fd(), &st))
	return uint64(st.Blocks) * 512
}

func allocObjects(t *testing.T, c *ipc.Client, seed string, n int, size uint64) *ipc.AllocResp {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sz := make([]uint64, n)
	for i := range sz {
		sz[i] = size
	}
	r, err := c.Alloc(ctx, &ipc.AllocReq{Tag: ipc.Tag(uuid.New()), Namespace: ns1, Hashes: hashes(seed, n), Sizes: sz})
	assert.NilError(t, err)
	for _, s := range r.Status {
		assert.Equal(t, s, ipc.StatusOK)
	}
	return r
}

// TestPrefaultServerAnnouncesFaultedSegmentsBeforeAlloc: a server started
// with --l1-prefault-gb has that much L1 created, with every page
// allocated, and announced to a client before anyone ALLOCs; then the
// watermark holds: no more segments while nothing is used, and more, from
// the background, once ALLOCs eat into it.
func TestPrefaultServerAnnouncesFaultedSegmentsBeforeAlloc(t *testing.T) {
	srv, path := startPrefaultServer(t, 8, 3)
	c := dial(t, path, ipc.RoleWorker)
	eventually(t, "3 segments announced", func() bool { return c.Segments().Len() == 3 })
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, c.Segments().Len(), 3, "more than the prefault before any ALLOC")
	for _, seg := range c.Segments().Segments() {
		assert.Equal(t, seg.Size(), uint64(1<<20))
		assert.Equal(t, allocated(t, seg), seg.Size(), "segment %d not faulted in", seg.ID())
	}
	assert.Equal(t, stat(t, srv.Store, "kvshim_l1_segments"), 3.0)
	assert.Equal(t, stat(t, srv.Store, "kvshim_l1_mapped_bytes"), float64(3<<20))
	assert.Equal(t, stat(t, srv.Store, "kvshim_l1_used_bytes"), 0.0)

	// Use 1.5 MiB: free (1.5 MiB) is below the 3 MiB watermark, so two
	// more segments come, faulted, without another ALLOC.
	r := allocObjects(t, c, "a", 6, 256<<10)
	for _, l := range r.Locs {
		assert.Assert(t, l.Segment <= 2)
	}
	eventually(t, "the refill", func() bool { return c.Segments().Len() == 5 })
	for _, seg := range c.Segments().Segments() {
		assert.Equal(t, allocated(t, seg), seg.Size(), "segment %d not faulted in", seg.ID())
	}
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, c.Segments().Len(), 5)
	g := srv.Store.mem.ahead
	g.mu.Lock()
	assert.Equal(t, g.prepared, uint64(5), "every segment came from the grower")
	g.mu.Unlock()
}

// TestPrefaultServerRespectsL1Size: a prefault past the L1 size makes the
// L1 size, in segments that add up to it exactly.
func TestPrefaultServerRespectsL1Size(t *testing.T) {
	srv, path := startPrefaultServer(t, 2.5, 1024)
	c := dial(t, path, ipc.RoleWorker)
	eventually(t, "all of L1 announced", func() bool { return c.Segments().Len() == 3 })
	time.Sleep(50 * time.Millisecond)
	var total uint64
	for _, seg := range c.Segments().Segments() {
		total += seg.Size()
		assert.Equal(t, allocated(t, seg), seg.Size())
	}
	assert.Equal(t, c.Segments().Len(), 3)
	assert.Equal(t, total, uint64(5<<19))
	assert.Equal(t, stat(t, srv.Store, "kvshim_l1_mapped_bytes"), float64(5<<19))
	// Filling it adopts the prepared segments; nothing more is created.
	allocObjects(t, c, "fill", 10, 256<<10)
	assert.Equal(t, c.Segments().Len(), 3)
	assert.Equal(t, stat(t, srv.Store, "kvshim_l1_mapped_bytes"), float64(5<<19))
}

// TestPrefaultZeroIsLazy: --l1-prefault-gb 0 keeps today's L1: nothing
// exists until an ALLOC needs it, which creates one segment, unfaulted.
func TestPrefaultZeroIsLazy(t *testing.T) {
	srv, path := startPrefaultServer(t, 8, 0)
	assert.Assert(t, srv.Store.mem.ahead == nil)
	c := dial(t, path, ipc.RoleWorker)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, c.Segments().Len(), 0)
	assert.Equal(t, stat(t, srv.Store, "kvshim_l1_segments"), 0.0)
	r := allocObjects(t, c, "lazy", 1, 4096)
	b, err := c.Resolve(r.Locs[0])
	assert.NilError(t, err)
	assert.Equal(t, len(b), 4096)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, c.Segments().Len(), 1)
	seg, _ := c.Segments().Get(1)
	assert.Assert(t, allocated(t, seg) < seg.Size(), "a lazy segment was faulted in")
}

func TestPrefaultConfig(t *testing.T) {
	for _, v := range []float64{-1, MaxL1SizeGB + 1} {
		cfg := DefaultConfig()
		cfg.L1PrefaultGB = v
		assert.ErrorContains(t, cfg.Validate(), "--l1-prefault-gb must be >= 0")
	}
	cfg := DefaultConfig()
	assert.Equal(t, cfg.prefaultBytes(), uint64(DefaultL1PrefaultGB*GiB))
	cfg.L1SizeGB = 1
	assert.NilError(t, cfg.Validate())
	assert.Equal(t, cfg.prefaultBytes(), uint64(GiB), "capped at the L1 size")
	cfg.L1PrefaultGB = 0.001
	assert.Equal(t, cfg.prefaultBytes(), roundPage(uint64(cfg.L1PrefaultGB*GiB)))
}
