package server

import (
	"log/slog"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
)

// SessionOptions describe a session's peer.
type SessionOptions struct {
	// Fence: the peer writes L1 through its own mapping, from goroutines
	// that may outlive its session (a process stalled past its heartbeat,
	// a call that timed out), so its staging slots are fenced, not freed,
	// when the session ends or the staging TTL reclaims them. False for
	// in-process callers whose writes end before their calls return.
	Fence bool
	// PeerPID is the peer's pid (SO_PEERCRED; 0 if not visible here): the
	// fence lifts when this process exits.
	PeerPID int
	// UID is the peer's uid (SO_PEERCRED).
	UID uint32
	// Drained: the peer said (ipc.HelloDrained) that every earlier session
	// with this id has ended on its side with its mappings gone: their
	// fenced slots are freed when this one opens.
	Drained bool
	// OnEvents, when set, is called (under the core's lock: it must not
	// block) when an event is queued for a session that had none queued: a
	// direct session's client has no frame header to carry the flag.
	OnEvents func()
}

// releaseStaging gives back a staging object that its writer s no longer
// owns (session end, staging TTL): freed at once when s's writes cannot
// outlive its calls, else fenced until s is known to be done writing.
func (core *Core) releaseStaging(s *Session, i uint32) {
	if !s.opts.Fence {
		core.l1.Free(i)
		return
	}
	if err := core.l1.Fence(i); err != nil {
		// Not staging: a bug. Keep the slot (it may still be written).
		slog.Error("server: fencing a staging slot", "err", err)
		return
	}
	s.fenced = append(s.fenced, i)
}

// fenceClosed parks a closed session's fenced slots until its writer has
// exited (watched with a pidfd) or says it has drained (HelloDrained).
func (core *Core) fenceClosed(s *Session) {
	if len(s.fenced) == 0 {
		return
	}
	core.fences[s] = s.fenced
	s.fenced = nil
	lifted := make(chan struct{}) // closed by unfence: the watch ends with the fence
	s.lifted = lifted
	go func() {
		stop := make(chan struct{}) // the core closed, or the fence was lifted
		go func() {
			select {
			case <-core.stop:
			case <-lifted:
			}
			close(stop)
		}()
		exited := ipc.WatchExit(s.opts.PeerPID, stop)
		if exited == nil {
			return // this process, or pid unknown: only the writer's word lifts the fence
		}
		select {
		case <-exited:
			core.mu.Lock()
			if core.unfence(s) {
				core.cnt.fencesExited++
			}
			core.mu.Unlock()
		case <-stop:
		}
	}()
}

// unfenceDrained frees the fenced slots of every ended session named id.
func (core *Core) unfenceDrained(id kv.Tag) {
	for s := range core.fences {
		if s.id == id && core.unfence(s) {
			core.cnt.fencesDrained++
		}
	}
}

// unfence frees s's fenced slots; false if it had none (already freed).
func (core *Core) unfence(s *Session) bool {
	objs, ok := core.fences[s]
	if !ok || core.closed {
		return false
	}
	delete(core.fences, s)
	if s.lifted != nil {
		close(s.lifted)
		s.lifted = nil
	}
	for _, i := range objs {
		core.l1.Free(i)
	}
	return true
}
