package shim

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
)

// The load pipeline (each chunk's copy starts once that chunk is checked)
// and saves that free vLLM's blocks before their COMMIT. These run on the
// host engine and, through TestWorkerOnFakeCUDA, on the CUDA engine.

// hookEngine wraps the worker's engine to watch, fail or hold copy jobs.
type hookEngine struct {
	cuda.Engine
	mu    sync.Mutex
	loads int // load Submits so far
	// onLoad runs at each load Submit (k: 0, 1, ...): a non-nil err fails
	// the Submit, a non-nil job replaces the submitted one, a non-nil gate
	// holds the job's completion until it is closed.
	onLoad func(k int) (err error, failJob error, gate chan struct{})
}

func (e *hookEngine) Submit(spans []kv.Span, dir kv.Direction) (cuda.Job, error) {
	var err, failJob error
	var gate chan struct{}
	if dir == kv.Load {
		e.mu.Lock()
		k := e.loads
		e.loads++
		e.mu.Unlock()
		if e.onLoad != nil {
			err, failJob, gate = e.onLoad(k)
		}
	}
	if err != nil {
		return nil, err
	}
	j, err := e.Engine.Submit(spans, dir)
	if err != nil {
		return nil, err
	}
	if failJob != nil || gate != nil {
		return &heldJob{Job: j, fail: failJob, gate: gate}, nil
	}
	return j, nil
}

func (e *hookEngine) loadSubmits() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.loads
}

// heldJob is a job whose completion waits for gate, and which fails with
// fail once the copy under it has ended.
type heldJob struct {
	cuda.Job
	fail error
	gate chan struct{}
}

func (j *heldJob) open() bool {
	if j.gate == nil {
		return true
	}
	select {
	case <-j.gate:
		return true
	default:
		return false
	}
}

func (j *heldJob) Done() bool { return j.open() && j.Job.Done() }

func (j *heldJob) Err() error {
	if !j.Done() {
		return nil
	}
	if j.fail != nil {
		return j.fail
	}
	return j.Job.Err()
}

func (j *heldJob) Wait(timeout time.Duration) error {
	start := time.Now()
	if j.gate != nil {
		select {
		case <-j.gate:
		case <-time.After(timeout):
			return fmt.Errorf("%w: held", cuda.ErrTimeout)
		}
	}
	if err := j.Job.Wait(max(0, timeout-time.Since(start))); err != nil {
		return err
	}
	return j.Err()
}

func hook(t *testing.T, w *Worker) *hookEngine {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	e := &hookEngine{Engine: w.engine}
	w.engine = e
	return e
}

func setBatch(t *testing.T, n int) {
	old := loadBatchMax
	loadBatchMax = n
	t.Cleanup(func() { loadBatchMax = old })
}

const pChunks = 6

// pipelinePrompt is pChunks full chunks and a tail of 3 tokens: a hit
// loads all pChunks chunks into pBlocks blocks (the tail's block is vLLM's).
func pipelinePrompt(seed uint32) []uint32 {
	tokens := make([]uint32, pChunks*tChunk+3)
	for i := range tokens {
		tokens[i] = 31*uint32(i) + seed
	}
	return tokens
}

const pBlocks = pChunks*tChunk/tBS + 1

