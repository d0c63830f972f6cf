package server

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// Memory a session's live lookups may hold, as doc.go states it: per
// lookup at most lookupFixedBytes (struct, map entry, fill task) plus 24
// bytes per reader (its hold-table row), per cell (chunk × reader) at most
// 37 bytes (32 of hash, 4 of hold, 1 FREE mark). A lookup has at least as
// many cells as readers, so a session holds at most
// MaxLookupsPerSession × 512 + MaxLookupCellsPerSession × 61 bytes.
const (
	lookupFixedBytes = 512
	lookupCellBytes  = 37 + 24
)

func lookupBound(cfg Config) uint64 {
	return uint64(cfg.MaxLookupsPerSession)*lookupFixedBytes + uint64(cfg.MaxLookupCellsPerSession)*lookupCellBytes
}

// heapInUse is the Go heap in use after a full collection (what the
// core's structures and everything else live still occupy).
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC() // the first may leave finalizer-held objects for the second
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// lookupReq is a LOOKUP of n fresh (zero: missing) chunks, a new slice each
// time as the codec decodes one per request.
func lookupReq(id uint64, n int, world uint32) *ipc.LookupReq {
	return &ipc.LookupReq{LookupID: id, Namespace: ns1, WorldSize: world, Hashes: make([]kv.Hash, n)}
}

func TestLookupLimitDefaults(t *testing.T) {
	st := newCore(t, 4, Options{})
	cfg := st.Config()
	assert.Equal(t, cfg.MaxLookupsPerSession, 4096)
	assert.Equal(t, cfg.MaxLookupCellsPerSession, 1<<20)
	// The bound doc.go states for the defaults.
	assert.Assert(t, lookupBound(cfg) <= 64<<20, "%d", lookupBound(cfg))

	// The largest single lookup fits an idle session; a second does not.
	s := open(t, st, 1)
	assert.NilError(t, st.Lookup(s, lookupReq(1, ipc.MaxKeys, MaxLookupCells/ipc.MaxKeys)))
	err := st.Lookup(s, lookupReq(2, 1, 1))
	assert.Assert(t, errors.Is(err, ErrLookupLimit), "%v", err)
	assert.Equal(t, StatusOf(err), ipc.StatusBadRequest)
	assert.ErrorContains(t, err, "--max-lookup-cells-per-session 1048576")

	// 4,096 one-chunk lookups fit; the next is refused by the count.
	s2 := open(t, st, 2)
	for i := range 4096 {
		assert.NilError(t, st.Lookup(s2, lookupReq(uint64(i+1), 1, 1)))
	}
	err = st.Lookup(s2, lookupReq(5000, 1, 1))
	assert.Assert(t, errors.Is(err, ErrLookupLimit), "%v", err)
	assert.ErrorContains(t, err, "--max-lookups-per-session 4096")
	// Reading an answer forgets a lookup that holds nothing: room again.
	r, err := st.LookupResult(s2, &ipc.LookupResultReq{LookupID: 1})
	assert.NilError(t, err)
	assert.Equal(t, r.Status, ipc.StatusOK)
	assert.NilError(t, st.Lookup(s2, lookupReq(5000, 1, 1)))
	assert.Equal(t, stat(t, st, "kvshim_lookups_rejected_total{limit=cells}"), 1.0)
	assert.Equal(t, stat(t, st, "kvshim_lookups_rejected_total{limit=lookups}"), 1.0)
	assert.Equal(t, stat(t, st, "kvshim_lookup_cells"), float64(1<<20+4096))
}

func TestLookupLimitConfig(t *testing.T) {
	for _, c := range []struct {
		lookups, cells int
		err            string
	}{
		{-1, 0, "--max-lookups-per-session must not be negative"},
		{0, -1, "--max-lookup-cells-per-session must not be negative"},
	} {
		cfg := DefaultConfig()
		cfg.MaxLookupsPerSession, cfg.MaxLookupCellsPerSession = c.lookups, c.cells
		err := cfg.Validate()
		assert.Assert(t, errors.Is(err, ErrConfig))
		assert.ErrorContains(t, err, c.err)
	}
}

