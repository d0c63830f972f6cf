package server

import (
	"os"
	"os/exec"
	"runtime"
	"testing"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	"gotest.tools/v3/poll"
)

// stage ALLOCs hs as writer tag without committing and returns the locations.
func stage(t *testing.T, st *Core, s *Session, tag byte, hs []kv.Hash) []ipc.Loc {
	t.Helper()
	resp, err := st.Alloc(s, &ipc.AllocReq{Tag: kv.Tag{tag}, Namespace: ns1, Hashes: hs, Sizes: sizes(len(hs))})
	assert.NilError(t, err)
	for i, stt := range resp.Status {
		assert.Equal(t, stt, ipc.StatusOK, "key %d", i)
	}
	return resp.Locs
}

func fenced(t *testing.T, st *Core) float64 { return stat(t, st, "kvshim_l1_objects{state=fenced}") }

// A writer whose session ended while its process lives keeps its slots out
// of use: with L1 full of them, another writer gets NoSpace, never one of
// those slots; once the process exits they are free again.
func TestFenceUntilWriterExits(t *testing.T) {
	child := exec.Command("sleep", "60")
	assert.NilError(t, child.Start())
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })

	st := newCore(t, 1, Options{}) // 128 slots of 8 KiB
	a, err := st.OpenSessionWith(sessionID(0), SessionOptions{Fence: true, PeerPID: child.Process.Pid})
	assert.NilError(t, err)
	n := int(st.l1.Stats().Capacity / objSize)
	mine := stage(t, st, a, 1, hashes("a", n))
	st.CloseSession(a) // e.g. its heartbeat expired: it may still be writing
	assert.Equal(t, fenced(t, st), float64(n))
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), 0.0)

	b := open(t, st, 1)
	resp, err := st.Alloc(b, &ipc.AllocReq{Tag: kv.Tag{2}, Namespace: ns1, Hashes: hashes("b", 4), Sizes: sizes(4)})
	assert.NilError(t, err)
	for i, stt := range resp.Status {
		assert.Equal(t, stt, ipc.StatusNoSpace, "key %d got a fenced writer's slot", i)
	}
	// The old writer's COMMIT through a new session of the same tag is refused.
	a2, err := st.OpenSessionWith(sessionID(0), SessionOptions{Fence: true, PeerPID: child.Process.Pid})
	assert.NilError(t, err)
	c, err := st.Commit(a2, &ipc.CommitReq{Tag: kv.Tag{1}, Namespace: ns1, Hashes: hashes("a", 1)})
	assert.NilError(t, err)
	assert.Equal(t, c.Status[0], ipc.StatusNotFound)
	st.CloseSession(a2)

	assert.NilError(t, child.Process.Kill())
	child.Wait()
	poll.WaitOn(t, func(poll.LogT) poll.Result {
		if fenced(t, st) == 0 {
			return poll.Success()
		}
		return poll.Continue("%v slots still fenced", fenced(t, st))
	}, poll.WithTimeout(10*time.Second), poll.WithDelay(50*time.Millisecond))
	assert.Equal(t, stat(t, st, "kvshim_l1_fences_lifted_total{by=exit}"), 1.0)
	locs := stage(t, st, b, 2, hashes("b", 4))
	reused := false
	for _, l := range locs {
		for _, m := range mine {
			reused = reused || l == m
		}
	}
	assert.Assert(t, reused, "freed slots are used again")
}

