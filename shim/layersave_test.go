package shim

import (
	"bytes"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
)

// lsRig binds a step that saves 2 chunks of request A from blocks 0-3 of
// rank 0 (filled with seed 1) and returns the rig, the step's metadata,
// A's tokens and blocks.
func lsRig(t *testing.T, mul uint32) (*rig, *StepMeta, []uint32, []int64) {
	r := newRig(t, 1)
	c := r.caches[0]
	tokens := tokensOf(mul, 7)
	blocks := seq(0, 4)
	for _, b := range blocks {
		c.fill(int(b), 1)
	}
	m := r.prefillStep(t, "A", tokens, blocks)
	assert.Equal(t, len(m.Saves), 1)
	return r, m, tokens, blocks
}

// prefillStep has req miss over tokens, take blocks and be scheduled for
// two chunks; returns that step's metadata as worker 0 decodes it.
func (r *rig) prefillStep(t *testing.T, req string, tokens []uint32, blocks []int64) *StepMeta {
	t.Helper()
	assert.Equal(t, r.match(t, req, tokens, Extras{}, 0), 0)
	assert.NilError(t, r.sched.AfterAlloc(req, blocks, 1, 0, 0))
	b, err := r.sched.BuildMeta(&Step{Requests: []StepRequest{{Req: req, Blocks: blocks, Scheduled: 2 * tChunk}}})
	assert.NilError(t, err)
	w := r.workers[0]
	m, err := DecodeStepMeta(b, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
	assert.NilError(t, err)
	return m
}

// restoreAs looks tokens up as req, loads the hit into blocks 40.. and
// returns them (nil on a miss).
func restoreAs(t *testing.T, r *rig, req string, tokens []uint32) []int64 {
	t.Helper()
	n := r.match(t, req, tokens, Extras{}, 0)
	if n == 0 {
		r.sched.Finished(req)
		return nil
	}
	assert.Equal(t, n, 2*tChunk)
	dst := seq(40, 4)
	assert.NilError(t, r.sched.AfterAlloc(req, dst, 1, -1, n))
	_, errs := r.step(t, &Step{})
	assert.Equal(t, len(errs), 0)
	return dst
}

// On the CPU engine: layer 0's copy is submitted as soon as SaveLayer marks
// it, before the forward pass has written layer 1; layer 1 is copied only
// once marked (it holds what was written after layer 0's save began); a
// name that is not a registered tensor starts nothing; StartSaves ends the
// step and the chunks restore byte for byte.
func TestLayerwiseSaveBytesExact(t *testing.T) {
	r, m, tokens, src := lsRig(t, 13)
	c, w := r.caches[0], r.workers[0]
	spans := w.Stats().CopySpans
	w.SaveLayer(m, "not a layer", 0)
	time.Sleep(20 * time.Millisecond)
	assert.Equal(t, w.Jobs(), int64(0), "an unknown layer started a save")
	w.SaveLayer(m, "layer0", 0)
	testkit.Eventually(t, 10*time.Second, "layer 0's copy before layer 1 is written", func() bool { return w.Stats().CopySpans > spans })
	// The forward pass writes layer 1 now (K and V of each block), while
	// layer 0's copy may still run.
	layer, bb := 2*tBlocks*tBS*tHeads*tHead*2, tBS*tHeads*tHead*2
	for _, b := range src {
		for _, off := range []int{layer + int(b)*bb, layer + layer/2 + int(b)*bb} {
			for k := range bb {
				c.mem[off+k] = byte(int(b)*31 + k*7 + 1)
			}
		}
	}
	want1 := make([][]byte, len(src))
	for i, b := range src {
		want1[i] = c.block(1, int(b))
	}
	w.SaveLayer(m, "layer1", 0)
	w.StartSaves(m, 0) // wait_for_save: ends the step
	w.wg.Wait()
	st := w.Stats()
	assert.Equal(t, st.SavedChunks, uint64(2))
	assert.Equal(t, st.LayerwiseSaves, uint64(1))
	assert.Equal(t, st.FailedSaves, uint64(0))
	r.sched.Finished("A")

	dst := restoreAs(t, r, "B", tokens)
	assert.Assert(t, dst != nil, "nothing committed")
	for i, b := range dst {
		assert.Assert(t, bytes.Equal(c.block(0, int(b)), c.block(0, int(src[i]))), "layer 0 of block %d", i)
		assert.Assert(t, bytes.Equal(c.block(1, int(b)), want1[i]), "layer 1 of block %d: not what the forward pass wrote", i)
	}
}

// A step whose wait_for_save never comes commits nothing: its saves abort
// what they staged after layerSaveWait, and the prompt stays a miss; so
// does a step superseded by the next step's SaveLayer.
func TestLayerwiseSaveAbandoned(t *testing.T) {
	old := layerSaveWait
	layerSaveWait = 50 * time.Millisecond
	t.Cleanup(func() { layerSaveWait = old })
	r, m, tokens, _ := lsRig(t, 17)
	w := r.workers[0]
	w.SaveLayer(m, "layer0", 0)
	w.wg.Wait()
	st := w.Stats()
	assert.Equal(t, st.SavedChunks, uint64(0))
	assert.Equal(t, st.FailedSaves, uint64(2))
	r.sched.Finished("A")
	assert.Assert(t, restoreAs(t, r, "B", tokens) == nil, "a chunk committed with a layer never written")

	layerSaveWait = old
	r2, m2, _, _ := lsRig(t, 19)
	w2 := r2.workers[0]
	w2.SaveLayer(m2, "layer0", 0)
	w2.SaveLayer(&StepMeta{Saves: m2.Saves}, "layer0", 0) // the next step, no wait_for_save between
	done := make(chan struct{})
	go func() { w2.wg.Wait(); close(done) }()
	w2.Close() // abandons the second step
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("saves still running after Close")
	}
	assert.Equal(t, w2.Stats().SavedChunks, uint64(0))
	r2.sched.Finished("A")
}

