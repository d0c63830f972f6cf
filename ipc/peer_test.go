package ipc

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"gotest.tools/v3/assert"
)

// WatchExit closes its channel for an exited process and stays open for a
// live one (and for this process).
func TestWatchExit(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	assert.Assert(t, WatchExit(os.Getpid(), stop) == nil)
	assert.Assert(t, WatchExit(0, stop) == nil)
	child := exec.Command("sleep", "60")
	assert.NilError(t, child.Start())
	ch := WatchExit(child.Process.Pid, stop)
	select {
	case <-ch:
		t.Fatal("exit reported for a live process")
	case <-time.After(700 * time.Millisecond):
	}
	child.Process.Kill()
	child.Wait()
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		t.Fatal("exit not seen")
	}
}
