package shim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/ipc"
)

// ErrUnavailable means the server cannot be reached right now. Callers treat
// it as a cache miss (lookups) or a load error (loads), never as a hang.
var ErrUnavailable = errors.New("kvshim server unavailable")

// link is a connection to the server that redials on demand. A dead or
// absent server makes calls fail fast with ErrUnavailable; the next call
// after RedialEvery tries again, so the connector recovers by itself when a
// server comes back.
type link struct {
	path    string
	hello   ipc.Hello
	timeout time.Duration
	redial  time.Duration

	mu      sync.Mutex
	c       *ipc.Client
	ended   []*ipc.Client // earlier clients whose mappings may still be in use
	lastTry time.Time
	lastErr error
	onDial  func(*ipc.Client) // called with each new client (e.g. to pin its L1 ahead of copies)
	warned  time.Time         // last "cannot reach" warning (at most one per warnEvery)
	down    bool              // the last dial failed: say so again when it comes back
	// populate is how each new client fills its page tables of L1 (a CPU
	// worker's: ipc.PopulateAuto; off for a scheduler, and for a GPU
	// worker, whose cuMemHostRegister of each segment does that work).
	populate ipc.PopulateMode
	closed   bool // close ran: prewarm dials no more
	// direct: a server on path in this process is called directly
	// (ipc.DialDirect), not over a ring: a scheduler's lookups then cross no
	// thread. Workers keep the ring (their L1 mappings come with it).
	direct bool
}

// LookupPathEnv set to "ring" makes every scheduler of the process ask an
// in-process server over the ring (SchedulerConfig.RingOnly for all: an
// A/B through the C ABI, e.g. make bench-peer's embedded rows).
const LookupPathEnv = "KVSHIM_LOOKUP_PATH"

// directUnless turns on direct calls to an in-process server unless
// ringOnly or LookupPathEnv says ring.
func (l *link) directUnless(ringOnly bool) *link {
	l.direct = !ringOnly && os.Getenv(LookupPathEnv) != "ring"
	return l
}

// warnEvery rate-limits the warning of a link that cannot reach its server.
const warnEvery = 30 * time.Second

func newLink(path string, role ipc.Role, instance uuid.UUID, timeout time.Duration) *link {
	return &link{
		path:    path,
		hello:   ipc.Hello{Version: ipc.ProtocolVersion, Role: role, PID: uint32(os.Getpid()), Instance: instance},
		timeout: timeout,
		redial:  time.Second,
	}
}

// client returns a live client, dialling when there is none and the last
// attempt is older than the redial interval.
func (l *link) client() (*ipc.Client, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.c != nil {
		select {
		case <-l.c.Done():
			l.lastErr = l.c.Err()
			l.dropLocked()
		default:
			return l.c, nil
		}
	}
	if !l.lastTry.IsZero() && time.Since(l.lastTry) < l.redial {
		return nil, fmt.Errorf("%w: %s: %v", ErrUnavailable, l.path, l.lastErr)
	}
	l.lastTry = time.Now()
	c, err := l.dialLocked()
	if err != nil {
		l.lastErr = err
		if time.Since(l.warned) >= warnEvery {
			l.warned = time.Now()
			slog.Warn("kvshim: cannot reach the server; lookups are misses and saves are skipped until it is back",
				"socket", l.path, "role", l.hello.Role.String(), "err", err)
		}
		l.down = true
		return nil, fmt.Errorf("%w: %s: %v", ErrUnavailable, l.path, err)
	}
	if l.down {
		slog.Info("kvshim: server reachable again", "socket", l.path, "role", l.hello.Role.String())
		l.down, l.warned = false, time.Time{}
	}
	l.c, l.lastErr = c, nil
	if l.onDial != nil {
		l.onDial(c)
	}
	return c, nil
}

func (l *link) dialLocked() (*ipc.Client, error) {
	if l.direct && ipc.HasDirect(l.path) {
		return ipc.DialDirect(l.path, l.helloLocked(), nil)
	}
	return ipc.DialConfig(l.path, l.helloLocked(), l.timeout, &ipc.ClientConfig{Populate: l.populate})
}

// prewarm dials now, if there is no client yet and the server's socket
// exists, so that a CPU worker's mappings are populated before its first
// save rather than during it. A failure is not recorded (the first real
// call dials, warns and backs off as usual): the worker may register its
// caches before the scheduler has started the embedded server.
func (l *link) prewarm() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.c != nil {
		return
	}
	if fi, err := os.Stat(l.path); err != nil || fi.Mode()&os.ModeSocket == 0 {
		return
	}
	c, err := l.dialLocked()
	if err != nil {
		return
	}
	l.c = c
	if l.onDial != nil {
		l.onDial(c)
	}
}

// current is the live client, if any, without dialling.
func (l *link) current() *ipc.Client {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.c
}

// setPopulate sets how later clients populate their mappings.
func (l *link) setPopulate(m ipc.PopulateMode) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.populate = m
}

// helloLocked is the hello of the next dial: it says HelloDrained once
// every earlier client has ended with its mappings gone (no job of ours can
// write into the L1 slots the server fenced when those sessions ended).
func (l *link) helloLocked() ipc.Hello {
	live := l.ended[:0]
	for _, c := range l.ended {
		select {
		case <-c.Freed():
		default:
			live = append(live, c)
		}
	}
	clear(l.ended[len(live):])
	l.ended = live
	h := l.hello
	if len(l.ended) == 0 {
		h.Flags |= ipc.HelloDrained
	}
	return h
}

// dropLocked ends the current client; its mappings stay until its jobs are
// done with them (ipc.Client.Use).
func (l *link) dropLocked() {
	l.c.Close()
	l.ended = append(l.ended, l.c)
	l.c = nil
}

// call runs fn with a live client and the call timeout. A transport failure
// (anything but a server's status answer) drops the client so the next call
// redials.
func (l *link) call(fn func(ctx context.Context, c *ipc.Client) error) error {
	c, err := l.client()
	if err != nil {
		return err
	}
	return l.callOn(c, fn)
}

// callOn runs fn on c, which must be the client whose session a request
// belongs to (a COMMIT of what an ALLOC of c staged, a RELEASE of c's
// holds): on another session it would name other objects or none.
func (l *link) callOn(c *ipc.Client, fn func(ctx context.Context, c *ipc.Client) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), l.timeout)
	defer cancel()
	err := fn(ctx, c)
	if err != nil && !errors.Is(err, ipc.ErrRemote) {
		l.mu.Lock()
		if l.c == c {
			l.dropLocked()
			l.lastErr = err
			l.lastTry = time.Time{} // a broken session may mean a restarted server: redial at once
		}
		l.mu.Unlock()
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return err
}

// setOnDial calls f with the current client, if any, and every later one.
func (l *link) setOnDial(f func(*ipc.Client)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.onDial = f
	if l.c != nil {
		f(l.c)
	}
}

func (l *link) close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.c == nil {
		return nil
	}
	l.dropLocked()
	return nil
}
