package l2

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// gateBackend is a test backend for the lane machinery itself: stores block
// until the gate opens, everything else answers at once. Keys with Rank 99
// are left unreported, Rank 98 panics.
type gateBackend struct {
	gate chan struct{}
	// busy, when set, keeps a Store whose context ended from returning
	// until it is closed (at most 10 s): its worker stays occupied for as
	// long as the test needs, whatever the machine's load.
	busy chan struct{}
	mu   sync.Mutex
	objs map[kv.Key]bool
}

func newGate() *gateBackend { return &gateBackend{gate: make(chan struct{}), objs: map[kv.Key]bool{}} }

func (g *gateBackend) Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r Reporter) {
	select {
	case <-g.gate:
	case <-ctx.Done():
		if g.busy != nil {
			select {
			case <-g.busy:
			case <-time.After(10 * time.Second):
			}
		}
		r.FailAll(len(keys), ctx.Err())
		return
	}
	for i, k := range keys {
		switch k.Rank {
		case 99:
			continue
		case 98:
			panic("boom")
		}
		g.mu.Lock()
		g.objs[k] = true
		g.mu.Unlock()
		r.Report(i, Result{Status: StatusOK, Bytes: len(bufs[i])})
	}
}

func (g *gateBackend) Exists(_ context.Context, keys []kv.Key, r Reporter) {
	for i, k := range keys {
		g.mu.Lock()
		ok := g.objs[k]
		g.mu.Unlock()
		st := StatusMiss
		if ok {
			st = StatusOK
		}
		r.Report(i, Result{Status: st})
	}
}

func (g *gateBackend) Load(_ context.Context, keys []kv.Key, _ [][]byte, r Reporter) {
	for i := range keys {
		r.Report(i, Result{Status: StatusMiss})
	}
}

func (g *gateBackend) Delete(_ context.Context, keys []kv.Key, r Reporter) {
	for i, k := range keys {
		g.mu.Lock()
		delete(g.objs, k)
		g.mu.Unlock()
		r.Report(i, Result{Status: StatusOK})
	}
}

func (g *gateBackend) Close() error { return nil }

func keyN(i int) kv.Key {
	var k kv.Key
	k.Hash[0], k.Hash[1] = byte(i), byte(i>>8)
	return k
}

func keysN(n int) []kv.Key {
	ks := make([]kv.Key, n)
	for i := range ks {
		ks[i] = keyN(i)
	}
	return ks
}

func openGate(t *testing.T, js string, reg prometheus.Registerer) (*Adapter, *gateBackend) {
	t.Helper()
	cfg, err := ParseAdapterConfig(js)
	assert.NilError(t, err)
	g := newGate()
	a, err := NewAdapter(g, cfg, reg, nil)
	assert.NilError(t, err)
	t.Cleanup(func() {
		select {
		case <-g.gate:
		default:
			close(g.gate)
		}
		assert.NilError(t, a.Close())
	})
	return a, g
}

