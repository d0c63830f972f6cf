package shim

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/internal/fakecuda"
	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/server"
)

// The connector tests with "GPU" KV caches: TestWorkerOnFakeCUDA re-runs
// them in a child whose CUDA driver is internal/fakecuda, so the worker
// takes its DeviceEngine path (pinning L1 segments, stream-ordered copies)
// and the fake checks the rules a real driver would punish silently: copies
// only from registered host memory, segments unregistered before they are
// unmapped. TestMain fails the child on any breach or leftover.

// kvDeviceEnv selects the rig's KV cache device: unset = CPU, "cuda:0" =
// memory the fake driver treats as device memory.
const kvDeviceEnv = "KVSHIM_TEST_KV_DEVICE"

func TestMain(m *testing.M) {
	if role := os.Getenv(chaosRoleEnv); role != "" {
		os.Exit(chaosChild(role))
	}
	os.Exit(fakecuda.Main(m))
}

func TestWorkerOnFakeCUDA(t *testing.T) {
	fakecuda.SkipWithoutCompiler(t)
	lib, err := fakecuda.Build(t.TempDir(), 2)
	assert.NilError(t, err)
	out := fakecuda.Run(t, lib, "^(TestConnector|TestFakeCUDA)", kvDeviceEnv+"=cuda:0")
	assert.Check(t, is.Contains(out, "--- PASS: TestConnectorSaveThenRestoreIntoOtherBlocks"))
	assert.Check(t, is.Contains(out, "--- PASS: TestFakeCUDAServerRestart"))
	assert.Check(t, is.Contains(out, "--- PASS: TestFakeCUDALayerwiseLoad"))
	assert.Check(t, is.Contains(out, "--- PASS: TestFakeCUDALayerwiseCopyFails"))
	assert.Check(t, is.Contains(out, "--- PASS: TestFakeCUDALayerwiseSave"))
	assert.Check(t, is.Contains(out, "--- PASS: TestFakeCUDALayerwiseSaveCopyFails"))
}

// kvDevice is the device the rig's KV caches claim to be on; for cuda:0
// their memory is adopted by the fake driver as device memory.
func kvDevice(t testing.TB, mem []byte) layout.Device {
	dev := layout.Device{Kind: layout.CPU}
	if os.Getenv(kvDeviceEnv) == "" {
		return dev
	}
	dev, err := layout.ParseDevice(os.Getenv(kvDeviceEnv))
	assert.NilError(t, err)
	d := fakeDriver(t)
	d.Adopt(addrOf(mem), uint64(len(mem)))
	t.Cleanup(func() { d.Unadopt(addrOf(mem)) })
	return dev
}

func fakeDriver(t testing.TB) *fakecuda.Driver {
	t.Helper()
	if os.Getenv(kvDeviceEnv) == "" {
		t.Skip("needs the fake CUDA driver: TestWorkerOnFakeCUDA runs this test")
	}
	assert.NilError(t, cuda.Init())
	d, ok := fakecuda.Open()
	assert.Assert(t, ok, "%s is not the fake driver", os.Getenv(fakecuda.LibraryEnv))
	t.Cleanup(func() { d.Reset(0) })
	return d
}

func holds(t *testing.T, srv *server.Server) float64 {
	t.Helper()
	mfs, err := srv.Core.Registry().Gather()
	assert.NilError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "kvshim_l1_holds" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no kvshim_l1_holds metric")
	return 0
}

// tokensOf is a prompt of 3 chunks: tokens mul*i + add.
func tokensOf(mul, add uint32) []uint32 {
	tokens := make([]uint32, 3*tChunk)
	for i := range tokens {
		tokens[i] = mul*uint32(i) + add
	}
	return tokens
}

// saveChunks saves the first chunks of tokens from blocks 0.. of rank 0
// and returns the blocks and how many chunks were saved.
func saveChunks(t testing.TB, r *rig, req string, tokens []uint32, chunks int) ([]int64, int) {
	t.Helper()
	blocks := seq(0, chunks*tChunk/tBS)
	for _, b := range blocks {
		r.caches[0].fill(int(b), 5)
	}
	assert.Equal(t, r.match(t, req, tokens, Extras{}, 0), 0)
	assert.NilError(t, r.sched.AfterAlloc(req, blocks, 1, 0, 0))
	saved := r.workers[0].Stats().SavedChunks
	r.step(t, &Step{Requests: []StepRequest{{Req: req, Blocks: blocks, Scheduled: chunks * tChunk}}})
	r.sched.Finished(req)
	return blocks, int(r.workers[0].Stats().SavedChunks - saved)
}

// saveAfterRestart saves the first chunks of tokens once the worker has
// redialled a new server (at most once a second), under request names
// prefix0, prefix1, ...; it returns saveChunks' blocks.
func saveAfterRestart(t *testing.T, r *rig, prefix string, tokens []uint32, chunks int) []int64 {
	t.Helper()
	for i := 0; ; i++ {
		assert.Assert(t, i < 50, "no save after the restart")
		time.Sleep(100 * time.Millisecond)
		if src, saved := saveChunks(t, r, fmt.Sprint(prefix, i), tokens, chunks); saved == chunks {
			return src
		}
	}
}

