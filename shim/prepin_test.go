package shim

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server"
)

// GPU workers register L1 segments with the driver as they are announced,
// in the background, not on a copy's path. These tests run in the fake
// CUDA driver's child (TestWorkerOnFakeCUDA); the fake counts live host
// registrations but cannot time a real cuMemHostRegister.

// prefaultRig is newRig's one-rank connector over a server of 1 MiB of L1
// in 64 KiB segments that keeps prefault bytes ready ahead of use.
func prefaultRig(t *testing.T, prefault uint64) *rig {
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk}
	return newRigWith(t, ns, func(cfg *server.Config) {
		cfg.L1SizeGB, cfg.SegmentSize, cfg.SlabSize = 1.0/1024, 64<<10, 64<<10
		cfg.L1PrefaultGB = float64(prefault) / server.GiB
	}, nil)
}

// workerClient is the worker's current session.
func workerClient(t *testing.T, w *Worker) *ipc.Client {
	t.Helper()
	w.link.mu.Lock()
	defer w.link.mu.Unlock()
	assert.Assert(t, w.link.c != nil, "the worker has no session")
	return w.link.c
}

// TestFakeCUDAPinsAnnouncedSegmentsAhead: once a GPU worker has a session,
// every L1 segment the server announces (prepared at start-up, then a
// watermark ahead of use as L1 fills) is registered in the background
// before any copy uses it: saves that land in later segments register
// nothing on their path.
func TestFakeCUDAPinsAnnouncedSegmentsAhead(t *testing.T) {
	d := fakeDriver(t)
	r := prefaultRig(t, 128<<10) // two segments ahead
	w := r.workers[0]
	_, saved := saveChunks(t, r, "first", tokensOf(7, 0), 2)
	assert.Equal(t, saved, 2)
	c := workerClient(t, w)
	segs := func() uint64 { return uint64(c.Segments().Len()) }
	testkit.Eventually(t, 10*time.Second, "every announced segment registered", func() bool {
		return segs() >= 3 && d.Stats().Registrations == segs()
	})
	// The first save's resolve saw the session first: at most its own
	// segment was registered on the copy's path.
	assert.Assert(t, w.pins.copyPins.Load() <= 1, "copy-path registrations: %d", w.pins.copyPins.Load())

	// 40 more saves of 2 chunks (4 KiB slots): 320 KiB, five segments.
	// The server prepares the next segments in the background as free
	// space shrinks (under load it can lag: then a save lands in a segment
	// it creates on demand, announced with the ALLOC's answer, and the copy
	// registers it; that is the server's timing, not what this test is
	// about). So each save waits until a whole prepared segment is free
	// for its slab and every announced segment is registered: the worker's
	// part, registering ahead of the copies, is what is asserted.
	stat := func(name string) uint64 { v, _ := r.srv.Core.Stat(name); return uint64(v) }
	for i := range 40 {
		want := segs()
		testkit.Eventually(t, 10*time.Second, "a free segment prepared, every segment announced and registered", func() bool {
			mapped := stat("kvshim_l1_mapped_bytes")
			return mapped-stat("kvshim_l1_slab_bytes") >= 64<<10 && segs()*64<<10 >= mapped &&
				d.Stats().Registrations == segs() && segs() >= want
		})
		_, saved := saveChunks(t, r, fmt.Sprintf("s%d", i), tokensOf(11, uint32(i)+1), 2)
		assert.Equal(t, saved, 2)
	}
	// The server prepares and announces the next segment in the background:
	// the last saves may have finished before it (1 run in ~10 under load,
	// once lookups became direct calls and the loop got faster).
	testkit.Eventually(t, 10*time.Second, "L1 grown to 7 segments", func() bool { return segs() >= 7 })
	// The pinner counts a registration just after the driver records it:
	// wait for both, or the counters can lag the driver by one.
	testkit.Eventually(t, 10*time.Second, "the last announced segments registered and counted", func() bool {
		return d.Stats().Registrations == segs() && w.pins.bgPins.Load()+w.pins.copyPins.Load() == segs()
	})
	t.Logf("%d segments: %d registered in the background, %d by a copy", segs(), w.pins.bgPins.Load(), w.pins.copyPins.Load())
	assert.Assert(t, w.pins.copyPins.Load() <= 1, "copy-path registrations: %d", w.pins.copyPins.Load())
	assert.Assert(t, w.pins.bgPins.Load() >= segs()-1)
	assert.Equal(t, d.Stats().Violations, uint64(0), d.Stats().LastViolation)
}

// TestFakeCUDAPinnerWatchAtDial: a pinner that watches a session from the
// moment it is dialled has every prepared segment registered before the
// first copy; closing the session unregisters them before they are
// unmapped (the fake checks).
func TestFakeCUDAPinnerWatchAtDial(t *testing.T) {
	d := fakeDriver(t)
	r := prefaultRig(t, 192<<10) // three segments
	eng, err := cuda.NewDeviceEngine(0)
	assert.NilError(t, err)
	p := &pinner{eng: eng, done: map[*ipc.Segment]bool{}}
	before := d.Stats()
	c, err := ipc.Dial(r.cfg.Socket, ipc.Hello{Version: ipc.ProtocolVersion, Role: ipc.RoleWorker, PID: uint32(os.Getpid()), Instance: uuid.New()}, 5*time.Second)
	assert.NilError(t, err)
	p.watch(c)
	// The pinner counts a registration just after the driver records it
	// (bgPins is added once RegisterHost has returned): wait for both, or
	// the pinner's count can lag the driver's by one (2 != 3, 2 runs in 30
	// under load with -cpu 1).
	testkit.Eventually(t, 10*time.Second, "three segments registered and counted", func() bool {
		return d.Stats().Registrations-before.Registrations == 3 && p.bgPins.Load() == 3
	})
	assert.Equal(t, c.Segments().Len(), 3)
	assert.Equal(t, d.Stats().Copies, before.Copies, "no copy ran")
	assert.Equal(t, p.bgPins.Load(), uint64(3))
	// A copy's pin finds its segment registered.
	assert.NilError(t, p.pin(c, ipc.Loc{Segment: 2, Offset: 0, Size: 4096}))
	assert.Equal(t, p.copyPins.Load(), uint64(0))

	c.Close()
	<-c.Freed()
	testkit.Eventually(t, 10*time.Second, "the segments unregistered", func() bool { return d.Stats().Registrations == before.Registrations })
	assert.NilError(t, eng.Close())
	assert.Equal(t, d.Stats().Violations, uint64(0), d.Stats().LastViolation)
}

// TestPinnerWatchForgetsEndedSessions: watching a session that ends, then
// a new one, leaves one subscription. The server prepares nothing (lazy)
// and nothing is allocated, so no segment is queued for this pinner, which
// has no engine.
func TestPinnerWatchForgetsEndedSessions(t *testing.T) {
	r := prefaultRig(t, 0)
	p := &pinner{done: map[*ipc.Segment]bool{}}
	dial := func() *ipc.Client {
		c, err := ipc.Dial(r.cfg.Socket, ipc.Hello{Version: ipc.ProtocolVersion, Role: ipc.RoleWorker, PID: uint32(os.Getpid()), Instance: uuid.New()}, 5*time.Second)
		assert.NilError(t, err)
		return c
	}
	a := dial()
	p.watch(a)
	p.watch(a)
	assert.Equal(t, len(p.watched), 1)
	a.Close()
	<-a.Done()
	b := dial()
	defer b.Close()
	p.watch(b)
	assert.Equal(t, len(p.watched), 1)
	_, ok := p.watched[b]
	assert.Assert(t, ok)
}