// With the emulated driver's copies delayed: layer 0's copies have executed
// before layer 1 is even marked; layer 1 is written late by vLLM's stream
// (the save stream waits for its event) and its bytes are what the restore
// gives back.
func TestFakeCUDALayerwiseSave(t *testing.T) {
	d := fakeDriver(t)
	r, m, tokens, src := lsRig(t, 23)
	c, w := r.caches[0], r.workers[0]
	d.Reset(20 * time.Millisecond) // per queued copy
	copies := d.Stats().Copies
	w.SaveLayer(m, "layer0", 0)
	testkit.Eventually(t, 10*time.Second, "layer 0's copies before layer 1 is written", func() bool { return d.Stats().Copies > copies })
	// Layer 1's K of blocks 0-3 (contiguous), written late on vLLM's stream.
	layer := 2 * tBlocks * tBS * tHeads * tHead * 2
	kBytes := len(src) * tBS * tHeads * tHead * 2
	pin, err := unix.Mmap(-1, 0, kBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	assert.NilError(t, err)
	t.Cleanup(func() { unix.Munmap(pin) })
	for i := range pin {
		pin[i] = byte(i*5 + 3)
	}
	ev := d.VLLMWrite(addrOf(c.mem)+uint64(layer), addrOf(pin), uint64(kBytes), 200*time.Millisecond)
	w.SaveLayer(m, "layer1", ev)
	d.DestroyEvent(ev)
	w.StartSaves(m, 0)
	w.wg.Wait()
	d.Reset(0)
	assert.Equal(t, w.Stats().SavedChunks, uint64(2))
	r.sched.Finished("A")
	dst := restoreAs(t, r, "B", tokens)
	assert.Assert(t, dst != nil)
	bb := kBytes / len(src)
	for k, b := range dst {
		assert.Assert(t, bytes.Equal(c.block(1, int(b))[:bb], pin[k*bb:(k+1)*bb]), "block %d: layer 1 saved before vLLM wrote it", k)
		assert.Assert(t, bytes.Equal(c.block(0, int(b)), c.block(0, int(src[k]))), "layer 0 of block %d", k)
	}
	assert.Equal(t, d.Stats().Violations, uint64(0), d.Stats().LastViolation)
}

// A layer whose copy fails (the save's second copy call: layer 1's) aborts
// every chunk of the save: nothing is committed, the prompt stays a miss.
func TestFakeCUDALayerwiseSaveCopyFails(t *testing.T) {
	d := fakeDriver(t)
	r, m, tokens, _ := lsRig(t, 29)
	w := r.workers[0]
	d.Reset(5 * time.Millisecond)
	d.Inject("cuMemcpyBatchAsync_v2", 2, 1, true)
	w.SaveLayer(m, "layer0", 0)
	w.SaveLayer(m, "layer1", 0)
	w.StartSaves(m, 0)
	w.wg.Wait()
	d.Reset(0)
	st := w.Stats()
	assert.Equal(t, st.SavedChunks, uint64(0))
	assert.Equal(t, st.FailedSaves, uint64(2))
	r.sched.Finished("A")
	assert.Assert(t, restoreAs(t, r, "B", tokens) == nil, "a chunk committed with a layer not copied")
}
