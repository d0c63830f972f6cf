package tier_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/tier"
)

// slowBackend is a test-only adapter type ("slowfs"): the real fs backend,
// but Exists and Load of a namespace with a gate wait, before touching the
// disk, until the gate opens or their context ends (a slow network store
// that honours its context). It cuts every batch into one tile, so each
// blocked call holds one lane worker.
type slowBackend struct {
	*fs.Backend
	mu                   sync.Mutex
	existsGate, loadGate map[kv.Namespace]chan struct{}
	stuck                chan struct{} // when set, loads wait for it, ignoring their context
	blocked              atomic.Int64  // calls waiting at a gate now
	calls                atomic.Int64  // Exists and Load calls running now
}

func init() {
	l2.Register("slowfs", func(cfg *l2.Config, env l2.Env) (l2.Backend, error) {
		b, err := fs.New(cfg, env)
		if err != nil {
			return nil, err
		}
		return &slowBackend{Backend: b.(*fs.Backend),
			existsGate: map[kv.Namespace]chan struct{}{}, loadGate: map[kv.Namespace]chan struct{}{}}, nil
	})
}

// slowConfig: enough lookup and retrieve workers for every blocked call
// of the tests below.
func slowConfig(dir string) string {
	return fmt.Sprintf(`{"type":"slowfs","base_path":%q,"per_op_workers":{"lookup":32,"retrieve":32}}`, dir)
}

func slow(e *env) *slowBackend { return e.st.L2Adapters()[0].Backend().(*slowBackend) }

func (b *slowBackend) Tiles(l2.Op, int, int) int { return 1 }

func (b *slowBackend) gate(ctx context.Context, gates map[kv.Namespace]chan struct{}, keys []kv.Key) {
	if len(keys) == 0 {
		return
	}
	b.mu.Lock()
	g, ok := gates[keys[0].Namespace]
	b.mu.Unlock()
	if !ok {
		return
	}
	b.blocked.Add(1)
	defer b.blocked.Add(-1)
	select {
	case <-g:
	case <-ctx.Done():
	}
}

// stuckLoad waits for the stuck gate, if set, ignoring ctx (a read stuck
// in the kernel).
func (b *slowBackend) stuckLoad() {
	b.mu.Lock()
	g := b.stuck
	b.mu.Unlock()
	if g != nil {
		b.blocked.Add(1)
		defer b.blocked.Add(-1)
		<-g
	}
}

func (b *slowBackend) Exists(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	b.calls.Add(1)
	defer b.calls.Add(-1)
	b.gate(ctx, b.existsGate, keys)
	b.Backend.Exists(ctx, keys, r)
}

func (b *slowBackend) Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.calls.Add(1)
	defer b.calls.Add(-1)
	b.gate(ctx, b.loadGate, keys)
	b.stuckLoad()
	b.Backend.Load(ctx, keys, bufs, r)
}

// block makes Exists (or Load) of ns wait for the returned gate.
func (b *slowBackend) block(gates map[kv.Namespace]chan struct{}, ns kv.Namespace) chan struct{} {
	g := make(chan struct{})
	b.mu.Lock()
	gates[ns] = g
	b.mu.Unlock()
	return g
}

// putNS writes chunks hs of rank 0 of ns into L1 through s.
func putNS(t *testing.T, e *env, s *server.Session, ns kv.Namespace, hs []kv.Hash) {
	t.Helper()
	tag := kv.Tag{0x78, ns[0]}
	sizes := make([]uint64, len(hs))
	for i := range sizes {
		sizes[i] = objSize
	}
	ar, err := e.st.Alloc(s, &ipc.AllocReq{Tag: tag, Namespace: ns, Hashes: hs, Sizes: sizes})
	assert.NilError(t, err)
	for i, st := range ar.Status {
		assert.Equal(t, st, ipc.StatusOK)
		copy(e.src.at(ar.Locs[i]), patternIn(ns, hs[i], 0))
	}
	_, err = e.st.Commit(s, &ipc.CommitReq{Tag: tag, Namespace: ns, Hashes: hs})
	assert.NilError(t, err)
}

