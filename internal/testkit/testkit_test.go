package testkit

import (
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
	f.failed = format
	if len(args) > 0 {
		f.failed = strings.ReplaceAll(format, "%v", args[0].(time.Duration).String())
	}
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
