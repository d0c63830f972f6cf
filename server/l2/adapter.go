package l2

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/prometheus/client_golang/prometheus"
)

// closeTimeout bounds how long Close waits for running tiles.
const closeTimeout = 30 * time.Second

// Adapter is the batch front of one backend: lanes, holds, metrics. It is
// safe for concurrent use.
type Adapter struct {
	name      string
	typ       string
	backend   Backend
	lanes     *lanes
	m         *metrics
	opTimeout time.Duration
	log       *slog.Logger
	closed    atomic.Bool

	holdMu sync.Mutex
	holds  map[kv.Key]int
}

// NewAdapter wraps a backend (Open does this for registered types). reg may
// be nil.
func NewAdapter(b Backend, cfg *Config, reg prometheus.Registerer, logger *slog.Logger) (*Adapter, error) {
	if logger == nil {
		logger = slog.Default()
	}
	if err := cfg.Lanes.Validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Name, reg, cfg.Lanes, b)
	if err != nil {
		return nil, fmt.Errorf("l2: metrics for %q: %w", cfg.Name, err)
	}
	l, err := newLanes(cfg.Lanes, m.depthAdd, m.waited)
	if err != nil {
		return nil, err
	}
	to := cfg.OpTimeout
	if to <= 0 {
		to = DefaultOpTimeout
	}
	return &Adapter{name: cfg.Name, typ: cfg.Type, backend: b, lanes: l, m: m, opTimeout: to,
		log: logger, holds: map[kv.Key]int{}}, nil
}

// Name is the adapter's config name (metrics label).
func (a *Adapter) Name() string { return a.name }

// Type is the adapter type ("fs", "redis", "mooncake_store").
func (a *Adapter) Type() string { return a.typ }

// Lanes is the lane configuration.
func (a *Adapter) Lanes() LaneConfig { return a.lanes.cfg }

// Samples are the adapter's numbers now, its backend's (Sampler) included:
// what its collector exports, with adapter=<name> first in each sample's
// labels, as STATS names them ("kvshim_l2_keys_total{adapter=disk,op=store,result=ok}").
// The latency histograms are not among them (server/internal/metric).
func (a *Adapter) Samples() []metric.Sample {
	out := a.m.samples()
	for i := range out {
		l := "adapter=" + a.name
		if out[i].Labels != "" {
			l += "," + out[i].Labels
		}
		out[i].Labels = l
	}
	return out
}

// Backend is the wrapped backend.
func (a *Adapter) Backend() Backend { return a.backend }

// Store writes bufs[i] under keys[i]. The caller keeps bufs valid and
// unchanged until the task is done. Per key: StatusOK (written or already
// present) or StatusFailed.
func (a *Adapter) Store(ctx context.Context, keys []kv.Key, bufs [][]byte) *Task {
	return a.submit(ctx, OpStore, keys, bufs, a.backend.Store, nil)
}

// LookupAndHold reports which keys are present (StatusOK) and takes a hold
// on each present key, to be dropped with Release.
func (a *Adapter) LookupAndHold(ctx context.Context, keys []kv.Key) *Task {
	return a.submit(ctx, OpLookup, keys, nil, func(ctx context.Context, k []kv.Key, _ [][]byte, r Reporter) {
		a.backend.Exists(ctx, k, r)
	}, func(t *Task, i int, r Result) {
		if r.Status == StatusOK {
			a.hold(t.keys[i])
		}
	})
}

// Load reads keys[i] into the caller's bufs[i] (L1 staging; len(bufs[i]) is
// the object size). The caller keeps bufs valid until the task is done and
// consumes only StatusOK buffers.
func (a *Adapter) Load(ctx context.Context, keys []kv.Key, bufs [][]byte) *Task {
	return a.submit(ctx, OpRetrieve, keys, bufs, a.backend.Load, nil)
}

// Delete removes keys. A held key is refused (StatusFailed, ErrHeld).
func (a *Adapter) Delete(ctx context.Context, keys []kv.Key) *Task {
	return a.submit(ctx, OpDelete, keys, nil, func(ctx context.Context, k []kv.Key, _ [][]byte, r Reporter) {
		free := make([]kv.Key, 0, len(k))
		idx := make([]int, 0, len(k))
		var held []int
		a.holdMu.Lock()
		for i, key := range k {
			if a.holds[key] > 0 {
				held = append(held, i)
				continue
			}
			free = append(free, key)
			idx = append(idx, i)
		}
		a.holdMu.Unlock()
		for _, i := range held {
			r.Fail(i, fmt.Errorf("delete %s: %w", k[i], ErrHeld))
		}
		if len(free) == 0 {
			return
		}
		a.backend.Delete(ctx, free, remapReporter(r, idx))
	}, nil)
}

