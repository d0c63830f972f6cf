package ipc

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
)

// A direct client is a Client of a server in the same process that calls
// the server's session handler instead of crossing a ring: no frame is
// written, no thread is woken, nothing waits on a futex. It is what the
// embedded server's own scheduler uses (lookups are the calls it makes on
// the request path); workers, which move bytes through L1, keep the rings.
//
// Semantics are the ring's: the same Handler (ServiceHandler over the
// server's per-session Service) decodes the same encoded request and
// encodes the same answer, one call at a time per session (the ring's
// server loop is serial too), and ending either side ends the session and
// releases what it holds, as a socket's close does.

// DirectDialer opens an in-process session for hello: the session's
// Handler and a function that ends it on the server (releasing what it
// holds; called once, after the client's last call). kill ends the client
// from the server's side (the server stopping); the dialer keeps it.
type DirectDialer func(hello Hello, kill *Client) (h Handler, end func(), err error)

var direct struct {
	mu sync.Mutex
	m  map[string]*DirectDialer
}

// RegisterDirect makes path's server reachable by DialDirect in this
// process; unregister removes it (a server that stops).
func RegisterDirect(path string, d DirectDialer) (unregister func()) {
	direct.mu.Lock()
	defer direct.mu.Unlock()
	if direct.m == nil {
		direct.m = map[string]*DirectDialer{}
	}
	mine := &d
	direct.m[path] = mine
	return func() {
		direct.mu.Lock()
		defer direct.mu.Unlock()
		if direct.m[path] == mine { // not a later server's on the same path
			delete(direct.m, path)
		}
	}
}

// HasDirect reports whether a server on path runs in this process.
func HasDirect(path string) bool {
	direct.mu.Lock()
	defer direct.mu.Unlock()
	return direct.m[path] != nil
}

// DialDirect opens a direct session with the in-process server on path
// (ErrRefused when there is none). The client has no L1 mappings: it is for
// control calls (lookups, FREE, STATS), not for Resolve.
func DialDirect(path string, hello Hello, cfg *ClientConfig) (*Client, error) {
	direct.mu.Lock()
	d := direct.m[path]
	direct.mu.Unlock()
	if d == nil {
		return nil, fmt.Errorf("%w: no server on %s in this process", ErrRefused, path)
	}
	var cc ClientConfig
	if cfg != nil {
		cc = *cfg
	}
	cc = cc.withDefaults()
	if hello.Version == 0 {
		hello.Version = ProtocolVersion
	}
	if hello.Instance == uuid.Nil {
		hello.Instance = uuid.New()
	}
	c := &Client{cfg: cc, hello: hello, segs: NewSegmentTable(), direct: &directConn{}}
	c.session = session{done: make(chan struct{}), freed: make(chan struct{}),
		log: cc.Logger.With("role", hello.Role.String(), "direct", true)}
	h, end, err := (*d)(hello, c)
	if err != nil {
		return nil, fmt.Errorf("ipc: direct session on %s: %w", path, err)
	}
	c.direct.h = h
	c.onFree = end
	return c, nil
}

// directConn is a direct client's handler; mu serialises calls (the
// handler reuses its answer buffer and the session's state is the ring
// loop's: one request at a time).
type directConn struct {
	mu sync.Mutex
	h  Handler
}

// EndDirect ends a direct client's session from the server's side (the
// server stopping): calls fail with ErrPeerGone, as after a socket's close.
func (c *Client) EndDirect(why error) {
	c.shutdown(fmt.Errorf("%w: %v", ErrPeerGone, why))
}

// callDirect is Call for a direct client.
func (c *Client) callDirect(ctx context.Context, op Op, body []byte) (Status, []byte, error) {
	if !c.acquire() {
		return 0, nil, c.errOrClosed()
	}
	defer c.release()
	d := c.direct
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return 0, nil, fmt.Errorf("%w: %v", ErrTimeout, err)
	}
	if c.closed.Load() { // ended while this call waited for the lock
		return 0, nil, c.errOrClosed()
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return 0, nil, fmt.Errorf("%w: deadline passed", ErrTimeout)
	}
	st, resp, err := d.h(op, body)
	if err != nil {
		// A malformed request ends a ring session; so it does here.
		c.shutdown(err)
		return 0, nil, err
	}
	return st, append([]byte(nil), resp...), nil
}

// IsDirect reports whether c is a direct (in-process) client.
func (c *Client) IsDirect() bool { return c.direct != nil }