// resultOf waits (bounded) for the final answer of s's lookup id.
func resultOf(t *testing.T, e *env, s *server.Session, id uint64) uint32 {
	t.Helper()
	var n uint32
	testkit.Eventually(t, 20*time.Second, fmt.Sprintf("lookup %d to answer", id), func() bool {
		r, err := e.st.LookupResult(s, &ipc.LookupResultReq{LookupID: id})
		assert.NilError(t, err)
		if r.Status == ipc.StatusPending {
			return false
		}
		assert.Equal(t, r.Status, ipc.StatusOK)
		n = r.Chunks
		return true
	})
	return n
}

// heapNow is the live heap after a full collection.
func heapNow() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

var (
	nsLive = kv.Namespace{0xB2}
	nsGone = kv.Namespace{0xC3}
)

// A session with many lookups that miss in L1 and fill from a slow L2
// closes: their fills end at once (not at --l2-prefetch-timeout), at every
// stage — loads writing into L1 staging, lookups waiting for admission
// budget, big L2 lookups — and give back everything: controller
// goroutines, admission bytes and queue places, L1 staging, L2 holds and
// the fills' memory. Another session's fill running meanwhile is
// unaffected: it loads and answers in full once its L2 answers.
func TestDroppedLookupsEndTheirFills(t *testing.T) {
	const (
		k       = 8     // chunks of each loading lookup
		loading = 6     // dropped lookups of the L2-resident prompt: 1 loads, the rest wait for budget
		big     = 4     // dropped lookups stuck in the L2 lookup
		bigN    = 16384 // chunks of each
	)
	dir := t.TempDir()
	hsA, hsB := hashes("dropped", k), hashes("live", k)
	a := newEnv(t, 8, nil, server.Options{}, fsConfig(dir))
	a.put(t, 0, hsA)
	putNS(t, a, a.sess, nsLive, hsB)
	a.flush(t)
	a.close(t)

	const timeout = 60 * time.Second
	b := newEnv(t, 32, func(c *server.Config) {
		c.L2StorePolicy = tier.PolicyNone
		c.L2PrefetchTimeout = timeout
		c.L2AdmissionWait = timeout
		c.L2PrefetchBudgetGB = float64(2*k*objSize) / (1 << 30) // the live fill and one dropped one
	}, server.Options{}, slowConfig(dir))
	sb := slow(b)
	pc := b.st.PrefetchController()
	gateLive := sb.block(sb.loadGate, nsLive)
	sb.block(sb.loadGate, ns1)
	sb.block(sb.existsGate, nsGone)

	// The live session's fill: admitted, loading, its load waiting for L2.
	assert.NilError(t, b.st.Lookup(b.sess, &ipc.LookupReq{LookupID: 1, Namespace: nsLive, WorldSize: 1, Hashes: hsB}))
	testkit.Eventually(t, 5*time.Second, "the live fill's load to reach L2", func() bool { return sb.blocked.Load() == 1 })
	baseG, baseHeap := runtime.NumGoroutine(), heapNow()

	doomed, err := b.st.OpenSession(kv.Tag{0xD0})
	assert.NilError(t, err)
	for i := range loading {
		assert.NilError(t, b.st.Lookup(doomed, &ipc.LookupReq{LookupID: uint64(1 + i), Namespace: ns1, WorldSize: 1, Hashes: hsA}))
	}
	testkit.Eventually(t, 5*time.Second, "one dropped fill loading, the others waiting for budget", func() bool {
		return sb.blocked.Load() == 2 && b.stat(t, "kvshim_l2_prefetch_admission_queue") == loading-1
	})
	for i := range big {
		hs := hashes(fmt.Sprint("big ", i), bigN)
		assert.NilError(t, b.st.Lookup(doomed, &ipc.LookupReq{LookupID: uint64(100 + i), Namespace: nsGone, WorldSize: 1, Hashes: hs}))
	}
	testkit.Eventually(t, 5*time.Second, "the big fills' L2 lookups to block", func() bool { return sb.blocked.Load() == 2+big })
	assert.Equal(t, pc.Stats().Inflight, int64(1+loading+big))
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=staging}"), float64(2*k))
	held := heapNow()
	t.Logf("heap: baseline %.1f MiB, with %d dropped fills %.1f MiB (%.0f bytes a cell of the big lookups)",
		mib(baseHeap), loading+big, mib(held), float64(held-baseHeap)/float64(big*bigN))

	// Bounds far below the 60 s deadline (they are generous for -race:
	// failing a big batch key by key takes a while there).
	start := time.Now()
	b.st.CloseSession(doomed)
	testkit.Eventually(t, 10*time.Second, "the dropped fills and their L2 calls to end", func() bool {
		return pc.Stats().Inflight == 1 && sb.calls.Load() == 1
	})
	testkit.Eventually(t, 5*time.Second, "their reservations to be given back", func() bool {
		return b.stat(t, "kvshim_l2_prefetch_admission_queue") == 0 &&
			b.stat(t, "kvshim_l2_prefetch_accepted_bytes") == 0 &&
			b.stat(t, "kvshim_l1_prefetch_bytes") == k*objSize && // the live fill's staging
			b.stat(t, "kvshim_l1_objects{state=staging}") == k &&
			b.stat(t, "kvshim_l1_objects{state=temporary}") == 0
	})
	testkit.Eventually(t, 5*time.Second, "their goroutines to exit", func() bool { return runtime.NumGoroutine() <= baseG })
	ad := b.st.L2Adapters()[0]
	for _, h := range hsA {
		assert.Equal(t, ad.Held(tier.Key(ns1, 0, h)), 0)
	}
	ended := time.Since(start)
	after := heapNow()
	t.Logf("dropped fills ended in %v; heap %.1f MiB after", ended, mib(after))
	assert.Assert(t, after < baseHeap+(held-baseHeap)/10+(2<<20),
		"heap %.1f MiB after the session closed: baseline %.1f MiB, %.1f MiB with its fills", mib(after), mib(baseHeap), mib(held))
	assert.Equal(t, pc.Stats().Cancelled, int64(loading+big))
	assert.Equal(t, pc.Stats().Timeouts, int64(0))

	// The live fill was not disturbed: once L2 answers it loads in full.
	close(gateLive)
	assert.Equal(t, resultOf(t, b, b.sess, 1), uint32(k))
	rr, err := b.st.Retrieve(b.sess, &ipc.RetrieveReq{Owner: b.sess.ID(), LookupID: 1, End: k})
	assert.NilError(t, err)
	for c, l := range rr.Locs {
		assert.Equal(t, rr.Status[c], ipc.StatusOK)
		assert.Assert(t, string(b.src.at(l)) == string(patternIn(nsLive, hsB[c], 0)), "chunk %d: wrong bytes", c)
	}
	assert.NilError(t, b.st.Release(b.sess, &ipc.ReleaseReq{Owner: b.sess.ID(), LookupID: 1}))
	testkit.Eventually(t, 20*time.Second, "the live fill to end", func() bool {
		return pc.Stats().Inflight == 0 && b.stat(t, "kvshim_l1_prefetch_bytes") == 0 &&
			b.stat(t, "kvshim_l1_objects{state=staging}") == 0 && b.stat(t, "kvshim_l1_objects{state=temporary}") == 0
	})
	s := pc.Stats()
	assert.Equal(t, s.ChunksOK[0], int64(k))
	assert.Equal(t, s.Loaded, int64(2))
	assert.Equal(t, s.Cancelled, int64(loading+big))
}

