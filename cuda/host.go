package cuda

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvshim/kvshim/kv"
)

// HostEngine executes plans with memmove on a pool of goroutines, for CPU KV
// caches (vLLM's CPU backend) and for every test without a GPU. Large spans
// are split so all workers stay busy; small spans are copied whole.
type HostEngine struct {
	workers  int
	minPiece uint64
	work     chan *hostJob
	wg       sync.WaitGroup
	mu       sync.RWMutex // Submit holds it shared while queueing; Close exclusively
	closed   bool
}

// HostOption configures a HostEngine.
type HostOption func(*HostEngine)

// WithMinPiece sets the smallest piece a large span is split into (default
// 256 KiB). Smaller pieces balance better and cost more per piece.
func WithMinPiece(n uint64) HostOption { return func(e *HostEngine) { e.minPiece = max(n, 4096) } }

// NewHostEngine starts an engine with workers goroutines (<= 0: GOMAXPROCS).
func NewHostEngine(workers int, opts ...HostOption) *HostEngine {
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	e := &HostEngine{workers: workers, minPiece: 256 << 10, work: make(chan *hostJob, 4*workers)}
	for _, o := range opts {
		o(e)
	}
	e.wg.Add(workers)
	for range workers {
		go e.worker()
	}
	return e
}

// Workers is the number of copy goroutines.
func (e *HostEngine) Workers() int { return e.workers }

type hostJob struct {
	pieces []kv.Span
	next   atomic.Int64
	left   atomic.Int64
	done   chan struct{}
	errMu  sync.Mutex
	err    error
}

// Submit splits spans into pieces and queues them; it returns at once.
func (e *HostEngine) Submit(spans []kv.Span, dir kv.Direction) (Job, error) {
	total, err := checkSpans(spans, dir)
	if err != nil {
		return nil, err
	}
	piece := max(e.minPiece, total/uint64(4*e.workers))
	j := &hostJob{done: make(chan struct{})}
	j.pieces = make([]kv.Span, 0, len(spans)+int(total/piece))
	for _, s := range spans {
		for s.Len > piece+piece/2 {
			j.pieces = append(j.pieces, kv.Span{Src: s.Src, Dst: s.Dst, Len: piece})
			s.Src, s.Dst, s.Len = s.Src+piece, s.Dst+piece, s.Len-piece
		}
		j.pieces = append(j.pieces, s)
	}
	j.left.Store(int64(len(j.pieces)))
	if len(j.pieces) == 0 {
		close(j.done)
		return j, nil
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	for range min(e.workers, len(j.pieces)) {
		e.work <- j
	}
	return j, nil
}

// WaitEvent accepts only 0: a CPU KV cache has no CUDA stream to order by.
func (e *HostEngine) WaitEvent(dir kv.Direction, event uint64) error {
	if event != 0 {
		return errorf(ErrBadSpan, "host engine cannot wait on CUDA event %#x", event)
	}
	return nil
}

func (e *HostEngine) worker() {
	defer e.wg.Done()
	// A bad address (an unmapped segment) becomes a job error, not a crash.
	debug.SetPanicOnFault(true)
	for j := range e.work {
		e.run(j)
	}
}

func (e *HostEngine) run(j *hostJob) {
	var n int64
	defer func() {
		if r := recover(); r != nil {
			j.fail(fmt.Errorf("%w: host copy faulted: %v", ErrBadSpan, r))
			// Count the faulting piece and give up the unclaimed ones; pieces
			// other workers hold are counted by them, so done stays exact.
			total := int64(len(j.pieces))
			claimed := j.next.Swap(total)
			n += 1 + max(0, total-claimed)
		}
		if n > 0 && j.left.Add(-n) <= 0 {
			j.closeOnce()
		}
	}()
	for {
		i := j.next.Add(1) - 1
		if i >= int64(len(j.pieces)) {
			return
		}
		memmove(j.pieces[i])
		n++
	}
}

func (j *hostJob) fail(err error) {
	j.errMu.Lock()
	if j.err == nil {
		j.err = err
	}
	j.errMu.Unlock()
}

func (j *hostJob) closeOnce() {
	j.errMu.Lock()
	defer j.errMu.Unlock()
	select {
	case <-j.done:
	default:
		close(j.done)
	}
}

func (j *hostJob) Done() bool {
	select {
	case <-j.done:
		return true
	default:
		return false
	}
}

func (j *hostJob) Wait(timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-j.done:
		return j.Err()
	case <-t.C:
		return errorf(ErrTimeout, "host copy not done after %v", timeout)
	}
}

func (j *hostJob) Err() error {
	if !j.Done() {
		return nil
	}
	j.errMu.Lock()
	defer j.errMu.Unlock()
	return j.err
}

// Close lets queued jobs finish and stops the workers.
func (e *HostEngine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	close(e.work)
	e.mu.Unlock()
	e.wg.Wait()
	return nil
}

var _ Engine = (*HostEngine)(nil)
