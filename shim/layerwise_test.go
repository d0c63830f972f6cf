package shim

import (
	"bytes"
	"errors"
	"slices"
	"testing"
	"time"

	"gotest.tools/v3/assert"
)

// lwRig saves 3 chunks of request A from blocks 0.. and looks B up over the
// same tokens; it returns the rig, B's metadata for the worker and B's
// destination blocks.
func lwRig(t *testing.T) (*rig, *StepMeta, []int64, []int64) {
	r := newRig(t, 1)
	tokens := tokensOf(11, 5)
	src, saved := saveChunks(t, r, "A", tokens, 3)
	assert.Equal(t, saved, 3)
	_, _ = r.step(t, &Step{}) // A's delay-free report
	n := r.match(t, "B", tokens, Extras{}, 0)
	assert.Equal(t, n, 3*tChunk-1)
	dst := seq(30, len(src))
	assert.NilError(t, r.sched.AfterAlloc("B", dst, 1, -1, n))
	b, err := r.sched.BuildMeta(&Step{Requests: []StepRequest{{Req: "B", Blocks: dst, Computed: n, Scheduled: 1}}})
	assert.NilError(t, err)
	w := r.workers[0]
	m, err := DecodeStepMeta(b, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
	assert.NilError(t, err)
	assert.Equal(t, len(m.Loads), 1)
	return r, m, src, dst
}

// sameBlocks reports whether every layer of dst[i] holds src[i]'s bytes.
func sameBlocks(c *rankCache, src, dst []int64) bool {
	for i := range src {
		for l := range tLayers {
			if !bytes.Equal(c.block(l, int(src[i])), c.block(l, int(dst[i]))) {
				return false
			}
		}
	}
	return true
}

// On the CPU engine: a layer-wise load restores every byte, is not
// reported received (vLLM loaded it synchronously), and WaitLayer of an
// unknown layer name waits for all of it.
func TestLayerwiseLoadBytesExact(t *testing.T) {
	r, m, src, dst := lwRig(t)
	w := r.workers[0]
	assert.Assert(t, !sameBlocks(r.caches[0], src, dst))
	w.StartLoadsLayered(m)
	assert.NilError(t, w.WaitLayer("layer0", 5*time.Second))
	assert.NilError(t, w.WaitLayer("layer1", 5*time.Second))
	assert.NilError(t, w.WaitLayer("not a layer", 5*time.Second))
	assert.NilError(t, w.WaitLayers(5*time.Second))
	assert.Assert(t, sameBlocks(r.caches[0], src, dst))
	w.wg.Wait()
	sending, recving, errBlocks := w.Poll()
	assert.Equal(t, len(recving), 0)
	assert.Equal(t, len(errBlocks), 0)
	_ = sending
	assert.Equal(t, w.Stats().LayerwiseLoads, uint64(1))
	assert.Equal(t, w.Stats().LoadedChunks, uint64(3))
	// A step without loads: no wait.
	w.StartLoadsLayered(&StepMeta{})
	assert.NilError(t, w.WaitLayer("layer0", time.Millisecond))
}

// With the emulated driver's copies delayed, the first layer is released
// while the last layer's copies are still queued; then every byte is in
// place. A failed copy of the last layer makes every chunk a load error,
// reported before WaitLayers returns.
func TestFakeCUDALayerwiseLoad(t *testing.T) {
	d := fakeDriver(t)
	r, m, src, dst := lwRig(t)
	w := r.workers[0]
	d.Reset(20 * time.Millisecond) // per queued copy
	w.StartLoadsLayered(m)
	assert.NilError(t, w.WaitLayer("layer0", 10*time.Second))
	err := w.WaitLayer("layer1", 0)
	assert.Assert(t, errors.Is(err, ErrLayerTimeout), "the last layer was done with the first: %v", err)
	assert.NilError(t, w.WaitLayer("layer1", 10*time.Second))
	assert.NilError(t, w.WaitLayers(10*time.Second))
	assert.Assert(t, sameBlocks(r.caches[0], src, dst))
	w.wg.Wait()
	_, recving, errBlocks := w.Poll()
	assert.Equal(t, len(recving)+len(errBlocks), 0)
	d.Reset(0)
}

// A layer whose copy fails (the emulated driver fails layer 1's batch when
// it executes: one batch per layer here): every chunk of the load is a
// load error, in Poll once WaitLayers has returned, while layer 0 was
// released as loaded.
func TestFakeCUDALayerwiseCopyFails(t *testing.T) {
	d := fakeDriver(t)
	r, m, _, dst := lwRig(t)
	w := r.workers[0]
	d.Reset(5 * time.Millisecond)
	d.Inject("cuMemcpyBatchAsync_v2", 2, 1, true) // the load's second copy call: layer 1's
	w.StartLoadsLayered(m)
	assert.NilError(t, w.WaitLayer("layer0", 10*time.Second))
	assert.NilError(t, w.WaitLayers(10*time.Second))
	w.wg.Wait()
	_, recving, errBlocks := w.Poll()
	assert.Equal(t, len(recving), 0)
	slices.Sort(errBlocks)
	assert.DeepEqual(t, errBlocks, dst)
	assert.Equal(t, w.Stats().LoadedChunks, uint64(0))
	d.Reset(0)
}