// TestFakeCUDAServerRestart: when the server goes away, the worker
// unregisters the dead session's L1 segments before they are unmapped, and
// pins the new server's segments; saves and loads work again.
func TestFakeCUDAServerRestart(t *testing.T) {
	d := fakeDriver(t)
	r := newRig(t, 1)
	tokens := tokensOf(3, 1)
	_, saved := saveChunks(t, r, "A", tokens, 2)
	assert.Equal(t, saved, 2)
	assert.Assert(t, d.Stats().Registrations > 0, "%+v", d.Stats())

	assert.NilError(t, r.srv.Close())
	srv, err := server.Start(r.cfg, nil, server.Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { srv.Close() })
	r.srv = srv
	testkit.EventuallyShowing(t, 10*time.Second, "the old segments to be unregistered", func() bool { return d.Stats().Registrations == 0 },
		func() string { return fmt.Sprintf("%+v", d.Stats()) })

	// The new server is empty. Once the worker has redialled (at most once
	// a second) a save lands in the new segments, then a hit is restored.
	src := saveAfterRestart(t, r, "B", tokens, 2)
	assert.Assert(t, d.Stats().Registrations > 0, "%+v", d.Stats())
	n := r.match(t, "C", tokens, Extras{}, 0)
	assert.Equal(t, n, 2*tChunk)
	dst := seq(40, 4)
	assert.NilError(t, r.sched.AfterAlloc("C", dst, 1, -1, n))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv["C"], 1)
	assert.Equal(t, len(errs), 0)
	for k := range dst {
		assert.Assert(t, bytes.Equal(r.caches[0].block(1, int(dst[k])), r.caches[0].block(1, int(src[k]))), "block %d", k)
	}
	assert.Equal(t, d.Stats().Violations, uint64(0), d.Stats().LastViolation)
}

// TestFakeCUDASlowCopy: a load slower than the timeout fails (vLLM
// recomputes), but the worker reports it and releases its holds only once
// the copy has stopped; a copy that never stops keeps its holds.
func TestFakeCUDASlowCopy(t *testing.T) {
	d := fakeDriver(t)
	r := newRig(t, 1)
	tokens := tokensOf(5, 2)
	_, saved := saveChunks(t, r, "A", tokens, 2)
	assert.Equal(t, saved, 2)
	w := r.workers[0]
	w.cfg.Timeout = 100 * time.Millisecond
	const delay = 150 * time.Millisecond // per copy; a load is several copies

	load := func(req string) (copiesAtReport uint64, errs []int64) {
		n := r.match(t, req, tokens, Extras{}, 0)
		assert.Equal(t, n, 2*tChunk)
		assert.NilError(t, r.sched.AfterAlloc(req, seq(20, 4), 1, -1, n))
		d.Reset(delay)
		recv, errs := r.step(t, &Step{})
		assert.Equal(t, recv[req], 1)
		return d.Stats().Copies, errs
	}

	before := d.Stats().Copies
	copies, errs := load("B")
	assert.Equal(t, len(errs), 4, "the timed-out load's blocks are load errors")
	time.Sleep(3 * delay)
	assert.Equal(t, d.Stats().Copies, copies, "a copy ran after the load was reported")
	assert.Equal(t, holds(t, r.srv), 0.0)

	old := copyStuckAfter
	copyStuckAfter = 10 * time.Millisecond
	t.Cleanup(func() { copyStuckAfter = old })
	_, errs = load("C")
	assert.Equal(t, len(errs), 4)
	assert.Assert(t, holds(t, r.srv) > 0, "holds released while the copy may still read the objects")
	// Let the stuck copy end before the test unmaps the cache it writes.
	testkit.Eventually(t, 10*time.Second, "the stuck copy to end", func() bool { return d.Stats().Copies-copies >= copies-before })
}

// TestFakeCUDASaveWaitsForStreamEvent: the save of a step copies what the
// forward pass wrote, however late its kernel finishes: the save stream
// waits for the event Python passes, which may be destroyed as soon as
// StartSaves returns (torch frees it with the Python object).
func TestFakeCUDASaveWaitsForStreamEvent(t *testing.T) {
	d := fakeDriver(t)
	r := newRig(t, 1)
	c, w := r.caches[0], r.workers[0]
	tokens := tokensOf(11, 3)
	blocks := seq(0, 4)
	for _, b := range blocks {
		c.fill(int(b), 1)
	}
	// The forward pass writes layer 0's K of blocks 0-3 (contiguous), late.
	kBytes := 4 * tBS * tHeads * tHead * 2
	fresh, err := unix.Mmap(-1, 0, kBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	assert.NilError(t, err)
	t.Cleanup(func() { unix.Munmap(fresh) })
	for i := range fresh {
		fresh[i] = byte(i*7 + 1)
	}

	m := r.prefillStep(t, "A", tokens, blocks)
	ev := d.VLLMWrite(addrOf(c.mem), addrOf(fresh), uint64(kBytes), 300*time.Millisecond)
	w.StartSaves(m, ev)
	d.DestroyEvent(ev)
	w.wg.Wait()
	assert.Equal(t, w.Stats().SavedChunks, uint64(2))
	r.sched.Finished("A")

	// Restore into other blocks: layer 0's K is what the forward pass wrote.
	n := r.match(t, "B", tokens, Extras{}, 0)
	assert.Equal(t, n, 2*tChunk)
	dst := seq(40, 4)
	assert.NilError(t, r.sched.AfterAlloc("B", dst, 1, -1, n))
	_, errs := r.step(t, &Step{})
	assert.Equal(t, len(errs), 0)
	bb := kBytes / 4
	for k, blk := range dst {
		got := c.block(0, int(blk))[:bb] // K of layer 0
		assert.Assert(t, bytes.Equal(got, fresh[k*bb:(k+1)*bb]), "block %d: the save did not wait for the forward pass", k)
	}
}
