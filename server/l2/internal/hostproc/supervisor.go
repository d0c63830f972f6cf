package hostproc

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvshim/kvshim/server/l2"
)

// Proc is a supervised process: Err is nil while it serves calls and the
// cause of its death after.
type Proc interface {
	comparable
	Err() error
}

// Supervisor holds the current process of a backend and restarts a dead
// one. Set the exported fields before Start; they are not changed after.
type Supervisor[P Proc] struct {
	Name      string            // in errors: "plugin host", "mooncake helper"
	Sentinel  error             // optional: also wrapped by the not-running error (mooncake.ErrHelper)
	Every     time.Duration     // at most one restart per Every
	Spawn     func() (P, error) // starts a process ready to serve
	Stop      func(P)           // ends a process that is no longer current
	OnRestart func(cause error) // before each restart: log it, count it

	mu        sync.Mutex
	cur       P // zero while none
	last      time.Time
	closed    bool
	restartMu sync.Mutex // held by the one caller restarting
	restarts  atomic.Int64
}

// Restarts counts the restarts that succeeded.
func (s *Supervisor[P]) Restarts() int64 { return s.restarts.Load() }

// Start installs the first process (spawned by the caller, so that its
// errors reach New as they are).
func (s *Supervisor[P]) Start(p P) {
	s.mu.Lock()
	s.cur, s.last = p, time.Now()
	s.mu.Unlock()
}

// Current is the current process, dead or alive; zero when none.
func (s *Supervisor[P]) Current() P {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

// Close marks the supervisor closed and returns the process the caller
// must stop (zero when none). Get fails with l2.ErrClosed after.
func (s *Supervisor[P]) Close() P {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.cur
	var zero P
	s.closed, s.cur = true, zero
	return p
}

// Get returns the running process, restarting a dead one: at most once per
// Every and by one caller at a time; the others fail fast with the death's
// cause rather than queue behind a restart that may take seconds.
func (s *Supervisor[P]) Get() (P, error) {
	var zero P
	s.mu.Lock()
	p, closed := s.cur, s.closed
	s.mu.Unlock()
	if closed {
		return zero, l2.ErrClosed
	}
	if p != zero && p.Err() == nil {
		return p, nil
	}
	if !s.restartMu.TryLock() {
		return zero, s.deadErr(p)
	}
	defer s.restartMu.Unlock()
	s.mu.Lock()
	if s.cur != p || time.Since(s.last) < s.Every {
		cur := s.cur
		s.mu.Unlock()
		if cur != p && cur != zero && cur.Err() == nil {
			return cur, nil // another caller restarted it meanwhile
		}
		return zero, s.deadErr(p)
	}
	s.last = time.Now()
	s.mu.Unlock()
	if s.OnRestart != nil {
		s.OnRestart(s.deadErr(p))
	}
	np, err := s.Spawn()
	if err != nil {
		return zero, fmt.Errorf("%w: %s: restart: %w", l2.ErrUnavailable, s.Name, err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.Stop(np)
		return zero, l2.ErrClosed
	}
	s.cur = np
	s.mu.Unlock()
	s.restarts.Add(1)
	if p != zero {
		s.Stop(p) // reap the dead one (its output ended; it may still run)
	}
	return np, nil
}

// deadErr is p's cause of death, or ErrNotRunning when there is none.
func (s *Supervisor[P]) deadErr(p P) error {
	var zero P
	if p != zero {
		if err := p.Err(); err != nil {
			return err
		}
	}
	if s.Sentinel != nil {
		return fmt.Errorf("%w: %s: %w", s.Sentinel, s.Name, ErrNotRunning)
	}
	return fmt.Errorf("%s: %w", s.Name, ErrNotRunning)
}
