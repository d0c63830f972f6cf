package tier

import (
	"context"
	"fmt"
	"log/slog"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/kvshim/kvshim/server/l2"
)

// StorePolicy decides which adapters an object is written to: bit i of
// the result selects adapters[i] (at most 64 adapters).
type StorePolicy interface {
	Targets(o *Object, adapters []*l2.Adapter) uint64
}

type policyAll struct{}

func (policyAll) Targets(_ *Object, a []*l2.Adapter) uint64 {
	if len(a) >= 64 {
		return ^uint64(0)
	}
	return 1<<len(a) - 1
}

type policyNone struct{}

func (policyNone) Targets(*Object, []*l2.Adapter) uint64 { return 0 }

// Store policy names (--l2-store-policy).
const (
	PolicyAll  = "all"  // every object to every adapter (LMCache "default")
	PolicyNone = "none" // write nothing (L1 only; adapters serve reads)
)

// ParseStorePolicy returns the named policy; "" and "default" mean "all".
func ParseStorePolicy(name string) (StorePolicy, error) {
	switch name {
	case "", "default", PolicyAll:
		return policyAll{}, nil
	case PolicyNone:
		return policyNone{}, nil
	}
	return nil, fmt.Errorf("tier: store policy %q: want %q or %q", name, PolicyAll, PolicyNone)
}

// IsNone reports whether p never writes anything (the core then need not
// pin objects at all).
func IsNone(p StorePolicy) bool { _, ok := p.(policyNone); return ok }

// WriterConfig configures a Writer.
type WriterConfig struct {
	Policy StorePolicy // nil: all
	// MaxBytes bounds the bytes pinned for L2 writes (submitted, not yet
	// finished); an object over it is not written (counted as "busy").
	MaxBytes uint64
	Hints    *SizeHints
	// CloseTimeout bounds Close's wait for running writes (default 10 s).
	CloseTimeout time.Duration
	// OnStored, when set, is called (from the write's goroutine, no lock
	// held) for every object an adapter has written (KV events' "STORAGE").
	OnStored func(kv.Key)
}

// Writer writes committed L1 objects to the L2 adapters.
type Writer struct {
	l1       L1
	adapters []*l2.Adapter
	cfg      WriterConfig
	log      *slog.Logger
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup

	metrics *metric.Set

	mu       sync.Mutex
	closed   bool
	inflight uint64 // pinned bytes

	pendingObjs, inflightBytes    atomic.Int64
	skippedPolicy, skippedBusy    atomic.Int64
	skippedClosed, skippedCorrupt atomic.Int64
	checksummed, checksummedBytes atomic.Int64   // payload CRCs this controller set
	saved, savedBytes, errs       []atomic.Int64 // per adapter
	errLog                        []warnLimiter  // per adapter: a full or dead L2 is not a line per key
}

// NewWriter returns a writer to adapters; reg may be nil.
func NewWriter(l1 L1, adapters []*l2.Adapter, cfg WriterConfig, reg prometheus.Registerer, log *slog.Logger) (*Writer, error) {
	if len(adapters) > 64 {
		return nil, fmt.Errorf("tier: %d adapters, at most 64", len(adapters))
	}
	if cfg.Policy == nil {
		cfg.Policy = policyAll{}
	}
	if cfg.CloseTimeout <= 0 {
		cfg.CloseTimeout = 10 * time.Second
	}
	if log == nil {
		log = slog.Default()
	}
	wr := &Writer{l1: l1, adapters: adapters, cfg: cfg, log: log,
		saved: make([]atomic.Int64, len(adapters)), savedBytes: make([]atomic.Int64, len(adapters)),
		errs: make([]atomic.Int64, len(adapters)), errLog: make([]warnLimiter, len(adapters))}
	wr.ctx, wr.cancel = context.WithCancel(context.Background())
	c := &metric.Set{}
	c.Add("kvshim_l2_store_pending_objects", "Objects pinned in L1 for L2 writes not yet finished (store queue depth).", true, &wr.pendingObjs)
	c.Add("kvshim_l2_store_inflight_bytes", "L1 bytes pinned for L2 writes not yet finished.", true, &wr.inflightBytes)
	c.Add("kvshim_l2_store_skipped_total", "Committed objects not written to L2, by reason.", false, &wr.skippedPolicy, "reason", "policy")
	c.Add("kvshim_l2_store_skipped_total", "Committed objects not written to L2, by reason.", false, &wr.skippedBusy, "reason", "busy")
	c.Add("kvshim_l2_store_skipped_total", "Committed objects not written to L2, by reason.", false, &wr.skippedClosed, "reason", "closed")
	c.Add("kvshim_l2_store_skipped_total", "Committed objects not written to L2, by reason.", false, &wr.skippedCorrupt, "reason", "corrupt")
	c.Add("kvshim_l2_store_checksummed_objects_total", "Committed objects whose payload CRC the L2 store computed and set in L1 before writing them (objects sealed without one: the default kvshim.verify=l2).", false, &wr.checksummed)
	c.Add("kvshim_l2_store_checksummed_bytes_total", "Payload bytes the L2 store read to compute payload CRCs.", false, &wr.checksummedBytes)
	for i, a := range adapters {
		c.Add("kvshim_l2_store_saved_objects_total", "Objects saved to L2 (the third done: L2 saved).", false, &wr.saved[i], "adapter", a.Name())
		c.Add("kvshim_l2_store_saved_bytes_total", "Bytes saved to L2.", false, &wr.savedBytes[i], "adapter", a.Name())
		c.Add("kvshim_l2_store_errors_total", "Objects whose L2 write failed (best effort, not retried).", false, &wr.errs[i], "adapter", a.Name())
	}
	wr.metrics = c
	if err := c.Register(reg); err != nil {
		return nil, fmt.Errorf("tier: store metrics: %w", err)
	}
	return wr, nil
}

