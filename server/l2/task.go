package l2

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/kvshim/kvshim/kv"
)

// KeyResult is one key's final result, delivered on Task.Events.
type KeyResult struct {
	Index int // position in the batch
	Key   kv.Key
	Result
}

// Task is a submitted batch. Each key gets exactly one Result; Events
// delivers them as they become final, Done closes when all are final.
type Task struct {
	op      Op
	keys    []kv.Key
	results []Result
	set     []bool
	events  chan KeyResult
	done    chan struct{}
	cancel  context.CancelFunc
	start   time.Time
	onKey   func(i int, r Result) // adapter hook (holds, metrics), called under mu
	onDone  func(t *Task)

	mu        sync.Mutex
	remaining int
}

func newTask(op Op, keys []kv.Key) *Task {
	t := &Task{
		op:        op,
		keys:      keys,
		results:   make([]Result, len(keys)),
		set:       make([]bool, len(keys)),
		events:    make(chan KeyResult, len(keys)),
		done:      make(chan struct{}),
		start:     time.Now(),
		remaining: len(keys),
	}
	return t
}

// Op is the task's operation.
func (t *Task) Op() Op { return t.op }

// Keys is the batch (not to be modified).
func (t *Task) Keys() []kv.Key { return t.keys }

// Len is the number of keys.
func (t *Task) Len() int { return len(t.keys) }

// Events delivers each key's result once, in completion order; it is closed
// after the last one. It is buffered to Len(), so not reading it is fine.
func (t *Task) Events() <-chan KeyResult { return t.events }

// Done is closed when every key has its result.
func (t *Task) Done() <-chan struct{} { return t.done }

// Results returns the per-key results once Done is closed, nil before.
func (t *Task) Results() []Result {
	select {
	case <-t.done:
		return t.results
	default:
		return nil
	}
}

// Wait blocks until the task is done or ctx ends. The task itself always
// ends by its own deadline (op_timeout), so Wait(context.Background()) is
// bounded too.
func (t *Task) Wait(ctx context.Context) ([]Result, error) {
	select {
	case <-t.done:
		return t.results, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("l2: waiting for %s task: %w", t.op, ctx.Err())
	}
}

// Bitmap is the StatusOK bitmap; valid after Done.
func (t *Task) Bitmap() Bitmap { return BitmapOf(t.Results()) }

// Failed lists the indices whose Status is StatusFailed; valid after Done.
func (t *Task) Failed() []int {
	var f []int
	for i, r := range t.Results() {
		if r.Status == StatusFailed {
			f = append(f, i)
		}
	}
	return f
}

// report sets key i's result; later reports for the same key are ignored.
func (t *Task) report(i int, r Result) {
	t.mu.Lock()
	if i < 0 || i >= len(t.keys) || t.set[i] {
		t.mu.Unlock()
		return
	}
	if r.Status == StatusFailed && r.Err == nil {
		r.Err = ErrNotReported
	}
	t.set[i] = true
	t.results[i] = r
	if t.onKey != nil {
		t.onKey(i, r)
	}
	t.events <- KeyResult{Index: i, Key: t.keys[i], Result: r}
	t.remaining--
	last := t.remaining == 0
	t.mu.Unlock()
	if last {
		t.finish()
	}
}

// failUnset fails every key in [lo, hi) that has no result yet.
func (t *Task) failUnset(lo, hi int, err error) {
	for i := lo; i < hi; i++ {
		t.mu.Lock()
		set := t.set[i]
		t.mu.Unlock()
		if !set {
			t.report(i, Result{Status: StatusFailed, Err: err})
		}
	}
}

func (t *Task) finish() {
	close(t.events)
	if t.cancel != nil {
		t.cancel()
	}
	if t.onDone != nil {
		t.onDone(t)
	}
	close(t.done)
}

// Reporter receives a backend's per-key results for one tile; i is the
// index within the tile's keys. Report is safe for concurrent use; the first
// report for a key wins.
type Reporter struct {
	t     *Task
	off   int
	remap []int // when set, tile key i is batch key off+remap[i]
}

// Report sets the result of the tile's key i.
func (r Reporter) Report(i int, res Result) {
	if r.remap != nil {
		if i < 0 || i >= len(r.remap) {
			return
		}
		i = r.remap[i]
	}
	r.t.report(r.off+i, res)
}

// Sub returns a Reporter for the tile's keys from n on (a backend that
// works through its tile in parts).
func (r Reporter) Sub(n int) Reporter {
	if r.remap != nil {
		return Reporter{t: r.t, off: r.off, remap: r.remap[n:]}
	}
	return Reporter{t: r.t, off: r.off + n}
}

// Fail reports err for the tile's key i.
func (r Reporter) Fail(i int, err error) { r.Report(i, Result{Status: StatusFailed, Err: err}) }

// FailAll reports err for every key of the tile that has no result yet.
func (r Reporter) FailAll(n int, err error) {
	if r.remap != nil {
		for _, i := range r.remap[:min(n, len(r.remap))] {
			r.t.failUnset(r.off+i, r.off+i+1, err)
		}
		return
	}
	r.t.failUnset(r.off, r.off+n, err)
}
