package main

import (
	"errors"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvshim/kvshim/internal/testkit"
)

func TestHandleTable(t *testing.T) {
	var closed []int
	in := &instance{closers: []func() error{
		func() error { closed = append(closed, 1); return nil },
		func() error { closed = append(closed, 2); return errors.New("second closer") },
	}}
	h := handles.add(in)
	if h < firstHandle {
		t.Fatalf("handle %d below %d: small integers must never be valid", h, firstHandle)
	}
	if got, err := handles.lookup(h); err != nil || got != in {
		t.Fatalf("lookup: %v, %v", got, err)
	}
	got, err := handles.remove(h)
	if err != nil || got != in {
		t.Fatalf("remove: %v", err)
	}
	for _, op := range []func(int64) (*instance, error){handles.lookup, handles.remove} {
		if _, err := op(h); !errors.Is(err, errBadHandle) || codeOf(err) != codeBadH {
			t.Errorf("a removed handle: %v", err)
		}
	}
	if err := in.close(); err == nil || err.Error() != "second closer" {
		t.Errorf("close returns the first error in closing order: %v", err)
	}
	if len(closed) != 2 || closed[0] != 2 || closed[1] != 1 {
		t.Errorf("closers ran as %v, want in reverse order [2 1]", closed)
	}
	if err := in.close(); err != nil || len(closed) != 2 {
		t.Errorf("a second close runs nothing: %v, %v", err, closed)
	}
}

// A close waits for the calls already running on the handle, and refuses
// new ones at once: the closers never run under a call that uses them.
func TestCloseWaitsForCallsInFlight(t *testing.T) {
	var closedAt atomic.Int64
	in := &instance{closers: []func() error{func() error { closedAt.Store(time.Now().UnixNano()); return nil }}}
	h := handles.add(in)
	_, release, err := handles.acquire(h)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- handles.closeHandle(h) }()
	testkit.Eventually(t, 5*time.Second, "the handle to leave the table", func() bool { return handles.get(h) == nil })
	if _, _, err := handles.acquire(h); !errors.Is(err, errBadHandle) {
		t.Errorf("a call after close began: %v, want errBadHandle", err)
	}
	time.Sleep(20 * time.Millisecond)
	if closedAt.Load() != 0 {
		t.Fatal("the handle was closed while a call was in flight")
	}
	released := time.Now().UnixNano()
	release()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("close did not return after the last call ended")
	}
	if closedAt.Load() < released {
		t.Error("closers ran before the call in flight released the handle")
	}
}

// Pending output is per OS thread: what one thread left is invisible to
// another, taken once, and replaced by the same thread's next one.
func TestPendingOutputIsPerThread(t *testing.T) {
	in := &instance{}
	const threads = 8
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan string, threads)
	for i := range threads {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // as an export runs: on the C caller's thread
			defer runtime.UnlockOSThread()
			tid := callerThread()
			mine := []byte(strings.Repeat(string(rune('a'+i)), 10+i))
			<-start
			in.setPending(tid, []byte("older"))
			in.setPending(tid, mine)
			runtime.Gosched()
			got, ok := in.takePending(tid)
			if !ok || string(got) != string(mine) {
				errs <- "thread " + string(rune('a'+i)) + " took " + string(got)
			}
			if _, ok := in.takePending(tid); ok {
				errs <- "taken twice"
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	if len(in.pending) != 0 {
		t.Errorf("%d outputs left pending", len(in.pending))
	}
}

func TestRoleOf(t *testing.T) {
	for _, tc := range []struct {
		state any
		want  string
	}{{&workerState{}, "worker"}, {&toolState{}, "tool"}, {(*workerState)(nil), "worker"}, {42, "int"}} {
		if got := roleOf(tc.state); got != tc.want {
			t.Errorf("roleOf(%T) = %q, want %q", tc.state, got, tc.want)
		}
	}
}
