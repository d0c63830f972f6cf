package server

import (
	"errors"
	"fmt"
	"sync"

	"github.com/kvshim/kvshim/ipc"
)

// IPCSource is the production SegmentSource: memfd segments from
// ipc.CreateSegment, each announced to every session (open and future)
// through the listener before the store hands out a Loc in it. With
// Prefault set, the store's allocator has it prepare segments ahead of
// demand (readySource): each is created, its pages allocated (faultIn) and
// announced from a background goroutine, and handed to the store by the
// NewSegment that follows.
type IPCSource struct {
	// Prefault is how many bytes of L1 to keep created, faulted in and
	// announced ahead of use (Config.L1PrefaultGB; 0: lazy). Set it before
	// the store is created.
	Prefault uint64

	ln      *ipc.Listener
	mu      sync.Mutex
	segs    []*ipc.Segment
	ready   map[uint32]*ipc.Segment // prepared, not yet handed to the store
	onNew   func(seg *ipc.Segment)  // L2 segment registration; must not block
	closers []func()                // run first in Close (the grower's stop)
	closed  bool
}

// setOnNew sets the new-segment hook and calls it for the segments that
// already exist (handed to the store; a prepared one gets it when the
// store takes it, as a new one does).
func (s *IPCSource) setOnNew(f func(seg *ipc.Segment)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onNew = f
	for _, seg := range s.segs {
		f(seg)
	}
}

// NewIPCSource returns a source announcing its segments on ln.
func NewIPCSource(ln *ipc.Listener) *IPCSource { return &IPCSource{ln: ln} }

// NewSegment creates, maps and announces segment id, or hands over the
// one prepare made ready.
func (s *IPCSource) NewSegment(id uint32, size uint64) ([]byte, error) {
	s.mu.Lock()
	seg := s.ready[id]
	delete(s.ready, id)
	s.mu.Unlock()
	if seg == nil {
		var err error
		if seg, err = s.create(id, size, false); err != nil {
			return nil, err
		}
	} else if seg.Size() < size {
		seg.Close()
		return nil, fmt.Errorf("prepared segment %d has %d bytes, want %d", id, seg.Size(), size)
	}
	s.mu.Lock()
	s.segs = append(s.segs, seg)
	if s.onNew != nil {
		s.onNew(seg)
	}
	s.mu.Unlock()
	return seg.Mem(), nil
}

// create makes segment id, faulted in when asked, and announces it.
func (s *IPCSource) create(id uint32, size uint64, fault bool) (*ipc.Segment, error) {
	seg, err := ipc.CreateSegment(id, size)
	if err != nil {
		return nil, err
	}
	if fault {
		if err := faultIn(seg.Fd(), seg.Mem()); err != nil {
			seg.Close()
			return nil, fmt.Errorf("fault in segment %d: %w", id, err)
		}
	}
	if err := s.ln.AddSegment(seg); err != nil {
		seg.Close()
		return nil, err
	}
	return seg, nil
}

func (s *IPCSource) readyAhead() uint64 { return s.Prefault }

// prepare creates, faults in and announces segment id for a NewSegment to
// come (readySource).
func (s *IPCSource) prepare(id uint32, size uint64) error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return ipc.ErrClosed
	}
	seg, err := s.create(id, size, true)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed { // Close ran meanwhile; cannot happen while the grower runs
		seg.Close()
		return ipc.ErrClosed
	}
	if s.ready == nil {
		s.ready = map[uint32]*ipc.Segment{}
	}
	s.ready[id] = seg
	return nil
}

func (s *IPCSource) onClose(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closers = append(s.closers, f)
}

// Close stops preparing segments, then unmaps every segment. Close the
// listener first.
func (s *IPCSource) Close() error {
	s.mu.Lock()
	closers := s.closers
	s.closers = nil
	s.mu.Unlock()
	for _, f := range closers {
		f()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	var errs []error
	for _, seg := range s.segs {
		errs = append(errs, seg.Close())
	}
	for _, seg := range s.ready {
		errs = append(errs, seg.Close())
	}
	s.segs, s.ready = nil, nil
	return errors.Join(errs...)
}

// Serve accepts sessions on ln until it is closed and runs each on its own
// goroutine: requests are decoded with ipc's codec, answered by st, and the
// session's resources are released (CloseSession) when its peer goes. It
// returns nil once ln is closed and every session goroutine has ended.
func Serve(ln *ipc.Listener, st *Store) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, ipc.ErrClosed) {
				return nil
			}
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			serveConn(c, st)
		}()
	}
}

