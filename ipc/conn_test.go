package ipc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// testService is a small real Service: Alloc hands out slices of the
// listener's segments, growing L1 by a new segment when asked for > 1 MiB.
type testService struct {
	l    *Listener
	conn *ServerConn
	mu   *sync.Mutex
	next *uint64
}

func (s *testService) Alloc(r *AllocReq) (*AllocResp, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &AllocResp{}
	for _, size := range r.Sizes {
		seg, _ := s.l.Segments().Get(1)
		if size > 1<<20 { // grow: a new segment, announced before the answer
			id := uint32(s.l.Segments().Len() + 1)
			ns, err := CreateSegment(id, size)
			if err != nil {
				return nil, err
			}
			if err := s.l.AddSegment(ns); err != nil {
				return nil, err
			}
			resp.Status = append(resp.Status, StatusOK)
			resp.Locs = append(resp.Locs, Loc{Segment: id, Size: size})
			continue
		}
		resp.Status = append(resp.Status, StatusOK)
		resp.Locs = append(resp.Locs, Loc{Segment: seg.ID(), Offset: *s.next, Size: size})
		*s.next += size
	}
	return resp, nil
}
func (s *testService) Commit(r *CommitReq) (*CommitResp, error) {
	return &CommitResp{Status: make([]Status, len(r.Hashes))}, nil
}
func (s *testService) Abort(r *CommitReq) (*CommitResp, error) {
	return nil, &StatusError{Status: StatusNotFound, Msg: "nothing staged"}
}
func (s *testService) Lookup(r *LookupReq) error { return nil }
func (s *testService) LookupResult(r *LookupResultReq) (*LookupResultResp, error) {
	return &LookupResultResp{Status: StatusOK, Chunks: uint32(r.LookupID)}, nil
}
func (s *testService) Free(*FreeReq) error { return errors.New("boom") }
func (s *testService) Retrieve(r *RetrieveReq) (*RetrieveResp, error) {
	if r.LookupID == 666 {
		panic("handler bug")
	}
	return &RetrieveResp{}, nil
}
func (s *testService) Release(*ReleaseReq) error { return nil }
func (s *testService) Stats() (*StatsResp, error) {
	return &StatsResp{Stats: []Stat{{"sessions", float64(len(s.l.Conns()))}}}, nil
}
func (s *testService) Clear() (*ClearResp, error) { return &ClearResp{Objects: 1, Bytes: 2}, nil }
func (s *testService) Reset(r *ResetReq) (*ResetResp, error) {
	return &ResetResp{Generation: r.AtLeast + 1}, nil
}

type testServer struct {
	l     *Listener
	path  string
	mu    sync.Mutex
	ended []error
	wg    sync.WaitGroup
}

func startServer(t testing.TB, cfg *ServerConfig) *testServer {
	t.Helper()
	return startServerPath(t, filepath.Join(t.TempDir(), "kvshim.sock"), cfg)
}

func startServerPath(t testing.TB, path string, cfg *ServerConfig) *testServer {
	t.Helper()
	if cfg == nil {
		cfg = &ServerConfig{}
	}
	cfg.Logger = quietLog
	if cfg.SQCapacity == 0 {
		cfg.SQCapacity, cfg.CQCapacity = 1<<16, 1<<16
	}
	l, err := Listen(path, cfg)
	assert.NilError(t, err)
	seg, err := CreateSegment(1, 2<<20)
	assert.NilError(t, err)
	assert.NilError(t, l.AddSegment(seg))
	ts := &testServer{l: l, path: path}
	var mu sync.Mutex
	var next uint64
	ts.wg.Add(1)
	go func() {
		defer ts.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			ts.wg.Add(1)
			go func() {
				defer ts.wg.Done()
				err := c.Serve(ServiceHandler(&testService{l: l, conn: c, mu: &mu, next: &next}))
				ts.mu.Lock()
				ts.ended = append(ts.ended, err)
				ts.mu.Unlock()
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		ts.wg.Wait()
		for _, s := range l.Segments().Segments() {
			s.Close()
		}
	})
	return ts
}

func (ts *testServer) waitEnded(t testing.TB, n int) []error {
	t.Helper()
	var e []error
	testkit.Eventually(t, 10*time.Second, fmt.Sprintf("%d sessions to end", n), func() bool {
		ts.mu.Lock()
		e = append([]error(nil), ts.ended...)
		ts.mu.Unlock()
		return len(e) >= n
	})
	return e
}

