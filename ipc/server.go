package ipc

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
)

// ServerConfig tunes Listen. The zero value (or nil) takes the defaults.
type ServerConfig struct {
	SQCapacity        uint64        // submission ring bytes (power of two); default 8 MiB
	CQCapacity        uint64        // completion ring bytes; default 4 MiB
	Ring              RingOptions   // spin, stall timeout, wait slice
	HandshakeTimeout  time.Duration // hello must arrive within; default 5 s
	SendTimeout       time.Duration // Send waits this long on a full CQ; default 5 s
	HeartbeatInterval time.Duration // default 500 ms; negative disables beats
	HeartbeatTimeout  time.Duration // peer silent this long ends the session; default 10 s; negative disables
	AllowUIDs         []uint32      // extra uids accepted besides our own
	// MaxSessionsPerUID bounds the live sessions of one uid (default
	// 256): each costs a ring pair (SQ + CQ capacity of shared memory, 12
	// MiB by default) and its server-side state, so a looping client cannot
	// exhaust the server. A vLLM instance uses 1 + TP sessions.
	MaxSessionsPerUID int
	Instance          uuid.UUID    // server instance id (random if zero)
	Logger            *slog.Logger // default slog.Default()
}

// Default sizes and timeouts.
const (
	DefaultSQCapacity        = 8 << 20
	DefaultCQCapacity        = 4 << 20
	DefaultHandshakeTimeout  = 5 * time.Second
	DefaultSendTimeout       = 5 * time.Second
	DefaultHeartbeatInterval = 500 * time.Millisecond
	DefaultHeartbeatTimeout  = 10 * time.Second
	DefaultMaxSessionsPerUID = 256
)