// Samples are the controller's metrics now, as its Prometheus collector
// exports them (STATS carries them too).
func (wr *Writer) Samples() []metric.Sample { return wr.metrics.Samples() }

// WriterStats are the controller's counters (tests, traces).
type WriterStats struct {
	Pending, InflightBytes                    int64
	SkippedPolicy, SkippedBusy, SkippedClosed int64
	// SkippedCorrupt: objects whose header does not verify under their key
	// (never written to L2). Checksummed: objects whose payload CRC the
	// controller set.
	SkippedCorrupt, Checksummed int64
	Saved, SavedBytes, Errors   []int64 // per adapter
}

// Stats returns the counters now.
func (wr *Writer) Stats() WriterStats {
	s := WriterStats{Pending: wr.pendingObjs.Load(), InflightBytes: wr.inflightBytes.Load(),
		SkippedPolicy: wr.skippedPolicy.Load(), SkippedBusy: wr.skippedBusy.Load(), SkippedClosed: wr.skippedClosed.Load(),
		SkippedCorrupt: wr.skippedCorrupt.Load(), Checksummed: wr.checksummed.Load()}
	for i := range wr.adapters {
		s.Saved = append(s.Saved, wr.saved[i].Load())
		s.SavedBytes = append(s.SavedBytes, wr.savedBytes[i].Load())
		s.Errors = append(s.Errors, wr.errs[i].Load())
	}
	return s
}

// batchObj is one object of a submitted batch.
type batchObj struct {
	o    Object
	refs atomic.Int32 // adapters still writing it
	prep sync.Once    // prepare, once for all adapters
	bad  error        // prepare's verdict: not written anywhere
}

// Committed takes over pinned objects just published in L1: each is
// written to the adapters its policy selects and unpinned when the last
// write ends; objects not written are unpinned at once. It never blocks
// (adapter submission is asynchronous) and must be called without the
// core's lock.
func (wr *Writer) Committed(objs []Object) {
	var drop []Object
	per := make([][]*batchObj, len(wr.adapters))
	wr.mu.Lock()
	for i := range objs {
		o := &objs[i]
		if wr.closed {
			drop = append(drop, *o)
			wr.skippedClosed.Add(1)
			continue
		}
		mask := wr.cfg.Policy.Targets(o, wr.adapters)
		if len(wr.adapters) < 64 {
			mask &= 1<<len(wr.adapters) - 1
		}
		if mask == 0 {
			drop = append(drop, *o)
			wr.skippedPolicy.Add(1)
			continue
		}
		size := uint64(len(o.Mem))
		if wr.inflight+size > wr.cfg.MaxBytes {
			drop = append(drop, *o)
			wr.skippedBusy.Add(1)
			continue
		}
		wr.inflight += size
		wr.cfg.Hints.Learn(o.Key.Namespace, o.Key.Rank, size)
		b := &batchObj{o: *o}
		b.refs.Store(int32(bits.OnesCount64(mask)))
		for a := range wr.adapters {
			if mask&(1<<a) != 0 {
				per[a] = append(per[a], b)
			}
		}
		wr.pendingObjs.Add(1)
		wr.inflightBytes.Add(int64(size))
	}
	if !wr.closed {
		for a, bs := range per {
			if len(bs) > 0 {
				wr.wg.Add(1)
				go wr.write(a, bs)
			}
		}
	}
	wr.mu.Unlock()
	if len(drop) > 0 {
		wr.l1.Unpin(drop)
	}
}

