package server

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
)

// Serve accepts sessions on ln until it is closed and runs each on its own
// goroutine: requests are decoded with ipc's codec, answered by core, and the
// session's resources are released (CloseSession) when its peer goes. It
// returns nil once ln is closed and every session goroutine has ended.
func Serve(ln *ipc.Listener, core *Core) error {
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
			serveConn(c, core)
		}()
	}
}

func serveConn(c *ipc.ServerConn, core *Core) {
	hello, cred := c.Hello(), c.PeerCred()
	s, err := core.OpenSessionWith(kv.Tag(hello.Instance), SessionOptions{
		Fence: true, PeerPID: int(cred.Pid), UID: cred.Uid, Drained: hello.Flags&ipc.HelloDrained != 0})
	if err != nil {
		c.Close()
		return
	}
	defer core.CloseSession(s)
	c.SetResponseFlags(func() uint8 {
		if s.EventsPending() {
			return ipc.FlagEventsPending
		}
		return 0
	})
	c.Serve(ipc.ServiceHandler(&service{core: core, s: s}))
}

// service binds one session to the core as an ipc.Service.
type service struct {
	core *Core
	s    *Session
}

func wrap[T any](op ipc.Op, v T, err error) (T, error) {
	if err != nil {
		return v, &ipc.StatusError{Op: op, Status: StatusOf(err), Msg: err.Error()}
	}
	return v, nil
}

func (x *service) Alloc(r *ipc.AllocReq) (*ipc.AllocResp, error) {
	v, err := x.core.Alloc(x.s, r)
	return wrap(ipc.OpAlloc, v, err)
}

func (x *service) Commit(r *ipc.CommitReq) (*ipc.CommitResp, error) {
	v, err := x.core.Commit(x.s, r)
	return wrap(ipc.OpCommit, v, err)
}

func (x *service) Abort(r *ipc.CommitReq) (*ipc.CommitResp, error) {
	v, err := x.core.Abort(x.s, r)
	return wrap(ipc.OpAbort, v, err)
}

func (x *service) Lookup(r *ipc.LookupReq) error {
	_, err := wrap(ipc.OpLookup, 0, x.core.Lookup(x.s, r))
	return err
}

func (x *service) LookupResult(r *ipc.LookupResultReq) (*ipc.LookupResultResp, error) {
	v, err := x.core.LookupResult(x.s, r)
	return wrap(ipc.OpLookupResult, v, err)
}

func (x *service) Free(r *ipc.FreeReq) error {
	_, err := wrap(ipc.OpFree, 0, x.core.Free(x.s, r))
	return err
}

func (x *service) Retrieve(r *ipc.RetrieveReq) (*ipc.RetrieveResp, error) {
	v, err := x.core.Retrieve(x.s, r)
	return wrap(ipc.OpRetrieve, v, err)
}

func (x *service) Release(r *ipc.ReleaseReq) error {
	_, err := wrap(ipc.OpRelease, 0, x.core.Release(x.s, r))
	return err
}

func (x *service) Stats() (*ipc.StatsResp, error) {
	v, err := x.core.Stats(x.s)
	return wrap(ipc.OpStats, v, err)
}

func (x *service) Clear() (*ipc.ClearResp, error) {
	v, err := x.core.Clear(x.s)
	return wrap(ipc.OpClear, v, err)
}

func (x *service) Events(r *ipc.EventsReq) (*ipc.EventsResp, error) {
	v, err := x.core.Events(x.s, r)
	return wrap(ipc.OpEvents, v, err)
}

func (x *service) Reset(r *ipc.ResetReq) (*ipc.ResetResp, error) {
	v, err := x.core.Reset(x.s, r)
	return wrap(ipc.OpReset, v, err)
}

// Server is a Core behind an ipc listener: what `kvshim serve` and the
// embedded mode run.
type Server struct {
	Core     *Core
	Listener *ipc.Listener
	done     chan error

	// In-process sessions (ipc.DialDirect: the embedded server's own
	// scheduler), ended and waited for by Close like the ring sessions.
	directMu     sync.Mutex
	directs      map[*ipc.Client]struct{}
	directClosed bool
	unregDirect  func()

	closeOnce sync.Once
	closeErr  error
}

// Start listens on cfg.Socket, creates the core over memfd segments and
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
	core, err := NewCore(cfg, o)
	if err != nil {
		ln.Close()
		src.Close() // segments prepared meanwhile
		return nil, err
	}
	srv := &Server{Core: core, Listener: ln, done: make(chan error, 1), directs: map[*ipc.Client]struct{}{}}
	srv.unregDirect = ipc.RegisterDirect(cfg.Socket, srv.dialDirect)
	go func() { srv.done <- Serve(ln, core) }()
	return srv, nil
}

// dialDirect opens a session for a client in this process (ipc.DialDirect):
// the core's session, answered by the same Service as a ring's. It has no
// L1 mapping, so no write of it can outlive a call: not fenced.
func (srv *Server) dialDirect(hello ipc.Hello, c *ipc.Client) (ipc.Handler, func(), error) {
	if hello.Version < ipc.MinProtocolVersion || hello.Version > ipc.ProtocolVersion {
		return nil, nil, fmt.Errorf("%w: client speaks %d, server %d (and back to %d)", ipc.ErrVersion, hello.Version, ipc.ProtocolVersion, ipc.MinProtocolVersion)
	}
	srv.directMu.Lock()
	defer srv.directMu.Unlock()
	if srv.directClosed {
		return nil, nil, fmt.Errorf("%w: server stopping", ipc.ErrClosed)
	}
	s, err := srv.Core.OpenSessionWith(kv.Tag(hello.Instance), SessionOptions{
		PeerPID: os.Getpid(), UID: uint32(os.Getuid()), Drained: hello.Flags&ipc.HelloDrained != 0,
		OnEvents: c.MarkEventsPending})
	if err != nil {
		return nil, nil, err
	}
	srv.directs[c] = struct{}{}
	end := func() {
		srv.Core.CloseSession(s)
		srv.directMu.Lock()
		delete(srv.directs, c)
		srv.directMu.Unlock()
	}
	return ipc.ServiceHandler(&service{core: srv.Core, s: s}), end, nil
}

// directWait bounds how long Close waits for a direct session's last call.
const directWait = 10 * time.Second

// endDirect ends every direct session and waits until each has released
// its core session (its calls are short: the core never blocks in one).
func (srv *Server) endDirect() {
	srv.unregDirect()
	srv.directMu.Lock()
	srv.directClosed = true
	cs := make([]*ipc.Client, 0, len(srv.directs))
	for c := range srv.directs {
		cs = append(cs, c)
	}
	srv.directMu.Unlock()
	deadline := time.Now().Add(directWait)
	for _, c := range cs {
		c.EndDirect(errors.New("server stopped"))
		select {
		case <-c.Freed():
		case <-time.After(time.Until(deadline)):
		}
	}
}

// Close stops accepting, ends every session (releasing what they own),
// then closes the core and its segments. Later calls return the first
// call's result.
func (srv *Server) Close() error {
	srv.closeOnce.Do(func() {
		srv.endDirect()
		lerr := srv.Listener.Close()
		serr := <-srv.done
		srv.closeErr = errors.Join(lerr, serr, srv.Core.Close())
	})
	return srv.closeErr
}