func mib(n uint64) float64 { return float64(n) / (1 << 20) }

// A dropped fill whose load ignores its context (a read stuck in the
// kernel): everything else of the fill ends, but the staging buffers the
// load writes stay reserved until it reports, then are freed, once.
func TestDroppedFillKeepsStagingUnderStuckLoad(t *testing.T) {
	const k = 4
	dir := t.TempDir()
	hs := hashes("stuck", k)
	a := newEnv(t, 4, nil, server.Options{}, fsConfig(dir))
	a.put(t, 0, hs)
	a.flush(t)
	a.close(t)
	b := newEnv(t, 8, func(c *server.Config) {
		c.L2StorePolicy = tier.PolicyNone
		c.L2PrefetchTimeout = time.Minute
	}, server.Options{}, slowConfig(dir))
	sb, pc := slow(b), b.st.PrefetchController()
	stuck := make(chan struct{})
	var unstick sync.Once
	t.Cleanup(func() { unstick.Do(func() { close(stuck) }) }) // before the core closes
	sb.mu.Lock()
	sb.stuck = stuck
	sb.mu.Unlock()

	doomed, err := b.st.OpenSession(kv.Tag{0xD1})
	assert.NilError(t, err)
	assert.NilError(t, b.st.Lookup(doomed, &ipc.LookupReq{LookupID: 1, Namespace: ns1, WorldSize: 1, Hashes: hs}))
	testkit.Eventually(t, 5*time.Second, "the load to be stuck", func() bool { return sb.blocked.Load() == 1 })
	b.st.CloseSession(doomed)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, b.stat(t, "kvshim_l1_prefetch_bytes"), float64(k*objSize))
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=staging}"), float64(k))
	assert.Equal(t, pc.Stats().Inflight, int64(1))
	unstick.Do(func() { close(stuck) })
	testkit.Eventually(t, 5*time.Second, "the stuck load to report and free its staging", func() bool {
		return b.stat(t, "kvshim_l1_prefetch_bytes") == 0 && pc.Stats().Inflight == 0
	})
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=staging}"), 0.0)
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=temporary}"), 0.0)
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=resident}"), 0.0)
	assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), 0.0)
	s := pc.Stats()
	assert.Equal(t, s.Cancelled, int64(1))
	assert.Equal(t, s.Timeouts, int64(0))
	assert.Equal(t, s.ChunksOK[0], int64(0)) // the load saw its context had ended
	assert.Equal(t, s.ChunksFailed[0], int64(k))
}