// write runs one adapter's batch and unpins objects as their last write
// ends. Each object is prepared (payload CRC) before any adapter reads it.
func (wr *Writer) write(a int, bs []*batchObj) {
	defer wr.wg.Done()
	keys := make([]kv.Key, 0, len(bs))
	bufs := make([][]byte, 0, len(bs))
	kept := bs[:0:0]
	for _, b := range bs {
		if wr.prepare(b) != nil {
			wr.unref(b)
			continue
		}
		keys, bufs, kept = append(keys, b.o.Key), append(bufs, b.o.Mem), append(kept, b)
	}
	if len(kept) == 0 {
		return
	}
	t := wr.adapters[a].Store(wr.ctx, keys, bufs)
	for ev := range t.Events() {
		b := kept[ev.Index]
		wr.traceSaved(a, b.o.Key, len(b.o.Mem), ev.Err)
		if ev.OK() {
			wr.saved[a].Add(1)
			wr.savedBytes[a].Add(int64(len(b.o.Mem)))
			if wr.cfg.OnStored != nil {
				wr.cfg.OnStored(b.o.Key)
			}
		} else {
			wr.errs[a].Add(1)
			if n, ok := wr.errLog[a].allow(time.Now()); ok {
				wr.log.Warn("tier: L2 write failed (not retried)", "adapter", wr.adapters[a].Name(), "key", ev.Key, "err", ev.Err,
					"suppressed_since_last", n)
			}
		}
		wr.unref(b)
	}
}

// unref ends one adapter's part in b; the last one unpins it.
func (wr *Writer) unref(b *batchObj) {
	if b.refs.Add(-1) == 0 {
		wr.finish(b)
	}
}

// prepare makes b's L1 object fit for L2, once (the first adapter's write
// does it, the others wait for it): its header must verify under its key
// (objfmt.VerifyHeader: bytes a worker sealed under another key, or not
// at all, are never written), and its payload CRC slot is set
// (objfmt.SetPayloadCRC): a worker under the default kvshim.verify seals
// headers only, so this pass, off every request's path, is where the
// checksum every L2 copy carries is computed. It writes the slot in L1 with
// one atomic store while readers may load the object; the payload is
// unchanged while the object is pinned. A slot already set (a worker under
// kvshim.verify=always, or an object filled from L2) is kept.
func (wr *Writer) prepare(b *batchObj) error {
	b.prep.Do(func() {
		k := b.o.Key
		_, set, err := objfmt.SetPayloadCRC(b.o.Mem, kv.Key{Namespace: k.Namespace, Rank: k.Rank, Hash: k.Hash})
		switch {
		case err != nil:
			b.bad = err
			wr.skippedCorrupt.Add(1)
			wr.log.Error("tier: committed L1 object does not verify; not written to L2", "key", k, "err", err)
		case set:
			wr.checksummed.Add(1)
			wr.checksummedBytes.Add(int64(len(b.o.Mem) - objfmt.HeaderSize))
		}
	})
	return b.bad
}

func (wr *Writer) finish(b *batchObj) {
	size := uint64(len(b.o.Mem))
	wr.l1.Unpin([]Object{b.o})
	wr.mu.Lock()
	wr.inflight -= size
	wr.mu.Unlock()
	wr.pendingObjs.Add(-1)
	wr.inflightBytes.Add(-int64(size))
}

// Flush waits until no write is pending (tests, shutdown) or ctx ends.
func (wr *Writer) Flush(ctx context.Context) error {
	for wr.pendingObjs.Load() > 0 {
		select {
		case <-ctx.Done():
			return fmt.Errorf("tier: flush: %d objects pending: %w", wr.pendingObjs.Load(), ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

// Close stops taking objects, waits (bounded) for running writes, then
// cancels what is left. Objects are unpinned as their writes end.
func (wr *Writer) Close() {
	wr.mu.Lock()
	if wr.closed {
		wr.mu.Unlock()
		return
	}
	wr.closed = true
	wr.mu.Unlock()
	done := make(chan struct{})
	go func() { wr.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(wr.cfg.CloseTimeout):
		wr.cancel()
		select {
		case <-done:
		case <-time.After(wr.cfg.CloseTimeout):
			wr.log.Warn("tier: store controller: writes still running after close timeout")
		}
	}
	wr.cancel()
}

// warnEvery rate-limits per-adapter warnings.
const warnEvery = 10 * time.Second

// warnLimiter lets the first event through, then at most one per
// warnEvery, counting the ones it held back.
type warnLimiter struct {
	mu         sync.Mutex
	last       time.Time
	suppressed int
}

// allow reports whether to log now and how many were held back since.
func (w *warnLimiter) allow(now time.Time) (suppressed int, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.last.IsZero() && now.Sub(w.last) < warnEvery {
		w.suppressed++
		return 0, false
	}
	n := w.suppressed
	w.last, w.suppressed = now, 0
	return n, true
}
