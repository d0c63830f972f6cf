package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/mooncake/mctest"
	"github.com/kvshim/kvshim/server/l2/redis/redisserver"
)

// Two hosts, one L2: kvshim servers with their own L1 and socket (each
// stands for a host) and one shared L2 (an fs directory, a Redis, a
// Mooncake master). What a connector on one host saved, a connector on
// another restores byte for byte from L2; another model never sees it.

// host is one kvshim server: its own L1, socket and L2 adapter.
type host struct {
	srv  *server.Server
	sock string
}

func startHost(t *testing.T, l2cfg string) *host {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "kvshim.sock")
	cfg := server.DefaultConfig()
	cfg.Socket, cfg.L1SizeGB, cfg.SegmentSize = sock, 0.0625, 16<<20
	cfg.L2Adapters = []string{l2cfg}
	srv, err := server.Start(cfg, nil, server.Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, srv.Close()) })
	return &host{srv: srv, sock: sock}
}

// flush waits until the host's L2 writes are done.
func (h *host) flush(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	assert.NilError(t, h.srv.Core.Writer().Flush(ctx))
	st := h.srv.Core.Writer().Stats()
	assert.Equal(t, st.Errors[0], int64(0), "L2 writes failed")
}

// l2Loaded is how many chunks the host loaded from L2.
func (h *host) l2Loaded() int64 { return h.srv.Core.PrefetchController().Stats().ChunksOK[0] }

func modelNS(model string) NamespaceSpec {
	ns := chaosNS()
	ns.Model = model
	return ns
}

// newHostClient is one vLLM instance of model ns on h: a scheduler and one
// worker with a CPU KV cache (the chaos geometry: 256 KiB objects).
func newHostClient(t *testing.T, h *host, ns NamespaceSpec) *chaosClient {
	t.Helper()
	s, err := NewScheduler(SchedulerConfig{Socket: h.sock, Namespace: ns, BlockSize: cBS, Timeout: 5 * time.Second, Instance: uuid.New()})
	assert.NilError(t, err)
	w, err := NewWorker(WorkerConfig{Socket: h.sock, Namespace: ns, Timeout: 5 * time.Second, Instance: uuid.New(), Workers: 2})
	assert.NilError(t, err)
	cache, err := newChaosCache()
	assert.NilError(t, err)
	c := &chaosClient{sched: s, w: w, cache: cache}
	assert.NilError(t, w.Register(c.cache.descs))
	t.Cleanup(func() { s.Close(); w.Close(); unix.Munmap(c.cache.mem) })
	return c
}

// restore looks tokens up, loads the hit into dst and checks every block
// against src filled from seed; it returns the tokens hit.
func (c *chaosClient) restore(t *testing.T, req string, tokens []uint32, src, dst []int64, seed uint64) int {
	t.Helper()
	n := c.match(t, req, tokens)
	if n == 0 {
		c.sched.Finished(req)
		return 0
	}
	assert.NilError(t, c.sched.AfterAlloc(req, dst, 1, -1, n))
	c.step(t, &Step{})
	for _, b := range src { // the bytes to compare with
		c.cache.fill(int(b), seed)
	}
	recv, errs := c.settle(t, 20*time.Second)
	assert.DeepEqual(t, recv, []string{req})
	assert.Equal(t, len(errs), 0, "load errors: %v", errs)
	assert.Equal(t, c.checkRestore(t, n, src, dst, errs), n/cBS)
	c.sched.Finished(req)
	return n
}

func TestTwoHostsShareL2(t *testing.T) {
	for _, tc := range []struct {
		name string
		l2   func(t *testing.T) string
		// sizeless: the adapter's lookup reports no object size
		// (mooncake_store's exists), so a host plans L2 loads of a
		// (namespace, rank) only once it has seen an object of it in its
		// own L1 (server/tier/doc.go, "Limits"): each host first saves
		// another prompt of the model.
		sizeless bool
	}{
		{"fs", func(t *testing.T) string { return fmt.Sprintf(`{"type":"fs","base_path":%q}`, t.TempDir()) }, false},
		{"redis", func(t *testing.T) string {
			s, err := redisserver.Start(t.TempDir())
			if errors.Is(err, redisserver.ErrNoBinary) {
				t.Skip(err.Error())
			}
			assert.NilError(t, err)
			t.Cleanup(s.Kill)
			return fmt.Sprintf(`{"type":"redis","addrs":[%q]}`, s.Addr)
		}, false},
		{"mooncake_store", func(t *testing.T) string {
			if os.Getenv(mctest.PythonEnv) == "" {
				t.Skip(mctest.PythonEnv + " is not set (a python with the Mooncake wheel, see server/l2/mooncake/doc.go)")
			}
			py, dir, err := mctest.Python()
			if err != nil {
				t.Skip(err.Error())
			}
			m, err := mctest.StartMaster(dir, t.TempDir(), 2000)
			if err != nil {
				t.Skip(err.Error())
			}
			t.Cleanup(m.Stop)
			// Each host's helper mounts its own 64 MiB segment of the pool.
			return mctest.Config(py, m, 64<<20, 32<<20, "")
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l2cfg := tc.l2(t)
			hostA, hostB := startHost(t, l2cfg), startHost(t, l2cfg)
			tokens := chaosTokens(1, 5, 8) // 8 chunks, 2 MiB
			src, dst := seq(0, 32), seq(64, 32)
			const seedA, seedOther = 0xa, 0xb
			warm := func(c *chaosClient, req string) {
				if tc.sizeless {
					other := seq(128, 4)
					assert.Equal(t, c.save(t, req, chaosTokens(2, 9, 1), other, 0xff), 1)
				}
			}

			// Model A on host A computes the prompt: saved to A's L1, then L2.
			a := newHostClient(t, hostA, modelNS("model-a"))
			assert.Equal(t, a.save(t, "A1", tokens, src, seedA), 8)
			hostA.flush(t)

			// Model A on host B: B's L1 never held it; it comes from L2.
			b := newHostClient(t, hostB, modelNS("model-a"))
			warm(b, "B0")
			assert.Equal(t, b.restore(t, "B1", tokens, src, dst, seedA), len(tokens)-1)
			assert.Equal(t, hostB.l2Loaded(), int64(8))

			// Another model on host B never sees A's objects, and its own
			// save of the same tokens does not reach model A.
			c := newHostClient(t, hostB, modelNS("model-b"))
			assert.Equal(t, c.match(t, "C1", tokens), 0)
			c.sched.Finished("C1")
			assert.Equal(t, c.save(t, "C2", tokens, src, seedOther), 8)
			hostB.flush(t)

			// A third host with an empty L1: each model restores its own bytes.
			hostC := startHost(t, l2cfg)
			d := newHostClient(t, hostC, modelNS("model-a"))
			warm(d, "D0")
			assert.Equal(t, d.restore(t, "D1", tokens, src, dst, seedA), len(tokens)-1)
			e := newHostClient(t, hostC, modelNS("model-b"))
			warm(e, "E0")
			assert.Equal(t, e.restore(t, "E1", tokens, src, dst, seedOther), len(tokens)-1)
			assert.Equal(t, hostC.l2Loaded(), int64(16))
			// A model nobody saved misses.
			f := newHostClient(t, hostC, modelNS("model-c"))
			assert.Equal(t, f.match(t, "F1", tokens), 0)
			f.sched.Finished("F1")
		})
	}
}