// taskRecorder is a tier.Filler that only records the fill tasks.
type taskRecorder struct{ tasks chan *server.FillTask }

func (p taskRecorder) Fill(_ tier.FillRequest, f tier.Fill) bool {
	p.tasks <- f.(*server.FillTask)
	return true
}

// FillTask.Context ends when the lookup is dropped, whether the filler
// asked for it before or only after; another session's task is not
// touched, and a dropped task refuses reservations but still takes Done.
func TestFillTaskContextEndsWhenLookupDropped(t *testing.T) {
	rec := taskRecorder{make(chan *server.FillTask, 3)}
	e := newEnv(t, 4, nil, server.Options{Filler: rec})
	doomed, err := e.st.OpenSession(kv.Tag{0xD2})
	assert.NilError(t, err)
	hs := hashes("ctx", 4)
	lookup := func(s *server.Session, id uint64) *server.FillTask {
		assert.NilError(t, e.st.Lookup(s, &ipc.LookupReq{LookupID: id, Namespace: ns1, WorldSize: 1, Hashes: hs}))
		return <-rec.tasks
	}
	early, late, live := lookup(doomed, 1), lookup(doomed, 2), lookup(e.sess, 1)
	earlyCtx, liveCtx := early.Context(), live.Context()
	assert.NilError(t, earlyCtx.Err())

	e.st.CloseSession(doomed)
	assert.ErrorIs(t, earlyCtx.Err(), context.Canceled)
	assert.ErrorIs(t, late.Context().Err(), context.Canceled) // made after the drop
	assert.NilError(t, liveCtx.Err())
	_, _, err = early.Reserve(0, 0, objSize, true)
	assert.ErrorIs(t, err, server.ErrFill)
	early.Done()
	late.Done()

	mem, ok, err := live.Reserve(0, 0, objSize, true)
	assert.NilError(t, err)
	assert.Assert(t, ok)
	copy(mem, pattern(hs[0], 0))
	assert.NilError(t, live.Commit(0, 0, true))
	live.Done()
	assert.NilError(t, liveCtx.Err())
	assert.Equal(t, resultOf(t, e, e.sess, 1), uint32(1))
	assert.Equal(t, e.stat(t, "kvshim_l1_objects{state=staging}"), 0.0)
}