// startLoad looks tokens up and starts the load of the hit into dst
// (filled with a known pattern first); it returns the worker and the
// chunks loaded.
func startLoad(t *testing.T, r *rig, req string, tokens []uint32, dst []int64) *Worker {
	t.Helper()
	n := r.match(t, req, tokens, Extras{}, 0)
	assert.Equal(t, n, pChunks*tChunk)
	for _, b := range dst {
		r.caches[0].fill(int(b), 999)
	}
	assert.NilError(t, r.sched.AfterAlloc(req, dst, 1, -1, n))
	b, err := r.sched.BuildMeta(&Step{})
	assert.NilError(t, err)
	w := r.workers[0]
	m, err := DecodeStepMeta(b, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
	assert.NilError(t, err)
	w.StartLoads(m)
	return w
}

// checkRestored asserts chunks [0, k) of dst hold src's bytes, and, when
// untouched, that the blocks of chunks [k, pChunks) were not written.
func checkRestored(t *testing.T, r *rig, src, dst []int64, k int, untouched bool) {
	t.Helper()
	c := r.caches[0]
	cb := tChunk / tBS
	for layer := range tLayers {
		for i := range pChunks * cb {
			got := c.block(layer, int(dst[i]))
			if i < k*cb {
				assert.Assert(t, bytes.Equal(got, c.block(layer, int(src[i]))), "layer %d block %d (chunk %d) not restored", layer, i, i/cb)
			} else if untouched {
				c.fill(int(dst[i]), 999)
				assert.Assert(t, bytes.Equal(got, c.block(layer, int(dst[i]))), "layer %d block %d (chunk %d) was written", layer, i, i/cb)
			}
		}
	}
}

// A failure at chunk k in the middle of the pipeline, while the copies of
// earlier chunks are in flight: chunks < k are restored byte-exact, chunks
// k.. are load errors (each block once), the request is reported once,
// every hold is released. The failure is a check (a corrupt header: the
// chunk's bytes never reach the cache), a refused Submit or a copy job
// that fails.
func TestConnectorPipelinedLoadFailsFromChunkK(t *testing.T) {
	const k = 3
	cases := []struct {
		name      string
		batch     int
		untouched bool // chunks k.. are never copied
		setup     func(t *testing.T, r *rig, e *hookEngine, hs []kv.Hash)
	}{
		{"check", 2, true, func(t *testing.T, r *rig, e *hookEngine, hs []kv.Hash) {
			l1Object(t, r, 0, hs[k], func(obj []byte) { obj[9] ^= 1 })
			// The first copy completes only once chunk k is being checked:
			// the failure happens with earlier copies in flight.
			checking := make(chan struct{})
			var once sync.Once
			beforeCheck = func(i int) {
				if i == k {
					once.Do(func() { close(checking) })
				}
			}
			t.Cleanup(func() { beforeCheck = nil })
			e.onLoad = func(j int) (error, error, chan struct{}) {
				if j == 0 {
					return nil, nil, checking
				}
				return nil, nil, nil
			}
		}},
		{"submit refused", 1, true, func(t *testing.T, r *rig, e *hookEngine, hs []kv.Hash) {
			e.onLoad = func(j int) (error, error, chan struct{}) {
				if j == k {
					return errors.New("injected: submit refused"), nil, nil
				}
				return nil, nil, nil
			}
		}},
		{"copy failed", 1, false, func(t *testing.T, r *rig, e *hookEngine, hs []kv.Hash) {
			e.onLoad = func(j int) (error, error, chan struct{}) {
				if j == k {
					return nil, errors.New("injected: copy failed"), nil
				}
				return nil, nil, nil
			}
		}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			setBatch(t, c.batch)
			r := newRig(t, 1)
			tokens := pipelinePrompt(uint32(100 * (i + 1)))
			src, dst := seq(0, pBlocks), seq(20, pBlocks)
			hs := savePrompt(t, r, "save", tokens, src, 7)
			e := hook(t, r.workers[0])
			c.setup(t, r, e, hs)
			before := r.workers[0].Stats()
			w := startLoad(t, r, "load", tokens, dst)
			w.wg.Wait()
			_, recv, errBlocks := w.Poll()
			assert.DeepEqual(t, recv, []string{"load"})
			slices.Sort(errBlocks)
			assert.DeepEqual(t, errBlocks, dst[k*tChunk/tBS:pChunks*tChunk/tBS])
			checkRestored(t, r, src, dst, k, c.untouched)
			after := w.Stats()
			assert.Equal(t, after.LoadedChunks-before.LoadedChunks, uint64(k))
			assert.Equal(t, after.FailedLoads-before.FailedLoads, uint64(pChunks-k))
			r.sched.Finished("load")
			assert.Equal(t, holds(t, r.srv), 0.0)
			assert.Assert(t, e.loadSubmits() > 1, "one copy job: not pipelined")
		})
	}
}

