package tier_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/mooncake/mctest"
)

func mooncakeConfig(t *testing.T) string {
	t.Helper()
	if os.Getenv(mctest.PythonEnv) == "" {
		t.Skip(mctest.PythonEnv + " is not set (a python with the Mooncake wheel, see server/l2/mooncake/doc.go)")
	}
	py, dir, err := mctest.Python()
	if err != nil {
		t.Skip(err.Error())
	}
	m, err := mctest.StartMaster(dir, t.TempDir(), 500)
	if err != nil {
		t.Skip(err.Error())
	}
	t.Cleanup(m.Stop)
	return mctest.Config(py, m, 64<<20, 16<<20, "")
}

// Through server.Start and real IPC clients (memfd segments, registered
// with the adapters): save, clear L1, lookup served from L2, retrieve.
func TestServeL2EndToEnd(t *testing.T) {
	cases := map[string]func(t *testing.T) string{
		"fs":             func(t *testing.T) string { return fsConfig(t.TempDir()) },
		"mooncake_store": mooncakeConfig,
	}
	for name, mk := range cases {
		t.Run(name, func(t *testing.T) {
			l2cfg := mk(t)
			dir, err := os.MkdirTemp("", "kvt")
			assert.NilError(t, err)
			t.Cleanup(func() { os.RemoveAll(dir) })
			cfg := server.DefaultConfig()
			cfg.L1SizeGB = 4.0 / 1024
			cfg.SegmentSize = 2 << 20
			cfg.SlabSize = 256 << 10
			cfg.Socket = filepath.Join(dir, "run", "kvshim.sock")
			cfg.L2Adapters = []string{l2cfg}
			srv, err := server.Start(cfg, nil, server.Options{})
			assert.NilError(t, err)
			t.Cleanup(func() { assert.NilError(t, srv.Close()) })
			dial := func(role ipc.Role) *ipc.Client {
				c, err := ipc.Dial(cfg.Socket, ipc.Hello{Version: ipc.ProtocolVersion, Role: role, PID: uint32(os.Getpid()), Instance: uuid.New()}, 5*time.Second)
				assert.NilError(t, err)
				t.Cleanup(func() { c.Close() })
				return c
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			sched, worker := dial(ipc.RoleScheduler), dial(ipc.RoleWorker)
			hs := hashes("e2e "+name, 3)
			ar, err := worker.Alloc(ctx, allocReq(hs))
			assert.NilError(t, err)
			for i, l := range ar.Locs {
				assert.Equal(t, ar.Status[i], ipc.StatusOK)
				b, err := worker.Segments().ResolveWait(l, 5*time.Second)
				assert.NilError(t, err)
				copy(b, pattern(hs[i], 0))
			}
			_, err = worker.Commit(ctx, &ipc.CommitReq{Tag: kv.Tag{0x42}, Namespace: ns1, Hashes: hs})
			assert.NilError(t, err)
			assert.NilError(t, srv.Core.Writer().Flush(ctx))
			assert.Equal(t, srv.Core.Writer().Stats().Saved[0], int64(3))
			_, err = sched.Clear(ctx)
			assert.NilError(t, err)
			assert.NilError(t, sched.Lookup(ctx, &ipc.LookupReq{LookupID: 7, Namespace: ns1, WorldSize: 1, Hashes: hs}))
			var lr *ipc.LookupResultResp
			testkit.Eventually(t, 30*time.Second, "lookup 7 to be answered", func() bool { // ctx bounds it too
				lr, err = sched.LookupResult(ctx, &ipc.LookupResultReq{LookupID: 7})
				assert.NilError(t, err)
				return lr.Status != ipc.StatusPending
			})
			// Every chunk came from L2: the answer names the adapter's tier.
			from := ipc.TierRemote
			if name == "fs" {
				from = ipc.TierDisk
			}
			assert.DeepEqual(t, *lr, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 3, Sources: []ipc.SourceRun{{Tier: from, Chunks: 3}}})
			owner := kv.Tag(sched.Hello().Instance)
			rr, err := worker.Retrieve(ctx, &ipc.RetrieveReq{Owner: owner, LookupID: 7, End: ^uint32(0)})
			assert.NilError(t, err)
			for i, l := range rr.Locs {
				assert.Equal(t, rr.Status[i], ipc.StatusOK)
				b, err := worker.Resolve(l)
				assert.NilError(t, err)
				assert.Assert(t, string(b) == string(pattern(hs[i], 0)), "chunk %d", i)
			}
			assert.NilError(t, worker.Release(ctx, &ipc.ReleaseReq{Owner: owner, LookupID: 7}))
			assert.Equal(t, srv.Core.PrefetchController().Stats().ChunksOK[0], int64(3))
		})
	}
}
