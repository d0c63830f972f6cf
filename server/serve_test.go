package server

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func startServer(t *testing.T, tweak ...func(*Config)) (*Server, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvs")
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := DefaultConfig()
	cfg.L1SizeGB = 8.0 / 1024
	cfg.SegmentSize = 2 << 20
	cfg.SlabSize = 256 << 10
	cfg.Socket = filepath.Join(dir, "run", "kvshim.sock")
	for _, f := range tweak {
		f(&cfg)
	}
	srv, err := Start(cfg, nil, Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, srv.Close()) })
	return srv, cfg.Socket
}

func dial(t *testing.T, path string, role ipc.Role) *ipc.Client {
	t.Helper()
	c, err := ipc.Dial(path, ipc.Hello{Version: ipc.ProtocolVersion, Role: role, PID: uint32(os.Getpid()), Instance: uuid.New()}, 5*time.Second)
	assert.NilError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

func TestServeEndToEnd(t *testing.T) {
	srv, path := startServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sched := dial(t, path, ipc.RoleScheduler)
	worker := dial(t, path, ipc.RoleWorker)
	hs := hashes("e2e", 3)
	tag := kv.Tag(uuid.New())
	ar, err := worker.Alloc(ctx, &ipc.AllocReq{Tag: tag, Namespace: ns1, Hashes: hs, Sizes: sizes(3)})
	assert.NilError(t, err)
	for i, l := range ar.Locs {
		assert.Equal(t, ar.Status[i], ipc.StatusOK)
		b, err := worker.Segments().ResolveWait(l, 5*time.Second)
		assert.NilError(t, err)
		b[0], b[len(b)-1] = byte(i+1), 0xEE
	}
	cr, err := worker.Commit(ctx, &ipc.CommitReq{Tag: tag, Namespace: ns1, Hashes: hs})
	assert.NilError(t, err)
	assert.DeepEqual(t, cr.Status, []ipc.Status{0, 0, 0})

	assert.NilError(t, sched.Lookup(ctx, &ipc.LookupReq{LookupID: 11, Namespace: ns1, WorldSize: 1, Hashes: hs}))
	lr, err := sched.LookupResult(ctx, &ipc.LookupResultReq{LookupID: 11})
	assert.NilError(t, err)
	assert.DeepEqual(t, *lr, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 3, Sources: []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: 3}}})
	owner := kv.Tag(sched.Hello().Instance)
	rr, err := worker.Retrieve(ctx, &ipc.RetrieveReq{Owner: owner, LookupID: 11, End: ^uint32(0)})
	assert.NilError(t, err)
	for i, l := range rr.Locs {
		b, err := worker.Resolve(l)
		assert.NilError(t, err)
		assert.Equal(t, b[0], byte(i+1))
	}
	assert.NilError(t, worker.Release(ctx, &ipc.ReleaseReq{Owner: owner, LookupID: 11}))
	// Errors come back as frame statuses.
	err = sched.Free(ctx, &ipc.FreeReq{LookupID: 11, End: ^uint32(0)})
	var se *ipc.StatusError
	assert.Assert(t, errors.As(err, &se))
	assert.Equal(t, se.Status, ipc.StatusUnknown)
	err = sched.Lookup(ctx, &ipc.LookupReq{LookupID: 12, Namespace: ns1, WorldSize: 0, Hashes: hs})
	assert.Assert(t, errors.As(err, &se))
	assert.Equal(t, se.Status, ipc.StatusBadRequest)
	st, err := sched.Stats(ctx)
	assert.NilError(t, err)
	assert.Assert(t, len(st.Stats) > 10)

	// A worker that goes mid-ALLOC while its process lives on (this one)
	// could still write its slots: they are fenced, not freed, until the
	// same instance comes back saying its earlier sessions have drained.
	hello := ipc.Hello{Role: ipc.RoleWorker, Instance: uuid.New()}
	w2, err := ipc.Dial(path, hello, 5*time.Second)
	assert.NilError(t, err)
	_, err = w2.Alloc(ctx, &ipc.AllocReq{Tag: tag, Namespace: ns1, Hashes: hashes("dies", 4), Sizes: sizes(4)})
	assert.NilError(t, err)
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_objects{state=staging}"), 4.0)
	w2.Close()
	<-w2.Freed()
	testkit.Eventually(t, 10*time.Second, "the staging of a closed session to leave staging", func() bool {
		return stat(t, srv.Core, "kvshim_l1_objects{state=staging}") == 0
	})
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_objects{state=fenced}"), 4.0)
	assert.Equal(t, used(t, srv.Core), 7.0*objSize)
	hello.Flags = ipc.HelloDrained
	w3, err := ipc.Dial(path, hello, 5*time.Second)
	assert.NilError(t, err)
	defer w3.Close()
	// The hello is answered before the server's session goroutine opens
	// the session (and lifts the fence): wait for it.
	testkit.Eventually(t, 10*time.Second, "the drained hello lifting the fence", func() bool {
		return stat(t, srv.Core, "kvshim_l1_objects{state=fenced}") == 0
	})
	assert.Equal(t, used(t, srv.Core), 3.0*objSize)
	c, err := sched.Clear(ctx)
	assert.NilError(t, err)
	assert.Equal(t, c.Objects, uint64(3))
}
