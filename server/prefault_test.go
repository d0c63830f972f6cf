package server

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l1"
)

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
	r, err := c.Alloc(ctx, &ipc.AllocReq{Tag: kv.Tag(uuid.New()), Namespace: ns1, Hashes: hashes(seed, n), Sizes: sz})
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
	testkit.Eventually(t, 10*time.Second, "3 segments announced", func() bool { return c.Segments().Len() == 3 })
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, c.Segments().Len(), 3, "more than the prefault before any ALLOC")
	for _, seg := range c.Segments().Segments() {
		assert.Equal(t, seg.Size(), uint64(1<<20))
		assert.Equal(t, allocated(t, seg), seg.Size(), "segment %d not faulted in", seg.ID())
	}
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_segments"), 3.0)
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_mapped_bytes"), float64(3<<20))
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_used_bytes"), 0.0)

	// Use 1.5 MiB: free (1.5 MiB) is below the 3 MiB watermark, so two
	// more segments come, faulted, without another ALLOC.
	r := allocObjects(t, c, "a", 6, 256<<10)
	for _, l := range r.Locs {
		assert.Assert(t, l.Segment <= 2)
	}
	testkit.Eventually(t, 10*time.Second, "the refill", func() bool { return c.Segments().Len() == 5 })
	for _, seg := range c.Segments().Segments() {
		assert.Equal(t, allocated(t, seg), seg.Size(), "segment %d not faulted in", seg.ID())
	}
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, c.Segments().Len(), 5)
	srv.Core.mu.Lock()
	on, prepared, _, _ := srv.Core.l1.Growth()
	srv.Core.mu.Unlock()
	assert.Assert(t, on)
	assert.Equal(t, prepared, uint64(5), "every segment came from the grower")
}

// TestPrefaultServerRespectsL1Size: a prefault past the L1 size makes the
// L1 size, in segments that add up to it exactly.
func TestPrefaultServerRespectsL1Size(t *testing.T) {
	srv, path := startPrefaultServer(t, 2.5, 1024)
	c := dial(t, path, ipc.RoleWorker)
	testkit.Eventually(t, 10*time.Second, "all of L1 announced", func() bool { return c.Segments().Len() == 3 })
	time.Sleep(50 * time.Millisecond)
	var total uint64
	for _, seg := range c.Segments().Segments() {
		total += seg.Size()
		assert.Equal(t, allocated(t, seg), seg.Size())
	}
	assert.Equal(t, c.Segments().Len(), 3)
	assert.Equal(t, total, uint64(5<<19))
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_mapped_bytes"), float64(5<<19))
	// Filling it adopts the prepared segments; nothing more is created.
	allocObjects(t, c, "fill", 10, 256<<10)
	assert.Equal(t, c.Segments().Len(), 3)
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_mapped_bytes"), float64(5<<19))
}

// TestPrefaultZeroIsLazy: --l1-prefault-gb 0 keeps today's L1: nothing
// exists until an ALLOC needs it, which creates one segment, unfaulted.
func TestPrefaultZeroIsLazy(t *testing.T) {
	srv, path := startPrefaultServer(t, 8, 0)
	srv.Core.mu.Lock()
	on, _, _, _ := srv.Core.l1.Growth()
	srv.Core.mu.Unlock()
	assert.Assert(t, !on)
	c := dial(t, path, ipc.RoleWorker)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, c.Segments().Len(), 0)
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_segments"), 0.0)
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
	assert.Equal(t, cfg.prefaultBytes(), l1.RoundPage(uint64(cfg.L1PrefaultGB*GiB)))
}
