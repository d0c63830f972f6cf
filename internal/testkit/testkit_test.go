package testkit

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeTB records a Fatalf instead of ending the test, so Eventually's
// failure can be checked.
type fakeTB struct {
	testing.TB
	failed string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.failed = fmt.Sprintf(format, args...)
}

func TestEventuallyReturnsOnceTheConditionHolds(t *testing.T) {
	var n atomic.Int32
	start := time.Now()
	Eventually(t, 5*time.Second, "three polls", func() bool { return n.Add(1) == 3 })
	if n.Load() != 3 {
		t.Fatalf("polled %d times, want 3", n.Load())
	}
	if time.Since(start) > time.Second {
		t.Fatalf("returned after %v", time.Since(start))
	}
}

func TestEventuallyFailsAfterItsTimeout(t *testing.T) {
	f := &fakeTB{}
	start := time.Now()
	Eventually(f, 30*time.Millisecond, "never", func() bool { return false })
	if f.failed == "" || !strings.Contains(f.failed, "30ms") {
		t.Fatalf("no failure naming the timeout: %q", f.failed)
	}
	if d := time.Since(start); d < 30*time.Millisecond || d > 2*time.Second {
		t.Fatalf("failed after %v, want just past 30ms", d)
	}
}

func TestEventuallyShowingAddsTheStateToItsFailure(t *testing.T) {
	f := &fakeTB{}
	var n atomic.Int32
	EventuallyShowing(f, 30*time.Millisecond, "never", func() bool { n.Add(1); return false },
		func() string { return fmt.Sprintf("%d polls", n.Load()) })
	if !strings.Contains(f.failed, "30ms") || !strings.Contains(f.failed, "never") || !strings.Contains(f.failed, " polls") {
		t.Fatalf("failure without the timeout, what or the state: %q", f.failed)
	}
	shown := false
	EventuallyShowing(t, 5*time.Second, "at once", func() bool { return true }, func() string { shown = true; return "" })
	if shown {
		t.Fatal("show was called though the condition held")
	}
}