// Release drops one hold per key (taken by LookupAndHold). It never fails;
// releasing a key that is not held is ignored.
func (a *Adapter) Release(keys []kv.Key) {
	a.holdMu.Lock()
	for _, k := range keys {
		switch n := a.holds[k]; {
		case n > 1:
			a.holds[k] = n - 1
		case n == 1:
			delete(a.holds, k)
		}
	}
	a.m.holds.Store(int64(len(a.holds)))
	a.holdMu.Unlock()
	if rel, ok := a.backend.(Releaser); ok {
		rel.Release(keys)
	}
}

// Held is the hold count of key.
func (a *Adapter) Held(k kv.Key) int {
	a.holdMu.Lock()
	defer a.holdMu.Unlock()
	return a.holds[k]
}

func (a *Adapter) hold(k kv.Key) {
	a.holdMu.Lock()
	a.holds[k]++
	a.m.holds.Store(int64(len(a.holds)))
	a.holdMu.Unlock()
}

// RegisterL1Segment announces an L1 shared-memory segment (memfd fd, kept
// open by the caller, mapped at mem) to backends that use it
// (SegmentRegistrar); for the others it does nothing.
func (a *Adapter) RegisterL1Segment(fd int, mem []byte) error {
	if r, ok := a.backend.(SegmentRegistrar); ok {
		return r.RegisterL1Segment(fd, mem)
	}
	return nil
}

// Close fails queued tiles with ErrClosed, waits for running ones (bounded)
// and closes the backend.
func (a *Adapter) Close() error {
	if a.closed.Swap(true) {
		return nil
	}
	if !a.lanes.close(closeTimeout) {
		a.log.Warn("l2: close: workers still running after timeout", "timeout", closeTimeout)
	}
	return a.backend.Close()
}

type opFunc func(ctx context.Context, keys []kv.Key, bufs [][]byte, r Reporter)

func (a *Adapter) submit(ctx context.Context, op Op, keys []kv.Key, bufs [][]byte, fn opFunc, onKey func(*Task, int, Result)) *Task {
	t := newTask(op, keys)
	a.m.taskStart(op)
	t.onKey = func(i int, r Result) {
		a.m.key(op, r)
		if onKey != nil {
			onKey(t, i, r)
		}
	}
	t.onDone = func(t *Task) { a.m.taskDone(op, time.Since(t.start)) }
	if len(keys) == 0 {
		t.finish()
		return t
	}
	if bufs != nil && len(bufs) != len(keys) {
		t.failUnset(0, len(keys), fmt.Errorf("%s: %d keys, %d buffers: %w", op, len(keys), len(bufs), ErrBadBatch))
		return t
	}
	if a.closed.Load() {
		t.failUnset(0, len(keys), ErrClosed)
		return t
	}
	if ctx == nil {
		ctx = context.Background()
	}
	if _, has := ctx.Deadline(); !has {
		ctx, t.cancel = context.WithTimeout(ctx, a.opTimeout)
	} else {
		ctx, t.cancel = context.WithCancel(ctx)
	}
	n := len(keys)
	tiles := min(a.lanes.cfg.Workers(op), n)
	if tl, ok := a.backend.(Tiler); ok {
		tiles = tl.Tiles(op, n, a.lanes.cfg.Workers(op))
	}
	tiles = max(1, min(tiles, n))
	for ti := range tiles {
		lo, hi := ti*n/tiles, (ti+1)*n/tiles
		var tb [][]byte
		if bufs != nil {
			tb = bufs[lo:hi]
		}
		rep := Reporter{t: t, off: lo}
		j := job{ctx: ctx, op: op,
			run: func(ctx context.Context) {
				defer func() {
					if p := recover(); p != nil {
						a.log.Error("l2: backend panic", "op", op, "panic", p)
						rep.FailAll(hi-lo, fmt.Errorf("%s: backend panic: %v", op, p))
					}
				}()
				fn(ctx, keys[lo:hi], tb, rep)
				rep.FailAll(hi-lo, ErrNotReported)
			},
			fail: func(err error) { rep.FailAll(hi-lo, err) },
		}
		if !a.lanes.submit(j) {
			rep.FailAll(hi-lo, ErrClosed)
		}
	}
	return t
}

// remapReporter reports result i of a compacted key list as key idx[i] of r.
func remapReporter(r Reporter, idx []int) Reporter {
	return Reporter{t: r.t, off: r.off, remap: idx}
}