func serveConn(c *ipc.ServerConn, st *Store) {
	hello, cred := c.Hello(), c.PeerCred()
	s, err := st.OpenSessionWith(ipc.Tag(hello.Instance), SessionOptions{
		Fence: true, PeerPID: int(cred.Pid), UID: cred.Uid, Drained: hello.Flags&ipc.HelloDrained != 0})
	if err != nil {
		c.Close()
		return
	}
	defer st.CloseSession(s)
	c.Serve(ipc.ServiceHandler(&service{st: st, s: s}))
}

// service binds one session to the store as an ipc.Service.
type service struct {
	st *Store
	s  *Session
}

func wrap[T any](op ipc.Op, v T, err error) (T, error) {
	if err != nil {
		return v, &ipc.StatusError{Op: op, Status: StatusOf(err), Msg: err.Error()}
	}
	return v, nil
}

func (x *service) Alloc(r *ipc.AllocReq) (*ipc.AllocResp, error) {
	v, err := x.st.Alloc(x.s, r)
	return wrap(ipc.OpAlloc, v, err)
}

func (x *service) Commit(r *ipc.CommitReq) (*ipc.CommitResp, error) {
	v, err := x.st.Commit(x.s, r)
	return wrap(ipc.OpCommit, v, err)
}

func (x *service) Abort(r *ipc.CommitReq) (*ipc.CommitResp, error) {
	v, err := x.st.Abort(x.s, r)
	return wrap(ipc.OpAbort, v, err)
}

func (x *service) Lookup(r *ipc.LookupReq) error {
	_, err := wrap(ipc.OpLookup, 0, x.st.Lookup(x.s, r))
	return err
}

func (x *service) LookupResult(r *ipc.LookupResultReq) (*ipc.LookupResultResp, error) {
	v, err := x.st.LookupResult(x.s, r)
	return wrap(ipc.OpLookupResult, v, err)
}

func (x *service) Free(r *ipc.FreeReq) error {
	_, err := wrap(ipc.OpFree, 0, x.st.Free(x.s, r))
	return err
}

func (x *service) Retrieve(r *ipc.RetrieveReq) (*ipc.RetrieveResp, error) {
	v, err := x.st.Retrieve(x.s, r)
	return wrap(ipc.OpRetrieve, v, err)
}

func (x *service) Release(r *ipc.ReleaseReq) error {
	_, err := wrap(ipc.OpRelease, 0, x.st.Release(x.s, r))
	return err
}

func (x *service) Stats() (*ipc.StatsResp, error) {
	v, err := x.st.Stats(x.s)
	return wrap(ipc.OpStats, v, err)
}

func (x *service) Clear() (*ipc.ClearResp, error) {
	v, err := x.st.Clear(x.s)
	return wrap(ipc.OpClear, v, err)
}

// Server is a Store behind an ipc listener: what `kvshim serve` and the
// embedded mode run.
type Server struct {
	Store    *Store
	Listener *ipc.Listener
	done     chan error

	closeOnce sync.Once
	closeErr  error
}

// Start listens on cfg.Socket, creates the store over memfd segments and
// serves sessions in the background. ipcCfg may be nil; o.Source is
// replaced by an IPCSource.
func Start(cfg Config, ipcCfg *ipc.ServerConfig, o Options) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Socket == "" {
		return nil, fmt.Errorf("%w: --socket is required", ErrConfig)
	}
	var ic ipc.ServerConfig
	if ipcCfg != nil {
		ic = *ipcCfg
	}
	if ic.MaxSessionsPerUID == 0 {
		ic.MaxSessionsPerUID = cfg.MaxSessionsPerUID
	}
	ln, err := ipc.Listen(cfg.Socket, &ic)
	if err != nil {
		return nil, err
	}
	src := NewIPCSource(ln)
	src.Prefault = cfg.prefaultBytes()
	o.Source = src
	st, err := NewStore(cfg, o)
	if err != nil {
		ln.Close()
		src.Close() // segments prepared meanwhile
		return nil, err
	}
	srv := &Server{Store: st, Listener: ln, done: make(chan error, 1)}
	go func() { srv.done <- Serve(ln, st) }()
	return srv, nil
}

// Close stops accepting, ends every session (releasing what they own),
// then closes the store and its segments. Later calls return the first
// call's result.
func (srv *Server) Close() error {
	srv.closeOnce.Do(func() {
		lerr := srv.Listener.Close()
		serr := <-srv.done
		srv.closeErr = errors.Join(lerr, serr, srv.Store.Close())
	})
	return srv.closeErr
}
