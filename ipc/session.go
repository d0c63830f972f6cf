package ipc

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// session is the lifetime shared by ServerConn and Client: the socket, the
// ring pair mapping, a done channel, and a reference count so the mapping is
// unmapped only after the last goroutine using the rings has left.
type session struct {
	uc   *net.UnixConn
	pair *Segment
	rx   *Ring // ring this side consumes
	tx   *Ring // ring this side produces
	log  *slog.Logger

	sockMu sync.Mutex // serialises socket writes

	refs     atomic.Int64
	closed   atomic.Bool
	done     chan struct{}
	freed    chan struct{} // closed once the mappings are gone (nil: not tracked)
	errp     atomic.Pointer[error]
	closeMu  sync.Once
	freeOnce sync.Once
	onFree   func()
}

func (s *session) acquire() bool {
	s.refs.Add(1)
	if s.closed.Load() {
		s.release()
		return false
	}
	return true
}

func (s *session) release() {
	if s.refs.Add(-1) == 0 && s.closed.Load() {
		s.freeOnce.Do(s.free)
	}
}

func (s *session) free() {
	if s.pair != nil {
		s.pair.Close()
	}
	if s.onFree != nil {
		s.onFree()
	}
	if s.freed != nil {
		close(s.freed)
	}
}

// err returns why the session ended (nil while open).
func (s *session) err() error {
	if p := s.errp.Load(); p != nil {
		return *p
	}
	return nil
}

// shutdown ends the session once: records err, wakes every waiter, tells
// the peer (shared closed flag, socket close), and frees the mapping when
// no goroutine uses it.
func (s *session) shutdown(err error) {
	s.closeMu.Do(func() {
		if err == nil {
			err = ErrClosed
		}
		s.refs.Add(1) // hold the mapping while we touch the rings below
		s.errp.Store(&err)
		s.closed.Store(true)
		if s.rx != nil {
			s.rx.Interrupt(err)
			s.tx.Interrupt(err)
			s.tx.shutdown(shutCode(err))
		}
		if s.uc != nil {
			s.uc.Close()
		}
		close(s.done)
		s.release()
	})
}

// heartbeat stores our beat in the ring we produce and checks the peer's in
// the ring we consume, until done. A peer silent for expire ends the session
// through end (which logs, then calls shutdown). (A server's sessions share
// one ticker instead: Listener.beats.)
func (s *session) heartbeat(every, expire time.Duration, end func(error)) {
	if every <= 0 {
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
		}
		live, err := s.beat(expire)
		if err != nil {
			end(err)
		}
		if !live || err != nil {
			return
		}
	}
}

// beat is one heartbeat: our beat stored, the peer's checked. live is false
// once the session is closed; err says the peer has been silent too long.
func (s *session) beat(expire time.Duration) (live bool, err error) {
	if !s.acquire() {
		return false, nil
	}
	s.tx.BeatProducer()
	last := s.rx.ProducerBeat()
	s.release()
	if expire > 0 && last != 0 {
		if age := time.Duration(MonoNow() - last); age > expire {
			return true, fmt.Errorf("%w: %w for %v (limit %v)", ErrPeerGone, ErrNoHeartbeat, age.Round(time.Millisecond), expire)
		}
	}
	return true, nil
}

// isFatal reports whether a ring error must end the session.
func isFatal(err error) bool {
	return err != nil && !errors.Is(err, ErrTimeout) && !errors.Is(err, ErrRingFull)
}

// sendFrame writes one frame (header + body) to tx. Callers serialise.
func (s *session) sendFrame(h FrameHeader, body []byte, deadline time.Time) error {
	buf, err := s.tx.Claim(RecordFrame, FrameHeaderLen+len(body), deadline)
	if err != nil {
		return err
	}
	AppendFrameHeader(buf[:0], h)
	copy(buf[FrameHeaderLen:], body)
	s.tx.Commit()
	return nil
}

// readFrame waits for the next frame on rx. The body aliases the ring until
// rx.Release. Malformed frames come back as errors wrapping ErrMalformed.
func (s *session) readFrame(deadline time.Time) (FrameHeader, []byte, error) {
	typ, p, err := s.rx.Read(deadline)
	if err != nil {
		return FrameHeader{}, nil, err
	}
	if typ != RecordFrame {
		s.rx.Release()
		return FrameHeader{}, nil, fmt.Errorf("%w: record type %d", ErrMalformed, typ)
	}
	h, body, err := DecodeFrame(p)
	if err != nil {
		s.rx.Release()
		return FrameHeader{}, nil, err
	}
	return h, body, nil
}