func dialTest(t testing.TB, path string) *Client {
	t.Helper()
	c, err := DialConfig(path, Hello{Role: RoleWorker}, 5*time.Second, &ClientConfig{Logger: quietLog})
	assert.NilError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

func TestConnCalls(t *testing.T) {
	ts := startServer(t, nil)
	c := dialTest(t, ts.path)
	ctx := context.Background()
	assert.Equal(t, c.Segments().Len(), 1)
	assert.NilError(t, c.Ping(ctx))

	// Typed calls and statuses.
	lr, err := c.LookupResult(ctx, &LookupResultReq{LookupID: 7})
	assert.NilError(t, err)
	assert.Equal(t, lr.Chunks, uint32(7))
	_, err = c.Abort(ctx, &CommitReq{})
	var se *StatusError
	assert.Assert(t, errors.As(err, &se) && se.Status == StatusNotFound && errors.Is(err, ErrRemote), "%v", err)
	err = c.Free(ctx, &FreeReq{})
	assert.Assert(t, errors.As(err, &se) && se.Status == StatusInternal, "%v", err)
	assert.ErrorContains(t, err, "boom")
	_, err = c.Retrieve(ctx, &RetrieveReq{LookupID: 666}) // handler panic → Internal, session lives
	assert.ErrorContains(t, err, "handler panic")
	st, body, err := c.Call(ctx, Op(999), nil)
	assert.NilError(t, err)
	assert.Equal(t, st, StatusBadRequest)
	assert.Equal(t, string(body), "unknown op")
	stats, err := c.Stats(ctx)
	assert.NilError(t, err)
	assert.Equal(t, stats.Stats[0].Name, "sessions")
	cr, err := c.Clear(ctx)
	assert.NilError(t, err)
	assert.Equal(t, *cr, ClearResp{1, 2})

	// Locs resolve against the mapped segments and writes are shared.
	ar, err := c.Alloc(ctx, &AllocReq{Hashes: make([]kv.Hash, 2), Sizes: []uint64{100, 200}})
	assert.NilError(t, err)
	b, err := c.Resolve(ar.Locs[1])
	assert.NilError(t, err)
	assert.Equal(t, len(b), 200)
	b[0] = 42
	srv, _ := ts.l.Segments().Resolve(ar.Locs[1])
	assert.Equal(t, srv[0], byte(42))
	_, err = c.Resolve(Loc{Segment: 1, Offset: 2 << 20, Size: 1})
	assert.Assert(t, errors.Is(err, ErrRange))
	_, err = c.Resolve(Loc{Segment: 1, Offset: 1, Size: ^uint64(0)})
	assert.Assert(t, errors.Is(err, ErrRange))

	// L1 grows: the new segment is announced before the answer naming it.
	ar, err = c.Alloc(ctx, &AllocReq{Hashes: make([]kv.Hash, 1), Sizes: []uint64{4 << 20}})
	assert.NilError(t, err)
	b, err = c.Resolve(ar.Locs[0])
	assert.NilError(t, err)
	assert.Equal(t, len(b), 4<<20)
	assert.Equal(t, c.Segments().Len(), 2)
	// A second client gets both segments at dial time.
	c2 := dialTest(t, ts.path)
	assert.Equal(t, c2.Segments().Len(), 2)
	_, err = c.Segments().ResolveWait(Loc{Segment: 77}, 20*time.Millisecond)
	assert.Assert(t, errors.Is(err, ErrRange))
}

// Many goroutines share one client; answers are matched by request id.
func TestConnConcurrentCalls(t *testing.T) {
	ts := startServer(t, nil)
	c := dialTest(t, ts.path)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 300; i++ {
				id := uint64(g*1000 + i)
				r, err := c.LookupResult(context.Background(), &LookupResultReq{LookupID: id})
				if err != nil || r.Chunks != uint32(id) {
					t.Errorf("call %d: %v %+v", id, err, r)
					return
				}
			}
		}()
	}
	wg.Wait()
}

func TestConnPeerClose(t *testing.T) {
	ts := startServer(t, nil)
	c := dialTest(t, ts.path)
	assert.NilError(t, c.Ping(context.Background()))
	c.Close()
	errs := ts.waitEnded(t, 1)
	assert.Assert(t, errors.Is(errs[0], ErrPeerGone) || errors.Is(errs[0], ErrClosed), "%v", errs[0])
	_, _, err := c.Call(context.Background(), OpPing, nil)
	assert.Assert(t, errors.Is(err, ErrClosed), "%v", err)

	// Server side closes: the client notices without calling.
	c2 := dialTest(t, ts.path)
	for _, sc := range ts.l.Conns() {
		sc.Close()
	}
	select {
	case <-c2.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("client did not notice")
	}
	err = c2.Ping(context.Background())
	assert.Assert(t, errors.Is(err, ErrPeerGone), "%v", err)
}

func TestConnCallTimeout(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := Listen(path, &ServerConfig{SQCapacity: 4096, CQCapacity: 4096, Logger: quietLog})
	assert.NilError(t, err)
	defer l.Close()
	go l.Accept() // accepted but never served
	c, err := DialConfig(path, Hello{Role: RoleTool}, time.Second, &ClientConfig{Logger: quietLog})
	assert.NilError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err = c.Call(ctx, OpPing, nil)
	assert.Assert(t, errors.Is(err, ErrTimeout), "%v", err)
	assert.Assert(t, time.Since(start) < time.Second)
	// Nobody consumes: the submission ring fills, then ErrRingFull.
	for err == nil || errors.Is(err, ErrTimeout) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		_, _, err = c.Call(ctx, OpPing, make([]byte, 1000))
		cancel()
	}
	assert.Assert(t, errors.Is(err, ErrRingFull), "%v", err)
}

