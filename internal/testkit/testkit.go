// Package testkit holds the helpers kvshim's Go tests share, so that each
// is written once. Only test files import it.
package testkit

import (
	"bytes"
	"sync"
	"testing"
	"time"
)

// Poll is how often Eventually checks its condition: short enough that a
// test waits little past the moment the condition holds, long enough that
// polling does not take a core from the code under test on a 2-core machine.
const Poll = 2 * time.Millisecond

// Eventually polls cond until it holds, failing t (naming what it waited
// for and how long) once timeout has passed. Every wait in a test is
// bounded: there is no form without a timeout.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	eventually(t, timeout, what, cond, nil)
}

// EventuallyShowing is Eventually for a wait whose failure is understood
// only with the state the test last saw (the last error, a count so far, a
// metric's last value, a child's stderr): Eventually's what is fixed before
// the wait, so show is called once, on timeout, and its text is added to
// the failure. It is not called when cond holds.
func EventuallyShowing(t testing.TB, timeout time.Duration, what string, cond func() bool, show func() string) {
	t.Helper()
	eventually(t, timeout, what, cond, show)
}

func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool, show func() string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			if show != nil {
				t.Fatalf("timed out after %v waiting for %s: %s", timeout, what, show())
			} else {
				t.Fatalf("timed out after %v waiting for %s", timeout, what)
			}
			return // Fatalf ends the goroutine; a testing.TB that records it does not
		}
		time.Sleep(Poll)
	}
}

// Buffer is an io.Writer safe for concurrent writers (a logger, a command
// running in its goroutine) while the test reads it.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String is everything written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
