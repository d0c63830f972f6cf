package tier_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/fs"
)

const objSize = 64 << 10

var ns1 = kv.Namespace{0xA1}

// segSource is a heap SegmentSource that lets the test resolve Locs.
type segSource struct {
	mu   sync.Mutex
	segs map[uint32][]byte
}

func (s *segSource) NewSegment(id uint32, size uint64) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.segs == nil {
		s.segs = map[uint32][]byte{}
	}
	m := make([]byte, size)
	s.segs[id] = m
	return m, nil
}

func (s *segSource) Close() error { return nil }

func (s *segSource) at(l ipc.Loc) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.segs[l.Segment][l.Offset : l.Offset+l.Size]
}

type env struct {
	st   *server.Core
	src  *segSource
	sess *server.Session
	ids  uint64
}

// newEnv starts a core of capMiB MiB with the given adapters (JSON).
func newEnv(t *testing.T, capMiB float64, tweak func(*server.Config), o server.Options, adapters ...string) *env {
	t.Helper()
	cfg := server.DefaultConfig()
	cfg.L1SizeGB = capMiB / 1024
	cfg.SegmentSize = uint64(capMiB*(1<<20)) / 2
	cfg.SlabSize = 256 << 10
	cfg.L2Adapters = adapters
	cfg.L2PrefetchTimeout = 10 * time.Second
	if tweak != nil {
		tweak(&cfg)
	}
	src := &segSource{}
	o.Source = src
	st, err := server.NewCore(cfg, o)
	assert.NilError(t, err)
	e := &env{st: st, src: src}
	e.sess, err = st.OpenSession(kv.Tag{0x5e})
	assert.NilError(t, err)
	t.Cleanup(func() { e.close(t) })
	return e
}

func (e *env) close(t *testing.T) {
	if e.st != nil {
		assert.NilError(t, e.st.Close())
		e.st = nil
	}
}

func hashes(seed string, n int) []kv.Hash {
	out := make([]kv.Hash, n)
	prev := sha256.Sum256([]byte(seed))
	for i := range out {
		var b [36]byte
		copy(b[:], prev[:])
		binary.LittleEndian.PutUint32(b[32:], uint32(i))
		prev = sha256.Sum256(b[:])
		out[i] = prev
	}
	return out
}

// pattern is the content of object (ns1, rank, hash): an object header
// that names its key, then a payload derived from the key.
func pattern(h kv.Hash, rank uint32) []byte { return patternIn(ns1, h, rank) }

func patternIn(ns kv.Namespace, h kv.Hash, rank uint32) []byte {
	b := make([]byte, objSize)
	for i := range b {
		b[i] = h[i%32] ^ byte(rank) ^ byte(i>>8) ^ ns[0]
	}
	if err := objfmt.Seal(b, objfmt.Header{ChunkTokens: 16, Key: kv.Key{Namespace: ns, Rank: rank, Hash: h}}); err != nil {
		panic(err)
	}
	return b
}

// put writes chunks hs of rank into L1 (ALLOC, fill, COMMIT).
func (e *env) put(t *testing.T, rank uint32, hs []kv.Hash) {
	t.Helper()
	tag := kv.Tag{0x77, byte(rank)}
	sizes := make([]uint64, len(hs))
	for i := range sizes {
		sizes[i] = objSize
	}
	ar, err := e.st.Alloc(e.sess, &ipc.AllocReq{Tag: tag, Namespace: ns1, Rank: rank, Hashes: hs, Sizes: sizes})
	assert.NilError(t, err)
	var ok []kv.Hash
	for i, s := range ar.Status {
		if s == ipc.StatusOK {
			copy(e.src.at(ar.Locs[i]), pattern(hs[i], rank))
			ok = append(ok, hs[i])
		}
	}
	_, err = e.st.Commit(e.sess, &ipc.CommitReq{Tag: tag, Namespace: ns1, Rank: rank, Hashes: ok})
	assert.NilError(t, err)
}

// lookup registers a lookup and waits (bounded) for its final answer.
func (e *env) lookup(t *testing.T, world uint32, mla bool, hs []kv.Hash) (id uint64, chunks uint32) {
	t.Helper()
	e.ids++
	id = e.ids
	assert.NilError(t, e.st.Lookup(e.sess, &ipc.LookupReq{LookupID: id, Namespace: ns1, WorldSize: world, MLA: mla, Hashes: hs}))
	return id, e.result(t, id)
}

