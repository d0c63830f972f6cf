package ipc

import (
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ServerConn is one client session on the server side. One goroutine calls
// Recv (or Serve); Send and AnnounceSegment are safe from any goroutine.
type ServerConn struct {
	session
	hello Hello
	cred  unix.Ucred
	id    uint64
	l     *Listener

	recvMu    sync.Mutex
	sendMu    sync.Mutex
	announced map[uint32]bool              // under sockMu
	logged    atomic.Bool                  // the end of the session was logged (once)
	strays    logLimiter                   // WARNs for unexpected socket messages
	respFlags atomic.Pointer[func() uint8] // SetResponseFlags
}

// Hello is what the client said in its hello.
func (c *ServerConn) Hello() Hello { return c.hello }

// PeerCred is the client's pid/uid/gid from SO_PEERCRED.
func (c *ServerConn) PeerCred() unix.Ucred { return c.cred }

// ID is the session number (unique per listener).
func (c *ServerConn) ID() uint64 { return c.id }

// Done is closed when the session ends (peer closed or died, heartbeat
// missed, malformed input, Close). Then free the session's resources.
func (c *ServerConn) Done() <-chan struct{} { return c.done }

// Err says why the session ended; nil while it is open.
func (c *ServerConn) Err() error { return c.err() }

// Close ends the session.
func (c *ServerConn) Close() error {
	c.closeWith(fmt.Errorf("%w: session closed by server", ErrClosed))
	return nil
}

func (c *ServerConn) closeWith(err error) {
	if c.closed.Load() || !c.logged.CompareAndSwap(false, true) {
		return
	}
	switch {
	case errors.Is(err, ErrClosed):
		c.log.Debug("kvshim ipc: session closed", "reason", err)
	case errors.Is(err, ErrNoHeartbeat):
		// Dead, or stalled and perhaps about to resume: its staging
		// slots are fenced (server/doc.go), which an operator should see.
		c.log.Warn("kvshim ipc: session ended", "reason", err)
	case errors.Is(err, ErrPeerGone):
		// A client that closes (or exits) ends its session: routine, so
		// not worth a line at the default level.
		c.log.Debug("kvshim ipc: session ended", "reason", err)
	default:
		c.log.Warn("kvshim ipc: session closed", "reason", err)
	}
	c.shutdown(err)
}

// watchSocket blocks on the socket (0 CPU) and ends the session when the
// client closes it or dies. Clients send nothing after the hello; what
// they send anyway is dropped, with a WARN line for the first message and
// at most one per warnEvery after it (a client that floods the socket
// cannot flood the log).
func (c *ServerConn) watchSocket() {
	buf := make([]byte, maxSockMsg)
	for {
		kind, _, fds, err := recvSock(c.uc, buf, time.Time{})
		if err != nil {
			if n := c.strays.flush(); n > 0 {
				c.log.Warn("kvshim ipc: ignored more unexpected socket messages", "suppressed", n)
			}
			c.closeWith(fmt.Errorf("client socket: %w", err))
			return
		}
		closeFds(fds)
		if ok, n := c.strays.allow(time.Now()); ok {
			c.log.Warn("kvshim ipc: ignoring unexpected socket message", "kind", kind, "suppressed", n)
		}
	}
}

// warnEvery is the least time between two WARN lines of one kind on one
// session, after its first.
const warnEvery = 10 * time.Second

// logLimiter rate-limits one kind of log line: the first passes, then at
// most one per warnEvery; the lines held back are counted and reported by
// the next one that passes (or by flush). Safe for concurrent use.
type logLimiter struct {
	mu         sync.Mutex
	last       time.Time // when a line last passed; zero: never
	suppressed int
}

// allow reports whether a line may be logged at now and, when it may, how
// many were held back since the last one.
func (l *logLimiter) allow(now time.Time) (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < warnEvery {
		l.suppressed++
		return false, 0
	}
	suppressed, l.last, l.suppressed = l.suppressed, now, 0
	return true, suppressed
}

// flush returns (and forgets) the count of lines held back since the last
// one logged, for a final line when the session ends.
func (l *logLimiter) flush() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.suppressed
	l.suppressed = 0
	return n
}

// AnnounceSegment sends s (id, size, fd) to the client unless it was sent
// already. Call it before sending any response that names a Loc in s: the
// client's socket reader maps it and Client.Resolve waits for it.
func (c *ServerConn) AnnounceSegment(s *Segment) error {
	c.sockMu.Lock()
	defer c.sockMu.Unlock()
	return c.announceLocked(s)
}

