package shim

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
)

// Layer-wise loads (kvshim.layerwise). vLLM loads such a request in the
// step that computes it (the scheduler answers "not asynchronous"), calls
// start_load_kv before the forward pass and wait_for_layer_load(layer)
// before each attention layer. StartLoadsLayered retrieves and checks every
// chunk of the step's loads, then submits one copy job per registered
// tensor (per attention layer; a cross-layer cache is one tensor, so every
// layer waits for all of it) in registration order, the order the forward
// pass reads them; WaitLayer waits only for that layer's job.
//
// Failures are the whole load's: a chunk whose retrieve or check failed,
// and every later chunk of its load, is never copied; a layer's copy that
// fails fails every chunk it carried (from chunk 0 of each load). They are
// reported (Poll's error blocks) once the step's copies have ended, which
// WaitLayers waits for before the step's output: vLLM treats those blocks
// as invalid and recomputes from the first of them, as it does for any load
// error. A loaded request is not reported received: vLLM did not wait for
// it (it asserts on a running request reported so).

// ErrLayerTimeout: a layer's copies did not end within the wait's timeout.
var ErrLayerTimeout = errors.New("layer-wise load timed out")

// layerStep is one step's layer-wise loads.
type layerStep struct {
	once sync.Once
	l    *layout.Layout  // nil: no load this step
	done []chan struct{} // per tensor of l: closed once that tensor's copies have ended
	all  chan struct{}   // closed once every load is accounted for (errors reported)
}

func newLayerStep(l *layout.Layout) *layerStep {
	st := &layerStep{l: l, all: make(chan struct{})}
	if l != nil {
		st.done = make([]chan struct{}, l.NumTensors())
		for i := range st.done {
			st.done[i] = make(chan struct{})
		}
	}
	return st
}

// finish releases every waiter: the layers not released yet, then all.
func (st *layerStep) finish() {
	st.once.Do(func() {
		for _, ch := range st.done {
			select {
			case <-ch:
			default:
				close(ch)
			}
		}
		close(st.all)
	})
}

// StartLoadsLayered starts a step's loads layer by layer and returns at
// once. With several KV-cache groups it loads whole chunks (StartLoads'
// pipeline) and every layer waits for all of them.
func (w *Worker) StartLoadsLayered(meta *StepMeta) {
	w.mu.Lock()
	l, multi, eng := w.layout, len(w.layouts) > 1, w.engine
	w.mu.Unlock()
	if len(meta.Loads) == 0 || l == nil {
		st := newLayerStep(nil)
		st.finish()
		w.setLayered(st)
		return
	}
	st := newLayerStep(l)
	w.setLayered(st)
	var reqs []string
	for _, ld := range meta.Loads {
		if len(reqs) == 0 || reqs[len(reqs)-1] != ld.Req {
			reqs = append(reqs, ld.Req)
		}
		multi = multi || ld.Group != 0
	}
	w.backgroundReqs(reqs, func() {
		defer st.finish()
		if multi {
			done := make(chan struct{}, len(meta.Loads))
			var wg sync.WaitGroup
			for i := range meta.Loads {
				ld := &meta.Loads[i]
				wg.Add(1)
				go func() {
					defer wg.Done()
					w.load(ld, func() { done <- struct{}{} })
				}()
			}
			for range meta.Loads {
				<-done
			}
			st.finish() // errors reported; the RELEASEs follow
			wg.Wait()
			return
		}
		w.loadLayered(meta.Loads, l, eng, st)
	})
}

func (w *Worker) setLayered(st *layerStep) {
	w.mu.Lock()
	w.layered = st
	w.mu.Unlock()
}

// WaitLayer waits until the current step's copies of layer name have ended
// (a name the layout does not know, or a cross-layer cache: all of them).
// It returns at once when the step has no layer-wise load.
func (w *Worker) WaitLayer(name string, timeout time.Duration) error {
	w.mu.Lock()
	st := w.layered
	w.mu.Unlock()
	if st == nil {
		return nil
	}
	ch := st.all
	if st.l != nil {
		if i := st.l.TensorIndex(name); i >= 0 {
			ch = st.done[i]
		}
	}
	return waitCh(ch, timeout, "layer "+name)
}

// WaitLayers waits until every layer-wise load of the current step is
// accounted for, its failures reported to Poll (before the step's output).
func (w *Worker) WaitLayers(timeout time.Duration) error {
	w.mu.Lock()
	st := w.layered
	w.mu.Unlock()
	if st == nil {
		return nil
	}
	return waitCh(st.all, timeout, "the step's layer-wise loads")
}

func waitCh(ch <-chan struct{}, timeout time.Duration, what string) error {
	select {
	case <-ch:
		return nil
	default:
	}
	tm := time.NewTimer(timeout)
	defer tm.Stop()
	select {
	case <-ch:
		return nil
	case <-tm.C:
		return fmt.Errorf("%w: %s not loaded after %v", ErrLayerTimeout, what, timeout)
	}
}

// lwLoad is one load of a layer-wise step.
type lwLoad struct {
	ld      *LoadSpec
	client  *ipc.Client
	rr      *ipc.RetrieveReq
	release func()
	objs    [][]byte // checked chunks [0, failAt)
	n       int
	failAt  int
	why     error
}

func (x *lwLoad) fail(k int, err error) {
	if k < x.failAt {
		x.failAt, x.why = k, err
	}
}