// A writer in this very process (the embedded server's in-process worker)
// can never be seen exiting: its fence lifts when it reconnects saying its
// earlier sessions have drained, and only then.
func TestFenceLiftedByDrainedHello(t *testing.T) {
	st := newCore(t, 1, Options{})
	opts := SessionOptions{Fence: true, PeerPID: os.Getpid()}
	a, err := st.OpenSessionWith(sessionID(0), opts)
	assert.NilError(t, err)
	stage(t, st, a, 1, hashes("a", 8))
	st.CloseSession(a)
	assert.Equal(t, fenced(t, st), 8.0)

	// Reconnecting without the word (a job of the old session still runs):
	// still fenced. Another writer's word does not count.
	a, err = st.OpenSessionWith(sessionID(0), opts)
	assert.NilError(t, err)
	st.CloseSession(a)
	other, err := st.OpenSessionWith(sessionID(7), SessionOptions{Fence: true, Drained: true})
	assert.NilError(t, err)
	assert.Equal(t, fenced(t, st), 8.0)
	st.CloseSession(other)

	opts.Drained = true
	a, err = st.OpenSessionWith(sessionID(0), opts)
	assert.NilError(t, err)
	assert.Equal(t, fenced(t, st), 0.0)
	assert.Equal(t, used(t, st), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_fences_lifted_total{by=drained}"), 1.0)
}

// The staging TTL takes a live writer's forgotten keys (others may stage
// them again) but fences the slots: the writer may still be copying.
func TestStagingTTLFencesLiveWriter(t *testing.T) {
	st := newCore(t, 1, Options{}, func(c *Config) { c.StagingTTL = time.Minute })
	now := time.Now()
	st.now = func() time.Time { return now }
	a, err := st.OpenSessionWith(sessionID(0), SessionOptions{Fence: true, PeerPID: os.Getpid()})
	assert.NilError(t, err)
	hs := hashes("ttl", 3)
	stage(t, st, a, 1, hs)
	now = now.Add(2 * time.Minute)
	st.reap()
	assert.Equal(t, stat(t, st, "kvshim_l1_ttl_reclaimed_staging_total"), 3.0)
	assert.Equal(t, fenced(t, st), 3.0)
	again := stage(t, st, a, 1, hs) // the keys are free to stage again, in other slots
	assert.Equal(t, len(again), 3)
	assert.Equal(t, used(t, st), 6.0*objSize)
	st.CloseSession(a) // the new staging joins the fence
	assert.Equal(t, fenced(t, st), 6.0)
	_, err = st.OpenSessionWith(sessionID(0), SessionOptions{Fence: true, Drained: true})
	assert.NilError(t, err)
	assert.Equal(t, used(t, st), 0.0)
}

// In-process sessions (no fence) free their staging at close, as before.
func TestNoFenceFreesAtClose(t *testing.T) {
	st := newCore(t, 1, Options{})
	a := open(t, st, 0)
	stage(t, st, a, 1, hashes("a", 5))
	st.CloseSession(a)
	assert.Equal(t, fenced(t, st), 0.0)
	assert.Equal(t, used(t, st), 0.0)
}

// Lifting a fence by the writer's word ends the watch of its process: a
// long-lived writer that stalled once leaves no goroutine or pidfd behind.
func TestFenceWatchEndsWhenLifted(t *testing.T) {
	child := exec.Command("sleep", "60")
	assert.NilError(t, child.Start())
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	st := newCore(t, 1, Options{})
	opts := SessionOptions{Fence: true, PeerPID: child.Process.Pid}
	base := runtime.NumGoroutine()
	a, err := st.OpenSessionWith(sessionID(0), opts)
	assert.NilError(t, err)
	stage(t, st, a, 1, hashes("a", 2))
	st.CloseSession(a)
	poll.WaitOn(t, func(poll.LogT) poll.Result {
		if runtime.NumGoroutine() > base+1 {
			return poll.Success()
		}
		return poll.Continue("no watch yet")
	}, poll.WithTimeout(5*time.Second))
	opts.Drained = true
	_, err = st.OpenSessionWith(sessionID(0), opts)
	assert.NilError(t, err)
	assert.Equal(t, fenced(t, st), 0.0)
	poll.WaitOn(t, func(poll.LogT) poll.Result {
		// +1: poll.WaitOn runs this check on a goroutine of its own.
		if n := runtime.NumGoroutine(); n > base+1 {
			return poll.Continue("%d goroutines, %d before the fence", n, base)
		}
		return poll.Success()
	}, poll.WithTimeout(5*time.Second), poll.WithDelay(20*time.Millisecond))
}