func (e *env) result(t testing.TB, id uint64) uint32 {
	var r *ipc.LookupResultResp
	testkit.Eventually(t, 20*time.Second, fmt.Sprintf("lookup %d to be answered", id), func() bool {
		var err error
		r, err = e.st.LookupResult(e.sess, &ipc.LookupResultReq{LookupID: id})
		assert.NilError(t, err)
		return r.Status != ipc.StatusPending
	})
	assert.Equal(t, r.Status, ipc.StatusOK)
	return r.Chunks
}

// check retrieves chunks [0, n) for every reader rank, verifies the bytes
// and releases the lookup's holds.
func (e *env) check(t *testing.T, id uint64, world uint32, mla bool, hs []kv.Hash, n uint32) {
	t.Helper()
	for r := range world {
		rr, err := e.st.Retrieve(e.sess, &ipc.RetrieveReq{Owner: e.sess.ID(), LookupID: id, Rank: r, End: n})
		assert.NilError(t, err)
		for c, l := range rr.Locs {
			assert.Equal(t, rr.Status[c], ipc.StatusOK)
			src := r
			if mla {
				src = 0
			}
			assert.Assert(t, string(e.src.at(l)) == string(pattern(hs[c], src)), "chunk %d rank %d: wrong bytes", c, r)
		}
		assert.NilError(t, e.st.Release(e.sess, &ipc.ReleaseReq{Owner: e.sess.ID(), LookupID: id, Rank: r}))
	}
}

func (e *env) stat(t testing.TB, name string) float64 {
	v, ok := e.st.Stat(name)
	assert.Assert(t, ok, "no stat %s", name)
	return v
}

func (e *env) flush(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	assert.NilError(t, e.st.Writer().Flush(ctx))
}

func fsConfig(dir string) string { return fmt.Sprintf(`{"type":"fs","base_path":%q}`, dir) }

// faultfs is a test-only adapter type: the real fs backend plus fault
// injection (failed loads for chosen keys, a gate that holds stores) and
// a record of L1 segment registrations.
type faultBackend struct {
	*fs.Backend
	mu       sync.Mutex
	failLoad map[kv.Key]bool
	gate     chan struct{} // stores wait for it when non-nil
	stuck    chan struct{} // loads wait for it, ignoring their deadline, when non-nil
	loading  chan struct{} // closed when a load is stuck
	once     sync.Once
	segFDs   []int
}

func init() {
	l2.Register("faultfs", func(cfg *l2.Config, env l2.Env) (l2.Backend, error) {
		b, err := fs.New(cfg, env)
		if err != nil {
			return nil, err
		}
		return &faultBackend{Backend: b.(*fs.Backend), failLoad: map[kv.Key]bool{}}, nil
	})
}

func faultConfig(dir string) string { return fmt.Sprintf(`{"type":"faultfs","base_path":%q}`, dir) }

func (b *faultBackend) Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.mu.Lock()
	stuck, loading := b.stuck, b.loading
	b.mu.Unlock()
	if stuck != nil {
		b.once.Do(func() { close(loading) })
		<-stuck // like a read stuck in the kernel: no deadline
	}
	for i, k := range keys {
		b.mu.Lock()
		fail := b.failLoad[k]
		b.mu.Unlock()
		if fail {
			r.Fail(i, fmt.Errorf("injected load failure: %w", l2.ErrUnavailable))
			continue
		}
		b.Backend.Load(ctx, keys[i:i+1], bufs[i:i+1], r.Sub(i))
	}
}

func (b *faultBackend) Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.mu.Lock()
	g := b.gate
	b.mu.Unlock()
	if g != nil {
		select {
		case <-g:
		case <-ctx.Done():
		}
	}
	b.Backend.Store(ctx, keys, bufs, r)
}

func (b *faultBackend) RegisterL1Segment(fd int, mem []byte) error {
	b.mu.Lock()
	b.segFDs = append(b.segFDs, fd)
	b.mu.Unlock()
	return nil
}

func fault(e *env) *faultBackend { return e.st.L2Adapters()[0].Backend().(*faultBackend) }

func allocReq(hs []kv.Hash) *ipc.AllocReq {
	sizes := make([]uint64, len(hs))
	for i := range sizes {
		sizes[i] = objSize
	}
	return &ipc.AllocReq{Tag: kv.Tag{0x42}, Namespace: ns1, Hashes: hs, Sizes: sizes}
}