func (c *ServerConn) announceLocked(s *Segment) error {
	if c.announced[s.ID()] {
		return nil
	}
	if c.closed.Load() {
		return c.errOrClosed()
	}
	if err := sendSock(c.uc, sockSegment, appendSegmentMsg(nil, s.ID(), s.Size()), s.Fd()); err != nil {
		return err
	}
	c.announced[s.ID()] = true
	return nil
}

func (c *ServerConn) errOrClosed() error {
	if err := c.err(); err != nil {
		return err
	}
	return ErrClosed
}

// Recv waits up to timeout for the next request. The body is a copy the
// caller owns. ErrTimeout leaves the session open; any other error means the
// session has ended (malformed or stalled records end it, with a log line).
func (c *ServerConn) Recv(timeout time.Duration) (FrameHeader, []byte, error) {
	var out []byte
	h, err := c.recv(timeout, func(h FrameHeader, body []byte) error {
		out = append([]byte(nil), body...)
		return nil
	})
	return h, out, err
}

// recv reads one request and calls fn with its body, which aliases the ring
// and is valid only during fn.
func (c *ServerConn) recv(timeout time.Duration, fn func(FrameHeader, []byte) error) (FrameHeader, error) {
	if !c.acquire() {
		return FrameHeader{}, c.errOrClosed()
	}
	defer c.release()
	c.recvMu.Lock()
	defer c.recvMu.Unlock()
	h, body, err := c.readFrame(time.Now().Add(timeout))
	if err == nil && h.Flags&FlagResponse != 0 {
		c.rx.Release()
		err = fmt.Errorf("%w: response flag on a request", ErrMalformed)
	}
	if err != nil {
		if isFatal(err) {
			c.closeWith(err)
		}
		return FrameHeader{}, err
	}
	err = fn(h, body)
	c.rx.Release()
	if err != nil {
		c.closeWith(err)
		return FrameHeader{}, err
	}
	return h, nil
}

// Send writes a response frame (FlagResponse is set for you). It waits up to
// SendTimeout for room; ErrRingFull then (the client stopped reading).
func (c *ServerConn) Send(h FrameHeader, body []byte) error {
	if !c.acquire() {
		return c.errOrClosed()
	}
	defer c.release()
	h.Flags |= FlagResponse
	c.sendMu.Lock()
	err := c.sendFrame(h, body, time.Now().Add(c.l.cfg.SendTimeout))
	c.sendMu.Unlock()
	if isFatal(err) {
		c.closeWith(err)
	}
	return err
}

// Handler answers one request. body aliases the ring and is valid only
// during the call. It returns the frame status and the response body (for a
// non-OK status: an error message, see AppendError). A non-nil error ends
// the session (use it for malformed requests); it is logged. Serve copies
// the returned body into the ring before the next call, so a handler may
// reuse one buffer for its answers.
type Handler func(op Op, body []byte) (Status, []byte, error)

// SetResponseFlags makes Serve set f()'s flags (FlagEventsPending) in the
// header of every answer, computed after the handler ran.
func (c *ServerConn) SetResponseFlags(f func() uint8) { c.respFlags.Store(&f) }

// serveSlice bounds each Recv in Serve. The session's end interrupts the
// ring (shutdown), so Done needs no polling; each new Recv spins before it
// sleeps, which a 1 s slice made a per-session wake-up and spin every
// second of an idle server (kvshim-bench-idle).
const serveSlice = 30 * time.Second

// Serve runs the session: receive, call h, send the answer, until the
// session ends. It returns the reason (never nil). A handler panic is
// recovered, logged and answered with StatusInternal.
func (c *ServerConn) Serve(h Handler) error {
	for {
		var st Status
		var resp []byte
		hdr, err := c.recv(serveSlice, func(hdr FrameHeader, body []byte) (herr error) {
			defer func() {
				if p := recover(); p != nil {
					c.log.Error("kvshim ipc: handler panic", "op", hdr.Op, "panic", p, "stack", string(debug.Stack()))
					st, resp, herr = StatusInternal, AppendError(nil, fmt.Sprintf("handler panic: %v", p)), nil
				}
			}()
			st, resp, herr = h(hdr.Op, body)
			return herr
		})
		if errors.Is(err, ErrTimeout) {
			continue
		}
		if err != nil {
			return err
		}
		var fl uint8
		if f := c.respFlags.Load(); f != nil {
			fl = (*f)()
		}
		if err := c.Send(FrameHeader{Flags: fl, Op: hdr.Op, Status: st, ReqID: hdr.ReqID}, resp); err != nil {
			if !isFatal(err) {
				c.closeWith(fmt.Errorf("response for request %d: %w", hdr.ReqID, err))
			}
			return c.errOrClosed()
		}
	}
}
