package cuda

import (
	"time"

	"github.com/kvshim/kvshim/kv"
)

// Engine executes copy plans. Both implementations (HostEngine for CPU KV
// caches, DeviceEngine for CUDA) are safe for concurrent use.
type Engine interface {
	// Submit starts copying spans. It does not keep spans after it returns.
	Submit(spans []kv.Span, dir kv.Direction) (Job, error)
	// WaitEvent makes the copies submitted in direction dir after it
	// returns wait for event: a CUevent recorded on another stream, e.g.
	// vLLM's after the forward pass (torch.cuda.Event.cuda_event). The
	// wait is enqueued before WaitEvent returns, so the caller may destroy
	// the event then. The host engine accepts only 0 (no event).
	WaitEvent(dir kv.Direction, event uint64) error
	// Close waits (bounded) for submitted copies and releases resources.
	Close() error
}

// Job is one submitted copy, for polling from the connector.
type Job interface {
	// Done reports whether the copy finished (successfully or not). It
	// never blocks on the copy.
	Done() bool
	// Wait blocks until the copy finishes or timeout passes (ErrTimeout).
	// It returns the job's error.
	Wait(timeout time.Duration) error
	// Err is the job's error once Done; nil before.
	Err() error
}

// checkSpans refuses spans that are empty or wrap the address space.
func checkSpans(spans []kv.Span, dir kv.Direction) (total uint64, err error) {
	if dir != kv.Save && dir != kv.Load {
		return 0, errorf(ErrBadSpan, "direction %d", dir)
	}
	for i, s := range spans {
		if s.Len == 0 || s.Src == 0 || s.Dst == 0 || s.Src+s.Len < s.Src || s.Dst+s.Len < s.Dst {
			return 0, errorf(ErrBadSpan, "span %d {src %#x dst %#x len %d}", i, s.Src, s.Dst, s.Len)
		}
		total += s.Len
	}
	return total, nil
}

// waitPoll polls done with a growing sleep until it returns true or the
// timeout passes.
func waitPoll(done func() bool, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	sleep := 20 * time.Microsecond
	for !done() {
		if !time.Now().Before(deadline) {
			return false
		}
		time.Sleep(min(sleep, time.Until(deadline)+time.Microsecond))
		sleep = min(2*sleep, time.Millisecond)
	}
	return true
}
