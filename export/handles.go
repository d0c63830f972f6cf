package main

import (
	"fmt"
	"sync"
)

// firstHandle keeps small integers (0, 1, -1, a stray fd) from ever being a
// valid handle, as libtailscale does.
const firstHandle = 42<<16 + 1

// instance is what a handle names: one connector instance (or tool session)
// with its own last error. Its resources are released by close.
type instance struct {
	id int64

	mu      sync.Mutex
	lastErr string
	closers []func() error // run in reverse order by close
	state   any            // the role-specific object (*shim.Scheduler, *workerState, *toolState)
	pending map[int][]byte // by OS thread: output that did not fit the caller's buffer (kvshim_take_output)

	// inflight counts the calls running on this handle (handleTable.acquire
	// to release): kvshim_close waits for them before it frees what they
	// use, so a close racing a call never pulls a link or a KV cache
	// registration from under it.
	inflight sync.WaitGroup
}

// setPending keeps data for thread tid until it takes it (one per thread:
// a newer output replaces an older one not taken).
func (in *instance) setPending(tid int, data []byte) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.pending == nil {
		in.pending = map[int][]byte{}
	}
	in.pending[tid] = data
}

// takePending removes and returns thread tid's pending output; ok is
// false when it has none.
func (in *instance) takePending(tid int) (data []byte, ok bool) {
	in.mu.Lock()
	defer in.mu.Unlock()
	data, ok = in.pending[tid]
	delete(in.pending, tid)
	return data, ok
}

func (in *instance) setErr(err error) {
	in.mu.Lock()
	in.lastErr = err.Error()
	in.mu.Unlock()
}

func (in *instance) close() error {
	in.mu.Lock()
	cl := in.closers
	in.closers = nil
	in.mu.Unlock()
	var first error
	for i := len(cl) - 1; i >= 0; i-- {
		if err := cl[i](); err != nil && first == nil {
			first = err
		}
	}
	return first
}

type handleTable struct {
	mu   sync.Mutex
	next int64
	m    map[int64]*instance
}

var handles = handleTable{next: firstHandle, m: map[int64]*instance{}}

func (t *handleTable) add(in *instance) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	in.id = t.next
	t.next++
	t.m[in.id] = in
	return in.id
}

func (t *handleTable) get(h int64) *instance {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[h]
}

// lookup returns the instance or an errBadHandle naming h.
func (t *handleTable) lookup(h int64) (*instance, error) {
	if in := t.get(h); in != nil {
		return in, nil
	}
	return nil, fmt.Errorf("handle %d: %w", h, errBadHandle)
}

// acquire returns h's instance for one call, which must release it: until
// then a kvshim_close of h waits (closeHandle). Taken under the table's lock,
// so a call either holds h before close removes it or finds it gone.
func (t *handleTable) acquire(h int64) (in *instance, release func(), err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if in = t.m[h]; in == nil {
		return nil, nil, fmt.Errorf("handle %d: %w", h, errBadHandle)
	}
	in.inflight.Add(1)
	return in, in.inflight.Done, nil
}

// closeHandle is kvshim_close: h is invalid for new calls at once, the calls
// already running on it return (each is bounded by its own timeout), then
// its resources are freed.
func (t *handleTable) closeHandle(h int64) error {
	in, err := t.remove(h)
	if err != nil {
		return err
	}
	in.inflight.Wait()
	return in.close()
}

// remove takes h out of the table; a second remove of the same h fails.
func (t *handleTable) remove(h int64) (*instance, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	in := t.m[h]
	if in == nil {
		return nil, fmt.Errorf("handle %d: %w", h, errBadHandle)
	}
	delete(t.m, h)
	return in, nil
}

func (t *handleTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}