func (w *Worker) loadLayered(lds []LoadSpec, l *layout.Layout, eng cuda.Engine, st *layerStep) {
	_, ns, _, err := w.group(0)
	cb := l.ChunkBlocks()
	loads := make([]*lwLoad, 0, len(lds))
	for i := range lds {
		ld := &lds[i]
		if ld.Start == ld.End && len(ld.Blocks) == 0 {
			continue // nothing to retrieve (StartLoads' load says why)
		}
		x := &lwLoad{ld: ld, n: int(ld.End - ld.Start)}
		x.failAt = x.n
		loads = append(loads, x)
		if err != nil {
			x.fail(0, err)
			continue
		}
		x.rr = &ipc.RetrieveReq{Owner: kv.Tag(ld.Owner), LookupID: ld.Lookup, Rank: uint32(w.cfg.Rank), Start: ld.Start, End: ld.End}
		var resp *ipc.RetrieveResp
		if err := w.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
			x.client = c
			resp, err = c.Retrieve(ctx, x.rr)
			return err
		}); err != nil {
			x.client = nil
			x.fail(0, err)
			continue
		}
		if x.release, err = x.client.Use(); err != nil {
			x.client = nil
			x.fail(0, err)
			continue
		}
		chk := w.startChecks(l, ns, x.client, resp, ld.Hashes, x.n)
		for k := 0; k < x.n; k++ {
			obj, err := chk.wait(k)
			if err != nil {
				x.fail(k, err)
				break
			}
			x.objs = append(x.objs, obj)
		}
		chk.stop()
	}
	// One job per tensor, in the forward pass's order. A CUDA stream runs
	// its copies in order, so every job is submitted now and the engine
	// copies them one after the other while the forward pass consumes the
	// layers already copied. The host engine's goroutines take whole jobs
	// from a queue, side by side: there each job is submitted once the one
	// before it has ended (each job still uses every goroutine), else the
	// first layer would end no sooner than the last.
	_, inOrder := eng.(*cuda.HostEngine)
	type tjob struct {
		job   cuda.Job
		spans int
		err   error
	}
	plan := func(ti int, spans []kv.Span) []kv.Span {
		for _, x := range loads {
			for k := 0; k < x.failAt; k++ {
				var err error
				if spans, err = l.AppendPlanTensor(spans, x.ld.Blocks[k*cb:(k+1)*cb], addrOf(x.objs[k]), kv.Load, ti); err != nil {
					x.fail(k, err)
				}
			}
		}
		return spans
	}
	var spans []kv.Span
	submit := func(ti int) tjob {
		spans = plan(ti, spans[:0])
		if len(spans) == 0 {
			return tjob{}
		}
		job, err := eng.Submit(spans, kv.Load)
		return tjob{job: job, spans: len(spans), err: err}
	}
	jobs := make([]tjob, l.NumTensors())
	if !inOrder {
		for ti := range jobs {
			jobs[ti] = submit(ti)
		}
	}
	stuck := false
	for ti := range jobs {
		if inOrder && !stuck {
			jobs[ti] = submit(ti)
		}
		j := jobs[ti]
		err := j.err
		if err == nil && j.job != nil {
			err = w.waitCopy(j.job, kv.Load, j.spans, stuck)
			stuck = stuck || errors.Is(err, errCopyStuck)
		}
		if err != nil { // this layer of every chunk it carried is not loaded
			for _, x := range loads {
				x.fail(0, fmt.Errorf("layer %d: %w", ti, err))
			}
		}
		close(st.done[ti])
	}
	var loaded uint64
	for _, x := range loads {
		if x.client != nil && x.failAt > 0 && !x.client.Live() {
			x.fail(0, fmt.Errorf("%w during the copy: %v", ErrUnavailable, x.client.Err()))
		}
		if x.failAt < x.n {
			w.loadFailed(x.ld, x.failAt, cb, x.why)
		}
		w.count(func(s *WorkerStats) {
			s.LoadedChunks += uint64(x.failAt)
			s.LayerwiseLoads++
		})
		if x.failAt == x.n {
			loaded += uint64(x.n) * l.BlockBytes() * uint64(cb)
		}
	}
	w.count(func(s *WorkerStats) { s.LoadedBytes += loaded })
	// The step's failures are in Poll now; the RELEASEs are off its path.
	// (The deferred finish closes all once they are sent.)
	for _, x := range loads {
		if x.client == nil || stuck {
			continue
		}
		c := x.client
		_ = w.link.callOn(c, func(ctx context.Context, c *ipc.Client) error {
			return c.Release(ctx, &ipc.ReleaseReq{Owner: x.rr.Owner, LookupID: x.rr.LookupID, Rank: x.rr.Rank})
		})
		x.release()
	}
}

// backgroundReqs is background for a job that belongs to several requests
// (a layer-wise step's loads): each is in flight until f returns.
func (w *Worker) backgroundReqs(reqs []string, f func()) {
	w.mu.Lock()
	for _, r := range reqs {
		w.inflight[r]++
	}
	w.mu.Unlock()
	w.wg.Add(1)
	w.jobs.Add(1)
	go func() {
		defer w.wg.Done()
		defer w.jobs.Add(-1)
		defer func() {
			idle := false
			w.mu.Lock()
			for _, r := range reqs {
				if w.inflight[r]--; w.inflight[r] <= 0 {
					delete(w.inflight, r)
					idle = true
				}
			}
			w.mu.Unlock()
			if idle {
				w.signalReport()
			}
		}()
		f()
	}()
}