// With dedicated lanes, a lookup completes while every store worker is
// blocked; with the shared pool it waits behind the stores.
func TestLookupNotQueuedBehindStores(t *testing.T) {
	for _, tc := range []struct {
		name       string
		cfg        string
		lookupDone bool
	}{
		{"lanes", `{"type":"t","num_workers":2,"per_op_workers":{"lookup":1,"store":2}}`, true},
		{"shared", `{"type":"t","num_workers":2}`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, g := openGate(t, tc.cfg, nil)
			ctx := context.Background()
			stores := a.Store(ctx, keysN(8), make([][]byte, 8))
			look := a.LookupAndHold(ctx, keysN(4))
			select {
			case <-look.Done():
				assert.Assert(t, tc.lookupDone, "lookup finished behind blocked stores")
			case <-time.After(300 * time.Millisecond):
				assert.Assert(t, !tc.lookupDone, "lookup queued behind stores")
			}
			close(g.gate)
			_, err := stores.Wait(ctxT(t))
			assert.NilError(t, err)
			_, err = look.Wait(ctxT(t))
			assert.NilError(t, err)
			assert.Equal(t, stores.Bitmap().Count(), 8)
		})
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestTaskResultsAndHolds(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	a, g := openGate(t, `{"type":"t","name":"g1","num_workers":3}`, reg)
	close(g.gate)
	ks := keysN(10)
	ks[4].Rank = 99 // unreported
	ks[7].Rank = 98 // panics: its whole tile fails
	st := a.Store(context.Background(), ks, make([][]byte, 10))
	res, err := st.Wait(ctxT(t))
	assert.NilError(t, err)
	assert.Assert(t, errors.Is(res[4].Err, ErrNotReported), "%v", res[4].Err)
	assert.Equal(t, res[7].Status, StatusFailed)
	assert.Assert(t, is.Contains(res[7].Err.Error(), "panic"))
	failed := st.Failed()
	assert.Assert(t, len(failed) >= 2)
	n := 0
	for ev := range st.Events() {
		assert.Equal(t, ev.Key, ks[ev.Index])
		n++
	}
	assert.Equal(t, n, 10)

	look := a.LookupAndHold(context.Background(), ks)
	_, err = look.Wait(ctxT(t))
	assert.NilError(t, err)
	bm := look.Bitmap()
	assert.Equal(t, bm.Prefix(), 4)
	assert.Equal(t, a.Held(ks[0]), 1)
	assert.Equal(t, a.Held(ks[4]), 0)

	del := a.Delete(context.Background(), ks[:2])
	res, err = del.Wait(ctxT(t))
	assert.NilError(t, err)
	assert.Assert(t, errors.Is(res[0].Err, ErrHeld))
	a.Release(ks)
	a.Release(ks) // extra releases are ignored
	res, err = a.Delete(context.Background(), ks[:2]).Wait(ctxT(t))
	assert.NilError(t, err)
	assert.Equal(t, res[0].Status, StatusOK)
	assert.Equal(t, res[1].Status, StatusOK)

	assert.Equal(t, float64(a.m.keys[OpLookup][StatusOK].Load()), float64(bm.Count()))
	assert.Equal(t, float64(a.m.holds.Load()), 0.0)
	cnt, err := testutil.GatherAndCount(reg, "kvshim_l2_task_seconds")
	assert.NilError(t, err)
	assert.Assert(t, cnt >= 4)
	for _, name := range []string{"kvshim_l2_tasks_total", "kvshim_l2_keys_total", "kvshim_l2_bytes_total",
		"kvshim_l2_errors_total", "kvshim_l2_queue_wait_seconds", "kvshim_l2_queue_depth",
		"kvshim_l2_inflight_tasks", "kvshim_l2_lane_workers", "kvshim_l2_held_keys"} {
		n, err := testutil.GatherAndCount(reg, name)
		assert.NilError(t, err)
		assert.Assert(t, n > 0, name)
	}
	assert.Equal(t, float64(a.m.errors[OpStore].Load()), float64(len(failed)))
	assert.Equal(t, float64(a.m.depth[OpStore].Load()), 0.0)
	assert.Equal(t, float64(a.m.inflight[OpLookup].Load()), 0.0)
	// a second adapter with the same name in the same registry is refused
	_, err = NewAdapter(newGate(), &Config{Type: "t", Name: "g1", Lanes: LaneConfig{Shared: 1}}, reg, nil)
	assert.ErrorContains(t, err, "metrics")
}

func TestQueuedTileTimesOut(t *testing.T) {
	a, g := openGate(t, `{"type":"t","num_workers":1,"op_timeout_ms":100}`, nil)
	// The store holds the one worker past its op timeout until the lookup's
	// deadline has passed: the lookup is queued behind it however late this
	// goroutine runs (under load it once ran after the store had ended, and
	// the lookup found an idle worker and a live context).
	g.busy = make(chan struct{})
	start := time.Now()
	st := a.Store(context.Background(), keysN(3), make([][]byte, 3))
	lctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	look := a.LookupAndHold(lctx, keysN(2)) // its deadline passes while it is queued
	<-lctx.Done()
	close(g.busy)
	res, err := look.Wait(ctxT(t))
	assert.NilError(t, err)
	for _, r := range res {
		assert.Assert(t, errors.Is(r.Err, context.DeadlineExceeded), "%v", r.Err)
	}
	res, err = st.Wait(ctxT(t))
	assert.NilError(t, err)
	assert.Assert(t, errors.Is(res[0].Err, context.DeadlineExceeded))
	assert.Assert(t, time.Since(start) < 5*time.Second)
}

func TestBadBatchAndClosed(t *testing.T) {
	a, g := openGate(t, `{"type":"t"}`, nil)
	close(g.gate)
	res, err := a.Load(context.Background(), keysN(2), make([][]byte, 1)).Wait(ctxT(t))
	assert.NilError(t, err)
	assert.Assert(t, errors.Is(res[1].Err, ErrBadBatch))
	empty := a.Delete(context.Background(), nil)
	_, err = empty.Wait(ctxT(t))
	assert.NilError(t, err)
	assert.NilError(t, a.Close())
	res, err = a.LookupAndHold(context.Background(), keysN(1)).Wait(ctxT(t))
	assert.NilError(t, err)
	assert.Assert(t, errors.Is(res[0].Err, ErrClosed))
}

func TestLaneConfigValidate(t *testing.T) {
	for i, tc := range []struct {
		c   LaneConfig
		bad string
	}{
		{LaneConfig{Shared: 4}, ""},
		{LaneConfig{Shared: 0, PerOp: map[Op]int{OpLookup: 1}}, "num_workers"},
		{LaneConfig{Shared: 1, PerOp: map[Op]int{OpStore: 0}}, "per_op_workers.store"},
		{LaneConfig{Shared: 1, PerOp: map[Op]int{Op(9): 1}}, "unknown lane"},
	} {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			err := tc.c.Validate()
			if tc.bad == "" {
				assert.NilError(t, err)
				return
			}
			assert.Assert(t, is.ErrorContains(err, tc.bad))
		})
	}
}

