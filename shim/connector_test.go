package shim

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/server"
)

// The connector's two roles against a real server on a Unix socket: one
// scheduler and two worker ranks (TP=2) with CPU KV caches in mmap'd memory
// shaped as FlashAttention NHD.

const (
	tBlocks, tBS, tHeads, tHead, tLayers = 64, 4, 2, 8, 2
	tChunk                               = 8 // tokens: 2 blocks per chunk
)

type rankCache struct {
	mem   []byte
	descs []layout.TensorDesc
}

func newRankCache(t testing.TB) *rankCache {
	layer := int64(2 * tBlocks * tBS * tHeads * tHead * 2)
	mem, err := unix.Mmap(-1, 0, int(layer)*tLayers, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	assert.NilError(t, err)
	t.Cleanup(func() { unix.Munmap(mem) })
	c := &rankCache{mem: mem}
	dev := kvDevice(t, mem)
	for i := range tLayers {
		c.descs = append(c.descs, layout.TensorDesc{
			Layer: "layer" + string(rune('0'+i)), Backend: layout.FlashAttn, Device: dev,
			DataPtr: addrOf(mem) + uint64(int64(i)*layer), DTypeSize: 2,
			Shape:   []int64{2, tBlocks, tBS, tHeads, tHead},
			Strides: []int64{layer / 2, tBS * tHeads * tHead * 2, tHeads * tHead * 2, tHead * 2, 2},
		})
	}
	return c
}

// block returns the bytes of block b of layer i, K then V.
func (c *rankCache) block(i, b int) []byte {
	layer := 2 * tBlocks * tBS * tHeads * tHead * 2
	bb := tBS * tHeads * tHead * 2
	out := append([]byte{}, c.mem[i*layer+b*bb:i*layer+(b+1)*bb]...)
	return append(out, c.mem[i*layer+layer/2+b*bb:i*layer+layer/2+(b+1)*bb]...)
}

func (c *rankCache) fill(b int, seed uint64) {
	layer := 2 * tBlocks * tBS * tHeads * tHead * 2
	bb := tBS * tHeads * tHead * 2
	r := rand.New(rand.NewPCG(seed, uint64(b)))
	for i := range tLayers {
		for _, off := range []int{i*layer + b*bb, i*layer + layer/2 + b*bb} {
			for k := 0; k < bb; k += 8 {
				binary.LittleEndian.PutUint64(c.mem[off+k:], r.Uint64())
			}
		}
	}
}

type rig struct {
	cfg     server.Config
	srv     *server.Server
	sched   *Scheduler
	workers []*Worker
	caches  []*rankCache
}

func newRig(t testing.TB, world int) *rig {
	return newRigNS(t, NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: world, ChunkSize: tChunk})
}

// newRigNS is newRig for any namespace spec (world size ns.WorldSize; the
// scheduler's blocks hold ns.DCPSize ranks' blocks).
func newRigNS(t testing.TB, ns NamespaceSpec) *rig { return newRigWith(t, ns, nil, nil) }

// newRigWith is newRigNS with the server's config changed by tune and each
// rank's cache by prep before it is registered (either may be nil).
func newRigWith(t testing.TB, ns NamespaceSpec, tune func(*server.Config), prep func(*rankCache)) *rig {
	t.Helper()
	world := ns.WorldSize
	sock := filepath.Join(t.TempDir(), "kvshim.sock")
	cfg := server.DefaultConfig()
	cfg.Socket, cfg.L1SizeGB, cfg.SegmentSize = sock, 0.0625, 16<<20
	if tune != nil {
		tune(&cfg)
	}
	srv, err := server.Start(cfg, nil, server.Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { srv.Close() })
	s, err := NewScheduler(SchedulerConfig{Socket: sock, Namespace: ns, BlockSize: tBS * ns.dcp(), Timeout: 2 * time.Second, Instance: uuid.New()})
	assert.NilError(t, err)
	t.Cleanup(func() { s.Close() })
	r := &rig{cfg: cfg, srv: srv, sched: s}
	for rank := range world {
		w, err := NewWorker(WorkerConfig{Socket: sock, Namespace: ns, Rank: rank, Timeout: 2 * time.Second, Instance: uuid.New(), Workers: 2})
		assert.NilError(t, err)
		t.Cleanup(func() { w.Close() })
		c := newRankCache(t)
		if prep != nil {
			prep(c)
		}
		assert.NilError(t, w.Register(c.descs))
		r.workers, r.caches = append(r.workers, w), append(r.caches, c)
	}
	return r
}

// match polls Match until the lookup is final.
func (r *rig) match(t testing.TB, req string, tokens []uint32, ex Extras, local int) int {
	var n int
	testkit.Eventually(t, 5*time.Second, "the lookup of "+req+" to be answered", func() bool {
		var pending bool
		var err error
		n, pending, err = r.sched.Match(req, tokens, ex, local)
		assert.NilError(t, err)
		return !pending
	})
	return n
}

// step runs one engine step on every worker and waits until the copies it
// started are done; it returns what the workers reported.
func (r *rig) step(t testing.TB, st *Step) (recving map[string]int, errBlocks []int64) {
	b, err := r.sched.BuildMeta(st)
	assert.NilError(t, err)
	return r.copies(t, b)
}