func (c ServerConfig) withDefaults() ServerConfig {
	if c.SQCapacity == 0 {
		c.SQCapacity = DefaultSQCapacity
	}
	if c.CQCapacity == 0 {
		c.CQCapacity = DefaultCQCapacity
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if c.SendTimeout <= 0 {
		c.SendTimeout = DefaultSendTimeout
	}
	c.HeartbeatInterval = defDur(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.HeartbeatTimeout = defDur(c.HeartbeatTimeout, DefaultHeartbeatTimeout)
	if c.Instance == uuid.Nil {
		c.Instance = uuid.New()
	}
	if c.MaxSessionsPerUID <= 0 {
		c.MaxSessionsPerUID = DefaultMaxSessionsPerUID
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func defDur(v, def time.Duration) time.Duration {
	switch {
	case v == 0:
		return def
	case v < 0:
		return 0
	}
	return v
}

// Listener accepts client sessions on a Unix SOCK_SEQPACKET socket. It owns
// the list of L1 segments every session gets (AddSegment).
type Listener struct {
	ln    *net.UnixListener
	path  string
	cfg   ServerConfig
	segs  *SegmentTable
	ready chan *ServerConn
	quit  chan struct{}
	once  sync.Once
	wg    sync.WaitGroup

	mu      sync.Mutex
	conns   map[*ServerConn]struct{}
	shaking map[*net.UnixConn]struct{} // connections still in the handshake
	perUID  map[uint32]int             // live (and handshaking) sessions by uid
	next    atomic.Uint64
}

// Listen creates the socket at path (its directory is created 0700 if
// missing; the default directory is also checked for ownership and mode),
// chmods it 0600 and starts accepting. A stale socket file nobody listens
// on is replaced; a live one is an error. cfg may be nil.
func Listen(path string, cfg *ServerConfig) (*Listener, error) {
	var c ServerConfig
	if cfg != nil {
		c = *cfg
	}
	c = c.withDefaults()
	for _, capv := range []uint64{c.SQCapacity, c.CQCapacity} {
		if !isPow2(capv) || capv < MinRingCapacity || capv > MaxRingCapacity {
			return nil, fmt.Errorf("ipc: ring capacity %d must be a power of two in [%d, %d]", capv, MinRingCapacity, MaxRingCapacity)
		}
	}
	if err := CheckSocketPath(path); err != nil {
		return nil, err
	}
	dir := filepath.Dir(path)
	if dir == DefaultSocketDir() {
		if err := EnsureSocketDir(dir); err != nil {
			return nil, err
		}
	} else if err := makeSocketDir(dir); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket == 0 {
		return nil, fmt.Errorf("ipc: listen %s: the path exists and is not a socket (%s); kvshim does not remove it", path, fi.Mode().Type())
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		if c, derr := net.DialTimeout("unixpacket", path, time.Second); derr == nil {
			c.Close()
			return nil, fmt.Errorf("ipc: listen %s: a server is already listening", path)
		}
		os.Remove(path)
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("ipc: listen: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("ipc: listen: chmod socket: %w", err)
	}
	l := &Listener{ln: ln, path: path, cfg: c, segs: NewSegmentTable(),
		ready: make(chan *ServerConn), quit: make(chan struct{}), conns: map[*ServerConn]struct{}{}, shaking: map[*net.UnixConn]struct{}{}, perUID: map[uint32]int{}}
	l.wg.Add(1)
	go l.acceptLoop()
	if c.HeartbeatInterval > 0 {
		l.wg.Add(1)
		go l.beats()
	}
	return l, nil
}

// beats is every session's heartbeat on one ticker. A ticker per session
// woke the idle process once per session per interval; kvshim-bench-idle
// (8 idle sessions) measured the per-session tickers at about a third of
// an idle server's CPU and context switches.
func (l *Listener) beats() {
	defer l.wg.Done()
	t := time.NewTicker(l.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-l.quit:
			return
		case <-t.C:
		}
		for _, c := range l.Conns() {
			if _, err := c.beat(l.cfg.HeartbeatTimeout); err != nil {
				c.closeWith(err)
			}
		}
	}
}

// Path is the socket path.
func (l *Listener) Path() string { return l.path }

// Segments is the table of segments every session receives.
func (l *Listener) Segments() *SegmentTable { return l.segs }

// AddSegment registers s (an L1 segment) and announces it to every open
// session and every later one. The listener does not take ownership: the
// caller closes s after closing the listener.
func (l *Listener) AddSegment(s *Segment) error {
	if err := l.segs.Add(s); err != nil {
		return err
	}
	for _, c := range l.Conns() {
		if err := c.AnnounceSegment(s); err != nil {
			c.log.Warn("kvshim ipc: segment announcement failed, closing session", "segment", s.ID(), "err", err)
			c.closeWith(err)
		}
	}
	return nil
}

// Conns returns the open sessions.
func (l *Listener) Conns() []*ServerConn {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]*ServerConn, 0, len(l.conns))
	for c := range l.conns {
		out = append(out, c)
	}
	return out
}

// Accept returns the next session whose handshake succeeded. Refused
// clients (uid, version, malformed hello) are logged and never returned.
// After Close it returns ErrClosed.
func (l *Listener) Accept() (*ServerConn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case <-l.quit:
		return nil, fmt.Errorf("%w: listener", ErrClosed)
	}
}

// Close stops accepting, removes the socket and closes every session.
func (l *Listener) Close() error {
	l.once.Do(func() {
		close(l.quit)
		l.ln.Close()
		l.mu.Lock()
		for uc := range l.shaking {
			uc.Close() // unblocks a handshake waiting for a hello
		}
		l.mu.Unlock()
		for _, c := range l.Conns() {
			c.closeWith(fmt.Errorf("%w: listener closed", ErrClosed))
		}
	})
	l.wg.Wait()
	return nil
}

func (l *Listener) acceptLoop() {
	defer l.wg.Done()
	for {
		uc, err := l.ln.AcceptUnix()
		if err != nil {
			select {
			case <-l.quit:
				return
			default:
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			l.cfg.Logger.Error("kvshim ipc: accept failed", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		l.mu.Lock()
		select {
		case <-l.quit: // Close already swept l.shaking
			l.mu.Unlock()
			uc.Close()
			return
		default:
		}
		l.shaking[uc] = struct{}{}
		l.mu.Unlock()
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			c, err := l.handshake(uc)
			l.mu.Lock()
			delete(l.shaking, uc)
			l.mu.Unlock()
			if err != nil {
				l.cfg.Logger.Warn("kvshim ipc: connection refused", "err", err)
				uc.Close()
				return
			}
			select {
			case l.ready <- c:
			case <-l.quit:
				c.closeWith(fmt.Errorf("%w: listener closed", ErrClosed))
			case <-c.done:
			}
		}()
	}
}

func (l *Listener) refuse(uc *net.UnixConn, code uint32, err error) error {
	body := putU32(nil, code)
	body = AppendError(body, err.Error())
	sendSock(uc, sockRefuse, body, -1)
	return err
}

func (l *Listener) handshake(uc *net.UnixConn) (*ServerConn, error) {
	cred, err := peerCred(uc)
	if err != nil {
		return nil, err
	}
	// Read the hello before answering anything: closing a socket with an
	// unread message resets it, and the client would lose our refusal.
	buf := make([]byte, maxSockMsg)
	kind, body, fds, err := recvSock(uc, buf, time.Now().Add(l.cfg.HandshakeTimeout))
	if err != nil {
		return nil, fmt.Errorf("ipc: hello from pid %d: %w", cred.Pid, err)
	}
	closeFds(fds)
	if err := CheckPeerCred(cred, uint32(os.Getuid()), l.cfg.AllowUIDs); err != nil {
		return nil, l.refuse(uc, refusePermission, err)
	}
	if kind != sockHello {
		return nil, l.refuse(uc, refuseOther, fmt.Errorf("%w: expected hello, got message kind %d", ErrMalformed, kind))
	}
	if !l.takeSession(cred.Uid) {
		return nil, l.refuse(uc, refuseOther, fmt.Errorf("%w: uid %d already has %d sessions (the server's limit per uid)", ErrLimit, cred.Uid, l.cfg.MaxSessionsPerUID))
	}
	ok := false
	defer func() {
		if !ok {
			l.dropSession(cred.Uid)
		}
	}()
	hello, err := DecodeHello(body)
	if err != nil {
		code := refuseOther
		if errors.Is(err, ErrVersion) {
			code = refuseVersion
		}
		return nil, l.refuse(uc, code, fmt.Errorf("pid %d: %w", cred.Pid, err))
	}
	uc.SetReadDeadline(time.Time{})

	sqSize, cqSize := RingSize(l.cfg.SQCapacity), RingSize(l.cfg.CQCapacity)
	id := l.next.Add(1)
	pair, err := CreateSegment(0, sqSize+cqSize)
	if err != nil {
		return nil, l.refuse(uc, refuseOther, err)
	}
	mem := pair.Mem()
	sq, err := InitRing(mem[:sqSize], l.cfg.SQCapacity, l.cfg.Ring)
	if err == nil {
		var cq *Ring
		cq, err = InitRing(mem[sqSize:sqSize+cqSize], l.cfg.CQCapacity, l.cfg.Ring)
		if err == nil {
			sq.SetPids(int(cred.Pid), os.Getpid())
			cq.SetPids(os.Getpid(), int(cred.Pid))
			c := &ServerConn{hello: hello, cred: *cred, id: id, l: l, announced: map[uint32]bool{}}
			c.session = session{uc: uc, pair: pair, rx: sq, tx: cq, done: make(chan struct{}),
				log: l.cfg.Logger.With("session", id, "pid", hello.PID, "role", hello.Role.String(), "instance", hello.Instance.String())}
			ok = true // start's failure path frees c, and onFree drops the count
			return c, l.start(c)
		}
	}
	pair.Close()
	return nil, l.refuse(uc, refuseOther, err)
}

func (l *Listener) start(c *ServerConn) error {
	c.onFree = func() {
		l.mu.Lock()
		delete(l.conns, c)
		l.mu.Unlock()
		l.dropSession(c.cred.Uid)
	}
	c.tx.BeatProducer()
	// Register, snapshot the segments, send welcome + snapshot, all under
	// sockMu: a concurrent AddSegment either is in the snapshot or finds
	// this session registered and announces after the welcome.
	c.sockMu.Lock()
	l.mu.Lock()
	l.conns[c] = struct{}{}
	l.mu.Unlock()
	segs := l.segs.Segments()
	w := welcome{Version: c.hello.Version, // the client's: an older client accepts only its own
		Session: c.id, Server: l.cfg.Instance, SQCap: l.cfg.SQCapacity,
		CQCap: l.cfg.CQCapacity, Segments: uint32(len(segs)), BeatEvery: l.cfg.HeartbeatInterval, BeatExpire: l.cfg.HeartbeatTimeout}
	err := sendSock(c.uc, sockWelcome, w.append(nil), c.pair.Fd())
	for _, s := range segs {
		if err == nil {
			err = c.announceLocked(s)
		}
	}
	c.sockMu.Unlock()
	if err != nil {
		c.closeWith(err)
		return err
	}
	go c.watchSocket() // heartbeats: Listener.beats
	c.log.Debug("kvshim ipc: session open", "uid", c.cred.Uid)
	return nil
}

// takeSession counts a new session of uid; false at the uid's limit.
func (l *Listener) takeSession(uid uint32) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.perUID[uid] >= l.cfg.MaxSessionsPerUID {
		return false
	}
	l.perUID[uid]++
	return true
}

func (l *Listener) dropSession(uid uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.perUID[uid]--; l.perUID[uid] <= 0 {
		delete(l.perUID, uid)
	}
}