// sampledBackend is a gateBackend with a number of its own (Sampler).
type sampledBackend struct {
	*gateBackend
	n atomic.Int64
}

func (s *sampledBackend) Samples() []metric.Sample {
	return []metric.Sample{{Name: "kvshim_l2_t_things_total", Help: "Things the test backend did.", Counter: true,
		Labels: "kind=x", Value: float64(s.n.Load())}}
}

// A backend's Samples are exported with the adapter's: on the registry
// with the const label adapter=<name>, in Adapter.Samples (STATS) with
// adapter=<name> first, both read at the time of asking; two adapters'
// in one registry coexist.
func TestBackendSamples(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	var bs [2]*sampledBackend
	var as [2]*Adapter
	for i, name := range []string{"s1", "s2"} {
		bs[i] = &sampledBackend{gateBackend: newGate()}
		close(bs[i].gate)
		a, err := NewAdapter(bs[i], &Config{Type: "t", Name: name, Lanes: LaneConfig{Shared: 1}}, reg, nil)
		assert.NilError(t, err)
		t.Cleanup(func() { assert.NilError(t, a.Close()) })
		as[i] = a
	}
	bs[1].n.Store(3)
	want := func(s1, s2 float64) string {
		return fmt.Sprintf(`
# HELP kvshim_l2_t_things_total Things the test backend did.
# TYPE kvshim_l2_t_things_total counter
kvshim_l2_t_things_total{adapter="s1",kind="x"} %g
kvshim_l2_t_things_total{adapter="s2",kind="x"} %g
`, s1, s2)
	}
	assert.NilError(t, testutil.GatherAndCompare(reg, strings.NewReader(want(0, 3)), "kvshim_l2_t_things_total"))
	bs[0].n.Add(2)
	assert.NilError(t, testutil.GatherAndCompare(reg, strings.NewReader(want(2, 3)), "kvshim_l2_t_things_total"))

	got := map[string]float64{}
	for _, s := range as[0].Samples() {
		got[s.StatName()] = s.Value
	}
	assert.Equal(t, got["kvshim_l2_t_things_total{adapter=s1,kind=x}"], 2.0)
	assert.Equal(t, got["kvshim_l2_tasks_total{adapter=s1,op=store}"], 0.0)
	_, ok := got["kvshim_l2_held_keys{adapter=s1}"]
	assert.Assert(t, ok, "%v", got)
	assert.Equal(t, len(got), len(as[0].Samples()), "one name twice")
}