func TestConnVersionMismatch(t *testing.T) {
	ts := startServer(t, nil)
	_, err := DialConfig(ts.path, Hello{Version: 7, Role: RoleWorker}, time.Second, &ClientConfig{Logger: quietLog})
	assert.Assert(t, errors.Is(err, ErrVersion) && errors.Is(err, ErrRefused), "%v", err)
	assert.ErrorContains(t, err, "version 7")
	assert.ErrorContains(t, err, fmt.Sprintf("version %d", ProtocolVersion))
}

// The uid check itself, with a fake credential (the tests run as one user).
func TestCheckPeerCred(t *testing.T) {
	for _, tc := range []struct {
		uid   uint32
		allow []uint32
		ok    bool
	}{{1000, nil, true}, {1001, nil, false}, {0, nil, false}, {1001, []uint32{1001}, true}} {
		err := CheckPeerCred(&unix.Ucred{Pid: 42, Uid: tc.uid}, 1000, tc.allow)
		if tc.ok {
			assert.NilError(t, err)
			continue
		}
		assert.Assert(t, errors.Is(err, ErrPermission))
		assert.ErrorContains(t, err, fmt.Sprintf("uid %d", tc.uid))
	}
}

func TestSocketDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	assert.NilError(t, EnsureSocketDir(dir))
	assert.NilError(t, unix.Chmod(dir, 0o755))
	err := EnsureSocketDir(dir)
	assert.Assert(t, errors.Is(err, ErrPermission), "%v", err)
	t.Setenv("XDG_RUNTIME_DIR", "/run/user/5")
	assert.Equal(t, DefaultSocketPath(), "/run/user/5/kvshim/kvshim.sock")
	t.Setenv("XDG_RUNTIME_DIR", "")
	assert.Assert(t, is.Contains(DefaultSocketDir(), "kvshim-"))
	// Socket mode 0600; a second Listen on a live socket fails.
	ts := startServer(t, nil)
	var st unix.Stat_t
	assert.NilError(t, unix.Stat(ts.path, &st))
	assert.Equal(t, st.Mode&0o777, uint32(0o600))
	_, err = Listen(ts.path, &ServerConfig{Logger: quietLog})
	assert.ErrorContains(t, err, "already listening")
}

// A malformed frame (bad codec version) and a malformed body both end the
// session with a reason; the server keeps serving others.
func TestConnMalformedClosesSession(t *testing.T) {
	ts := startServer(t, nil)
	for i, bad := range [][]byte{
		{9, 0, 11, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0},                                  // codec version 9
		AppendFrameHeader(nil, FrameHeader{Op: OpAlloc, ReqID: 1}),                         // empty alloc body
		append(AppendFrameHeader(nil, FrameHeader{Op: OpLookup, ReqID: 1}), 0xff, 0xff, 1), // garbage
	} {
		c := dialTest(t, ts.path)
		c.submitMu.Lock()
		assert.NilError(t, c.tx.Write(RecordFrame, bad, nil, soon(time.Second)))
		c.submitMu.Unlock()
		errs := ts.waitEnded(t, i+1)
		assert.Assert(t, errors.Is(errs[i], ErrMalformed), "%v", errs[i])
		select {
		case <-c.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("client not told")
		}
	}
	c := dialTest(t, ts.path)
	assert.NilError(t, c.Ping(context.Background()))
}

// A client that stops beating (no socket close) is dropped.
func TestConnHeartbeatTimeout(t *testing.T) {
	ts := startServer(t, &ServerConfig{HeartbeatInterval: 10 * time.Millisecond, HeartbeatTimeout: 100 * time.Millisecond})
	c := dialTest(t, ts.path)
	// Freeze the client's beat by pretending it is long ago, repeatedly.
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if !c.acquire() { // the session may end (and unmap) meanwhile
				return
			}
			c.tx.prodBeat.Store(1)
			c.release()
			time.Sleep(time.Millisecond)
		}
	}()
	defer close(stop)
	errs := ts.waitEnded(t, 1)
	assert.ErrorContains(t, errs[0], "heartbeat")
}

// Close does not wait for a client that connected but never said hello.
func TestListenerCloseDuringHandshake(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := Listen(path, &ServerConfig{Logger: quietLog, HandshakeTimeout: time.Minute})
	assert.NilError(t, err)
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
	assert.NilError(t, err)
	defer unix.Close(fd)
	assert.NilError(t, unix.Connect(fd, &unix.SockaddrUnix{Name: path}))
	time.Sleep(20 * time.Millisecond)
	start := time.Now()
	assert.NilError(t, l.Close())
	assert.Assert(t, time.Since(start) < 5*time.Second)
	_, err = l.Accept()
	assert.Assert(t, errors.Is(err, ErrClosed))
}