// copies runs one step's metadata b on every worker and waits until the
// copies it started are done; it returns what the workers reported (each
// request received, with how many workers reported it).
func (r *rig) copies(t testing.TB, b []byte) (recving map[string]int, errBlocks []int64) {
	recving = map[string]int{}
	for _, w := range r.workers {
		m, err := DecodeStepMeta(b, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
		assert.NilError(t, err)
		w.Finishing(m.Finished)
		w.StartLoads(m)
		w.StartSaves(m, 0)
	}
	for _, w := range r.workers {
		w.wg.Wait()
		_, rv, eb := w.Poll()
		for _, x := range rv {
			recving[x]++
		}
		errBlocks = append(errBlocks, eb...)
	}
	return recving, errBlocks
}

func seq(from, n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(from + i)
	}
	return out
}

func TestConnectorSaveThenRestoreIntoOtherBlocks(t *testing.T) {
	r := newRig(t, 2)
	tokens := make([]uint32, 3*tChunk+3) // 3 full chunks + a tail
	for i := range tokens {
		tokens[i] = uint32(100 + i)
	}
	// Request A computes everything: a miss, then its 3 chunks are saved.
	assert.Equal(t, r.match(t, "A", tokens, Extras{}, 0), 0)
	srcBlocks := seq(10, 7)
	assert.NilError(t, r.sched.AfterAlloc("A", srcBlocks, 1, 0, 0))
	for rank, c := range r.caches {
		for _, b := range srcBlocks {
			c.fill(int(b), uint64(rank+1))
		}
	}
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: srcBlocks, Computed: 0, Scheduled: len(tokens)}}})
	for _, w := range r.workers {
		assert.Equal(t, w.Stats().SavedChunks, uint64(3))
	}
	assert.Equal(t, r.sched.Finished("A"), true) // saves were dispatched: delay-free until workers report
	_, _ = r.step(t, &Step{})
	for _, w := range r.workers {
		sending, _, _ := w.Poll()
		_ = sending
	}

	// Request B shares the prefix: all 3 chunks hit; the whole prompt is 27
	// tokens, so 27-1 = 26 tokens load.
	n := r.match(t, "B", tokens, Extras{}, 0)
	assert.Equal(t, n, 3*tChunk)
	dst := seq(40, 6) // blocks for 24 tokens
	assert.NilError(t, r.sched.AfterAlloc("B", dst, 1, -1, n))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv["B"], 2, "each rank reports the load once")
	assert.Equal(t, len(errs), 0)
	for rank, c := range r.caches {
		for i := range tLayers {
			for k := range 6 {
				assert.Assert(t, bytes.Equal(c.block(i, int(dst[k])), c.block(i, int(srcBlocks[k]))), "rank %d layer %d block %d", rank, i, k)
			}
		}
	}
	// A load needs no delay-free: vLLM holds a loading request's blocks itself.
	assert.Equal(t, r.sched.Finished("B"), false)

	// A salted prompt with the same tokens never hits.
	assert.Equal(t, r.match(t, "C", tokens, Extras{CacheSalt: "tenant-2"}, 0), 0)
	r.sched.Finished("C")
	assert.Equal(t, r.sched.Requests(), 0)
}

func TestConnectorPartialPrefixAndLocalHit(t *testing.T) {
	r := newRig(t, 1)
	tokens := make([]uint32, 4*tChunk)
	for i := range tokens {
		tokens[i] = uint32(7 * i)
	}
	assert.Equal(t, r.match(t, "A", tokens[:2*tChunk+1], Extras{}, 0), 0)
	blocks := seq(0, 5)
	for _, b := range blocks {
		r.caches[0].fill(int(b), 9)
	}
	assert.NilError(t, r.sched.AfterAlloc("A", blocks, 1, 0, 0))
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: blocks, Scheduled: 2*tChunk + 1}}})
	r.sched.Finished("A")

	// B: 4 chunks long, 2 stored; vLLM has the first block itself (local
	// hit of 4 tokens): load tokens [4, 16), skipping block 0.
	n := r.match(t, "B", tokens, Extras{}, tBS)
	assert.Equal(t, n, 2*tChunk-tBS)
	dst := []int64{0, 30, 31, 32, 33, 34, 35, 36}
	before := r.caches[0].block(0, 0)
	assert.NilError(t, r.sched.AfterAlloc("B", dst, 1, -1, n))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv["B"], 1)
	assert.Equal(t, len(errs), 0)
	assert.DeepEqual(t, r.caches[0].block(0, 0), before) // the shared block is not written
	for k := 1; k < 4; k++ {
		assert.Assert(t, bytes.Equal(r.caches[0].block(1, int(dst[k])), r.caches[0].block(1, int(blocks[k]))), "block %d", k)
	}
}

func TestConnectorServerDownIsAMiss(t *testing.T) {
	r := newRig(t, 1)
	tokens := make([]uint32, 2*tChunk)
	assert.NilError(t, r.srv.Close())
	start := time.Now()
	assert.Equal(t, r.match(t, "A", tokens, Extras{}, 0), 0)
	assert.Assert(t, time.Since(start) < 3*time.Second)
	// Saves with no server are skipped, not errors.
	assert.NilError(t, r.sched.AfterAlloc("A", seq(0, 4), 1, 0, 0))
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: seq(0, 4), Scheduled: 2 * tChunk}}})
	assert.Equal(t, r.workers[0].Stats().SavedChunks, uint64(0))
}