// TestLookupFloodMemory floods one session with more lookups and more
// chunks than its limits allow, some pending on a fill: everything past
// the limits is refused with a clear error, the Go heap grows by no more
// than the stated bound, and everything comes back when the session ends.
func TestLookupFloodMemory(t *testing.T) {
	pf := &manualFiller{}
	st := newCore(t, 4, Options{Filler: pf}, func(c *Config) {
		c.MaxLookupsPerSession = 64
		c.MaxLookupCellsPerSession = 64<<10 + 1024
	})
	cfg := st.Config()
	bound := lookupBound(cfg) // 3.9 MiB
	save(t, st, open(t, st, 9), 1, 0, hashes("flood", 4))
	const slack = 1 << 20 // test bookkeeping, the core's maps' buckets
	base := heapInUse()

	s := open(t, st, 1)
	var refused [numLookupLimits]int
	const n = 4096 // chunks per lookup: 128 KiB of hashes each
	for i := range 256 {
		req := lookupReq(uint64(i+1), n, 1)
		if i%2 == 0 {
			copy(req.Hashes, hashes("flood", 4)) // a hit prefix held
		}
		if i%3 == 0 {
			req.WorldSize = 2 // two readers: 2n cells
		}
		err := st.Lookup(s, req)
		switch {
		case err == nil:
		case errors.Is(err, ErrLookupLimit) && StatusOf(err) == ipc.StatusBadRequest:
			switch {
			case strings.Contains(err.Error(), "--max-lookup-cells-per-session 66560"):
				refused[limitCells]++
			case strings.Contains(err.Error(), "--max-lookups-per-session 64"):
				refused[limitLookups]++
			default:
				t.Fatalf("lookup %d: a limit error that names no limit: %v", i, err)
			}
		default:
			t.Fatalf("lookup %d: %v", i, err)
		}
	}
	live := stat(t, st, "kvshim_lookups_live")
	cells := stat(t, st, "kvshim_lookup_cells")
	t.Logf("%v live lookups, %v cells, refused %v, pending fills %d", live, cells, refused, len(pf.tasks))
	// Checks, not asserts: the heap is measured below even when they fail.
	assert.Check(t, cells <= float64(cfg.MaxLookupCellsPerSession))
	assert.Check(t, refused[limitCells] > 200, "refused %v", refused)
	assert.Check(t, is.Equal(stat(t, st, "kvshim_lookups_rejected_total{limit=cells}"), float64(refused[limitCells])))

	// Small lookups then meet the count limit.
	for i := range 100 {
		err := st.Lookup(s, lookupReq(uint64(1000+i), 1, 1))
		if err != nil {
			assert.ErrorContains(t, err, "--max-lookups-per-session 64")
			refused[limitLookups]++
		}
	}
	assert.Check(t, is.Equal(stat(t, st, "kvshim_lookups_live"), float64(cfg.MaxLookupsPerSession)))
	assert.Check(t, is.Equal(stat(t, st, "kvshim_lookups_rejected_total{limit=lookups}"), float64(refused[limitLookups])))
	during := heapInUse()
	t.Logf("heap: base %d KiB, during +%d KiB (bound %d KiB)", base>>10, int64(during-base)>>10, bound>>10)
	assert.Assert(t, during <= base+bound+slack, "heap grew by %d KiB, bound %d KiB", (during-base)>>10, bound>>10)

	st.CloseSession(s)
	for _, task := range pf.tasks {
		task.Done() // the fills end (cancelled: they answer nothing)
	}
	pf.tasks = nil
	assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_lookup_cells"), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_holds"), 0.0)
	st.mu.Lock()
	leftover := len(st.metrics.usage.cells)
	st.mu.Unlock()
	assert.Equal(t, leftover, 0, "a closed session left lookup accounting behind")
	after := heapInUse()
	t.Logf("heap after close: %+d KiB from base", (int64(after)-int64(base))>>10)
	assert.Assert(t, after <= base+slack, "heap %d KiB above base after the session closed", (after-base)>>10)
}

// TestLookupLimitOverIPC: a client past a limit gets StatusBadRequest with
// the limit in the message, its session stays usable, and what its
// lookups held is gone once it disconnects.
func TestLookupLimitOverIPC(t *testing.T) {
	srv, socket := startServer(t, func(cfg *Config) {
		cfg.MaxLookupsPerSession = 8
		cfg.MaxLookupCellsPerSession = 4096
	})
	st := srv.Core
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	c := dial(t, socket, ipc.RoleScheduler)
	for i := range 4 {
		assert.NilError(t, c.Lookup(ctx, lookupReq(uint64(i+1), 1024, 1)))
	}
	err := c.Lookup(ctx, lookupReq(5, 1, 1))
	var se *ipc.StatusError
	assert.Assert(t, errors.As(err, &se), "%v", err)
	assert.Equal(t, se.Status, ipc.StatusBadRequest)
	assert.Assert(t, is.Contains(se.Msg, "--max-lookup-cells-per-session 4096"))
	for i := range 4 { // read (a miss holds nothing): forgotten
		r, err := c.LookupResult(ctx, &ipc.LookupResultReq{LookupID: uint64(i + 1)})
		assert.NilError(t, err)
		assert.Equal(t, r.Status, ipc.StatusOK)
	}
	for i := range 8 {
		assert.NilError(t, c.Lookup(ctx, lookupReq(uint64(100+i), 1, 1)))
	}
	err = c.Lookup(ctx, lookupReq(200, 1, 1))
	assert.Assert(t, errors.As(err, &se), "%v", err)
	assert.Equal(t, se.Status, ipc.StatusBadRequest)
	assert.Assert(t, is.Contains(se.Msg, "--max-lookups-per-session 8"))
	assert.NilError(t, c.Ping(ctx)) // a refusal does not end the session
	assert.Equal(t, stat(t, st, "kvshim_lookups_rejected_total{limit=cells}"), 1.0)
	assert.Equal(t, stat(t, st, "kvshim_lookups_rejected_total{limit=lookups}"), 1.0)

	c.Close()
	testkit.Eventually(t, 10*time.Second, "the closed session to end (kvshim_sessions 0)", func() bool { return stat(t, st, "kvshim_sessions") == 0 })
	assert.Equal(t, stat(t, st, "kvshim_lookups_live"), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_lookup_cells"), 0.0)
}