// The first chunk's copy is submitted before the last chunk is checked
// (checks and copies overlap), and the load is reported only when its last
// copy has completed, however late.
func TestConnectorLoadOverlapsChecksAndReportsLast(t *testing.T) {
	setBatch(t, 1)
	r := newRig(t, 1)
	tokens := pipelinePrompt(5)
	src, dst := seq(0, pBlocks), seq(20, pBlocks)
	savePrompt(t, r, "save", tokens, src, 3)
	e := hook(t, r.workers[0])
	submitted := make(chan struct{})
	last := make(chan struct{})
	var once sync.Once
	e.onLoad = func(j int) (error, error, chan struct{}) {
		once.Do(func() { close(submitted) })
		if j == pChunks-1 {
			return nil, nil, last
		}
		return nil, nil, nil
	}
	overlapped := make(chan bool, 1)
	beforeCheck = func(i int) {
		if i == pChunks-1 {
			select {
			case <-submitted:
				overlapped <- true
			case <-time.After(3 * time.Second):
				overlapped <- false
			}
		}
	}
	t.Cleanup(func() { beforeCheck = nil })
	w := startLoad(t, r, "load", tokens, dst)
	select {
	case ok := <-overlapped:
		assert.Assert(t, ok, "the last chunk was checked before any copy was submitted")
	case <-time.After(10 * time.Second):
		t.Fatal("the last chunk was never checked")
	}
	testkit.EventuallyShowing(t, 5*time.Second, "every chunk's copy to be submitted", func() bool { return e.loadSubmits() >= pChunks },
		func() string { return fmt.Sprintf("%d of %d chunks submitted", e.loadSubmits(), pChunks) })
	for range 20 {
		_, recv, _ := w.Poll()
		assert.Equal(t, len(recv), 0, "load reported before its last copy completed")
		time.Sleep(5 * time.Millisecond)
	}
	assert.Assert(t, !w.WaitReport(10*time.Millisecond), "WaitReport returned before the last copy completed")
	close(last)
	assert.Assert(t, w.WaitReport(10*time.Second), "WaitReport timed out after the last copy completed")
	w.wg.Wait()
	_, recv, errBlocks := w.Poll()
	assert.DeepEqual(t, recv, []string{"load"})
	assert.Equal(t, len(errBlocks), 0)
	checkRestored(t, r, src, dst, pChunks, false)
	r.sched.Finished("load")
	assert.Equal(t, holds(t, r.srv), 0.0)
}

// A save reports its request's blocks free (get_finished) once its copy
// has completed, before the COMMIT; what the COMMIT publishes is the copy,
// whatever vLLM writes into the blocks afterwards.
func TestConnectorSaveFreesBlocksBeforeCommit(t *testing.T) {
	r := newRig(t, 1)
	c, w := r.caches[0], r.workers[0]
	tokens := pipelinePrompt(9)
	src := seq(0, pBlocks)
	for _, b := range src {
		c.fill(int(b), 41)
	}
	want := make([][]byte, 0, pBlocks*tLayers)
	for layer := range tLayers {
		for _, b := range src {
			want = append(want, c.block(layer, int(b)))
		}
	}
	freed := make(chan bool, 1)
	beforeCommit = func() {
		ok := false
		for deadline := time.Now().Add(3 * time.Second); !ok && time.Now().Before(deadline); {
			sending, _, _ := w.Poll()
			ok = slices.Contains(sending, "save")
			time.Sleep(time.Millisecond)
		}
		if ok { // vLLM reuses the blocks at once
			for _, b := range src {
				c.fill(int(b), 42)
			}
		}
		freed <- ok
	}
	t.Cleanup(func() { beforeCommit = nil })
	assert.Equal(t, r.match(t, "save", tokens, Extras{}, 0), 0)
	assert.NilError(t, r.sched.AfterAlloc("save", src, 1, 0, 0))
	b, err := r.sched.BuildMeta(&Step{Requests: []StepRequest{{Req: "save", Blocks: src, Scheduled: len(tokens)}}})
	assert.NilError(t, err)
	m, err := DecodeStepMeta(b, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
	assert.NilError(t, err)
	w.Finishing([]string{"save"}) // request_finished: delay-free
	w.StartSaves(m, 0)
	assert.Assert(t, <-freed, "blocks not reported free before the COMMIT")
	w.wg.Wait()
	assert.Equal(t, w.Stats().SavedChunks, uint64(pChunks))
	r.sched.Finished("save")

	dst := seq(20, pBlocks)
	beforeCommit = nil
	startLoad(t, r, "load", tokens, dst)
	w.wg.Wait()
	_, recv, errBlocks := w.Poll()
	assert.DeepEqual(t, recv, []string{"load"})
	assert.Equal(t, len(errBlocks), 0)
	for layer := range tLayers {
		for i := range pChunks * tChunk / tBS {
			assert.Assert(t, bytes.Equal(c.block(layer, int(dst[i])), want[layer*pBlocks+i]), "layer %d block %d: not the copied bytes", layer, i)
		}
	}
	r.sched.Finished("load")
}
