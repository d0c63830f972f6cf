package ipc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
)

// ClientConfig tunes Dial. The zero value (or nil) takes the defaults.
type ClientConfig struct {
	Ring        RingOptions   // spin before sleeping, stall timeout, wait slice
	CallTimeout time.Duration // for Call contexts without a deadline; default 5 s
	// SegmentWait bounds how long Resolve waits for an announcement of a
	// segment it does not know yet; default 1 s.
	SegmentWait time.Duration
	// ServerUIDs are the uids besides this process's own that may serve it
	// (checked with SO_PEERCRED before the hello): a socket in a shared
	// directory answered by another user's process is refused.
	ServerUIDs []uint32
	Logger     *slog.Logger
	// Populate: how the client fills its own page tables of each L1
	// segment, in the background as segments are mapped (populate.go; off
	// by default: a client that writes no L1 needs none). KVSHIM_POPULATE
	// overrides a mode that is not off.
	Populate PopulateMode
}

func (c ClientConfig) withDefaults() ClientConfig {
	if c.CallTimeout <= 0 {
		c.CallTimeout = 5 * time.Second
	}
	if c.SegmentWait <= 0 {
		c.SegmentWait = time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Client is one session with a server. Call, the typed helpers and Resolve
// are safe from any number of goroutines (e.g. exported C functions called
// from Python threads).
type Client struct {
	session
	cfg     ClientConfig
	hello   Hello
	segs    *SegmentTable
	server  uuid.UUID
	id      uint64
	nextReq atomic.Uint64

	submitMu sync.Mutex    // one producer on the submission ring
	token    chan struct{} // holder is the only reader of the completion ring
	pendMu   sync.Mutex
	pending  map[uint64]chan reply

	pop    *populator  // nil: mappings fault on first touch
	direct *directConn // non-nil: an in-process session (direct.go), no rings

	evPending atomic.Bool // the server has KV events queued for this session (events.go)
}

type reply struct {
	status Status
	body   []byte
}

// Dial connects to the server at path, says hello and maps the ring pair
// and the L1 segments the server sends. Zero Hello fields are filled in
// (Version, PID, Instance); Role is required.
func Dial(path string, hello Hello, timeout time.Duration) (*Client, error) {
	return DialConfig(path, hello, timeout, nil)
}

// DialConfig is Dial with options (cfg may be nil).
func DialConfig(path string, hello Hello, timeout time.Duration, cfg *ClientConfig) (*Client, error) {
	var cc ClientConfig
	if cfg != nil {
		cc = *cfg
	}
	cc = cc.withDefaults()
	mode, err := populateMode(cc.Populate)
	if err != nil {
		return nil, fmt.Errorf("ipc: dial %s: %w", path, err)
	}
	cc.Populate = mode
	if hello.Version == 0 {
		hello.Version = ProtocolVersion
	}
	if hello.PID == 0 {
		hello.PID = uint32(os.Getpid())
	}
	if hello.Instance == uuid.Nil {
		hello.Instance = uuid.New()
	}
	if err := CheckSocketPath(path); err != nil {
		return nil, err
	}
	if fi, err := os.Stat(path); err == nil && fi.Mode()&os.ModeSocket == 0 {
		return nil, fmt.Errorf("ipc: dial %s: not a socket (%s): %w", path, fi.Mode().Type(), syscall.ENOTSOCK)
	}
	deadline := time.Now().Add(timeout)
	nc, err := net.DialTimeout("unixpacket", path, timeout)
	if err != nil {
		return nil, fmt.Errorf("ipc: dial %s: %w", path, err)
	}
	uc := nc.(*net.UnixConn)
	cred, err := peerCred(uc)
	if err == nil {
		err = CheckPeerCred(cred, uint32(os.Getuid()), cc.ServerUIDs)
	}
	if err != nil {
		uc.Close()
		return nil, fmt.Errorf("ipc: dial %s: server: %w", path, err)
	}
	c, err := handshakeClient(uc, hello, deadline, cc)
	if err != nil {
		uc.Close()
		return nil, fmt.Errorf("ipc: dial %s: %w", path, err)
	}
	return c, nil
}

func handshakeClient(uc *net.UnixConn, hello Hello, deadline time.Time, cfg ClientConfig) (*Client, error) {
	if err := sendSock(uc, sockHello, AppendHello(nil, hello), -1); err != nil {
		return nil, err
	}
	buf := make([]byte, maxSockMsg)
	kind, body, fds, err := recvSock(uc, buf, deadline)
	if err != nil {
		return nil, err
	}
	switch {
	case kind == sockRefuse:
		closeFds(fds)
		return nil, decodeRefuse(body)
	case kind != sockWelcome || len(fds) != 1:
		closeFds(fds)
		return nil, fmt.Errorf("%w: expected welcome with one fd, got kind %d with %d fds", ErrMalformed, kind, len(fds))
	}
	w, err := decodeWelcome(body)
	if err != nil {
		closeFds(fds)
		return nil, err
	}
	sqSize, cqSize := RingSize(w.SQCap), RingSize(w.CQCap)
	if w.SQCap > MaxRingCapacity || w.CQCap > MaxRingCapacity {
		closeFds(fds)
		return nil, fmt.Errorf("%w: ring capacities %d/%d", ErrMalformed, w.SQCap, w.CQCap)
	}
	pair, err := MapSegment(0, fds[0], sqSize+cqSize)
	if err != nil {
		return nil, err
	}
	mem := pair.Mem()
	sq, err := AttachRing(mem[:sqSize], cfg.Ring)
	var cq *Ring
	if err == nil {
		cq, err = AttachRing(mem[sqSize:], cfg.Ring)
	}
	if err == nil && (sq.Capacity() != w.SQCap || cq.Capacity() != w.CQCap) {
		err = fmt.Errorf("%w: ring capacities differ from welcome", ErrCorrupt)
	}
	if err != nil {
		pair.Close()
		return nil, err
	}
	c := &Client{cfg: cfg, hello: hello, segs: NewSegmentTable(), server: w.Server, id: w.Session,
		token: make(chan struct{}, 1), pending: map[uint64]chan reply{}}
	c.session = session{uc: uc, pair: pair, rx: cq, tx: sq, done: make(chan struct{}), freed: make(chan struct{}),
		log: cfg.Logger.With("session", w.Session, "role", hello.Role.String())}
	c.onFree = func() { c.segs.CloseAll() }
	for c.segs.Len() < int(w.Segments) {
		if err := c.readSocket(buf, deadline); err != nil {
			c.shutdown(err)
			return nil, err
		}
	}
	uc.SetReadDeadline(time.Time{})
	sq.BeatProducer()
	if cfg.Populate != PopulateOff {
		c.pop = newPopulator(c, cfg.Populate)
		c.segs.Subscribe(c.pop.enqueue) // the session's end closes the table; no cancel needed
	}
	go c.watchSocket()
	go c.heartbeat(w.BeatEvery, w.BeatExpire, func(err error) {
		c.log.Warn("kvshim ipc: server missed its heartbeat; ending the session", "reason", err)
		c.shutdown(err)
	})
	return c, nil
}

func decodeRefuse(body []byte) error {
	d := newDec("refusal", body)
	code := d.u32()
	if d.err != nil {
		return fmt.Errorf("%w: %v", ErrRefused, d.err)
	}
	msg, _ := DecodeError(body[4:])
	switch code {
	case refuseVersion:
		return fmt.Errorf("%w: %w: %s", ErrRefused, ErrVersion, msg)
	case refusePermission:
		return fmt.Errorf("%w: %w: %s", ErrRefused, ErrPermission, msg)
	}
	return fmt.Errorf("%w: %s", ErrRefused, msg)
}

// readSocket handles one server socket message (a segment announcement).
func (c *Client) readSocket(buf []byte, deadline time.Time) error {
	kind, body, fds, err := recvSock(c.uc, buf, deadline)
	if err != nil {
		return err
	}
	switch kind {
	case sockSegment:
		id, size, err := decodeSegmentMsg(body)
		if err != nil || len(fds) != 1 {
			closeFds(fds)
			return fmt.Errorf("%w: segment announcement (%d fds): %v", ErrMalformed, len(fds), err)
		}
		s, err := MapSegment(id, fds[0], size)
		if err != nil {
			return err
		}
		if err := c.segs.Add(s); err != nil {
			s.Close()
			return fmt.Errorf("%w: %v", ErrMalformed, err)
		}
		return nil
	case sockRefuse:
		closeFds(fds)
		return decodeRefuse(body)
	}
	closeFds(fds)
	return fmt.Errorf("%w: unexpected socket message kind %d", ErrMalformed, kind)
}

// watchSocket maps announced segments and ends the session when the server
// closes the socket or dies. It blocks in the netpoller: no CPU while idle.
func (c *Client) watchSocket() {
	buf := make([]byte, maxSockMsg)
	for {
		if !c.acquire() {
			return
		}
		err := c.readSocket(buf, time.Time{})
		c.release()
		if err != nil {
			if !c.closed.Load() {
				c.log.Warn("kvshim ipc: session ended", "reason", err)
			}
			c.shutdown(fmt.Errorf("server socket: %w", err))
			return
		}
	}
}

// Hello is the hello this client sent (with defaults filled in).
func (c *Client) Hello() Hello { return c.hello }

// Server is the server's instance id; Session is this session's number.
func (c *Client) Server() uuid.UUID { return c.server }

// Session is the server-assigned session number.
func (c *Client) Session() uint64 { return c.id }

// Segments is the table of mapped L1 segments.
func (c *Client) Segments() *SegmentTable { return c.segs }

// Resolve returns the bytes of loc in a mapped segment, range-checked. An
// unknown segment is waited for (SegmentWait) since its announcement may
// still be in the socket. Slices are invalid after Close.
func (c *Client) Resolve(loc Loc) ([]byte, error) {
	if b, err := c.segs.Resolve(loc); err == nil {
		return b, nil
	}
	return c.segs.ResolveWait(loc, c.cfg.SegmentWait)
}

// Use marks the session's mappings (rings and L1 segments) in use: they
// stay mapped, even after the session ends, until done is called. Every job
// that reads or writes L1 memory it resolved through this client holds a
// use from before Resolve until its last access (a copy's completion, a
// checksum, a seal); so a dead server or an expired heartbeat turns into
// failed jobs, never a fault on unmapped memory. done is idempotent. Use
// fails once the session has ended.
func (c *Client) Use() (done func(), err error) {
	if !c.acquire() {
		return nil, c.errOrClosed()
	}
	var once sync.Once
	return func() { once.Do(c.release) }, nil
}

// Live reports whether the session is still open on both sides: neither
// this side nor the server has ended it (the server marks the shared ring
// shut down before it releases anything the session holds). Call it while
// holding a Use. A load that finds Live true after its copy has completed
// read objects whose read holds were in place for the whole copy.
func (c *Client) Live() bool {
	return !c.closed.Load() && (c.rx == nil || !c.rx.IsShutdown())
}

// Freed is closed once the session has ended and every Use is done: its
// mappings are gone, so nothing this client resolved can be written any
// more (see HelloDrained).
func (c *Client) Freed() <-chan struct{} { return c.freed }

// Done is closed when the session ends; Err says why.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err says why the session ended; nil while it is open.
func (c *Client) Err() error { return c.err() }

// Close ends the session and unmaps everything once no call is running.
func (c *Client) Close() error {
	c.shutdown(fmt.Errorf("%w: client closed", ErrClosed))
	return nil
}

func (c *Client) errOrClosed() error {
	if err := c.err(); err != nil {
		return err
	}
	return ErrClosed
}

// Call sends one request and waits for its answer (matched by request id).
// The deadline is ctx's, or CallTimeout. It returns the frame status and the
// body (an error message when the status is not OK). Errors: ErrTimeout,
// ErrRingFull, or the session's end reason (ErrPeerGone, ...).
func (c *Client) Call(ctx context.Context, op Op, body []byte) (Status, []byte, error) {
	if c.direct != nil {
		return c.callDirect(ctx, op, body)
	}
	if !c.acquire() {
		return 0, nil, c.errOrClosed()
	}
	defer c.release()
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(c.cfg.CallTimeout)
	}
	id := c.nextReq.Add(1)
	ch := make(chan reply, 1)
	c.pendMu.Lock()
	c.pending[id] = ch
	c.pendMu.Unlock()
	defer func() {
		c.pendMu.Lock()
		delete(c.pending, id)
		c.pendMu.Unlock()
	}()

	c.submitMu.Lock()
	err := c.sendFrame(FrameHeader{Op: op, ReqID: id}, body, deadline)
	c.submitMu.Unlock()
	if err != nil {
		if isFatal(err) {
			c.shutdown(err)
		}
		return 0, nil, err
	}
	for {
		select {
		case r := <-ch:
			return r.status, r.body, nil
		case c.token <- struct{}{}:
			r, got, err := c.readReplies(ctx, id, ch, deadline)
			<-c.token
			if got || err != nil {
				return r.status, r.body, err
			}
		case <-ctx.Done():
			return 0, nil, fmt.Errorf("%w: %v", ErrTimeout, ctx.Err())
		case <-c.done:
			return 0, nil, c.errOrClosed()
		}
	}
}

// readReplies runs while holding the reader token: it reads completions,
// hands other callers theirs, and returns when its own arrives (got), when
// another caller's arrived (so that caller can take over), or on error.
func (c *Client) readReplies(ctx context.Context, id uint64, ch chan reply, deadline time.Time) (reply, bool, error) {
	select {
	case r := <-ch:
		return r, true, nil
	default:
	}
	for {
		slice := deadline
		if ctx.Done() != nil {
			slice = minTime(deadline, time.Now().Add(10*time.Millisecond))
		}
		h, body, err := c.readFrame(slice)
		if errors.Is(err, ErrTimeout) {
			if err := ctx.Err(); err != nil {
				return reply{}, false, fmt.Errorf("%w: %v", ErrTimeout, err)
			}
			if time.Now().Before(deadline) {
				continue
			}
			return reply{}, false, fmt.Errorf("%w: no answer to request %d", ErrTimeout, id)
		}
		if err == nil && h.Flags&FlagResponse == 0 {
			c.rx.Release()
			err = fmt.Errorf("%w: request frame on the completion ring", ErrMalformed)
		}
		if err != nil {
			if !c.closed.Load() {
				c.log.Warn("kvshim ipc: completion ring failed, closing session", "err", err)
			}
			c.shutdown(err)
			return reply{}, false, err
		}
		if h.Flags&FlagEventsPending != 0 {
			c.evPending.Store(true)
		}
		r := reply{status: h.Status, body: append([]byte(nil), body...)}
		c.rx.Release()
		if h.ReqID == id {
			return r, true, nil
		}
		c.pendMu.Lock()
		other := c.pending[h.ReqID]
		c.pendMu.Unlock()
		if other == nil {
			c.log.Debug("kvshim ipc: dropping answer to abandoned request", "req", h.ReqID, "op", h.Op)
			continue
		}
		other <- r // buffered, one reply per id
		return reply{}, false, nil
	}
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
