package tier

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/kvshim/kvshim/server/l2"
)

var _ Filler = (*PrefetchController)(nil)

// Defaults.
const (
	DefaultPrefetchTimeout = 5 * time.Second
	DefaultAdmissionWait   = time.Second
	// drainTimeout bounds the wait, after the deadline, for loads still
	// writing into staging buffers (their adapter tasks end at the
	// deadline; this is slack for a backend that reacts late).
	drainTimeout = 30 * time.Second
)

// PrefetchConfig configures a PrefetchController.
type PrefetchConfig struct {
	// Budget is the admission budget in bytes (required, > 0).
	Budget uint64
	// Timeout is the deadline of a whole prefetch (L2 lookup, admission,
	// loads) from the lookup's arrival (default DefaultPrefetchTimeout).
	Timeout time.Duration
	// AdmissionWait is how long an over-budget lookup waits for budget
	// (0: DefaultAdmissionWait; < 0: never waits).
	AdmissionWait time.Duration
	// Retain makes loaded objects resident (evictable, shared by later
	// lookups) instead of temporary (freed once this lookup's reader
	// releases them, LMCache's default).
	Retain bool
	Hints  *SizeHints
	// BeforeLoad, when set, runs after planning and reserving, right
	// before the loads are submitted (tests, tracing). keys are the keys
	// about to be loaded.
	BeforeLoad func(keys []kv.Key)
	// Verify is the fill's object check (kvshim.verify): VerifyL2 and
	// VerifyAlways (the zero value is VerifyL2) check header, key, size and
	// a set, matching payload CRC; VerifyOff skips the payload (header, key
	// and size only; unsafe: a corrupt disk or network byte is served).
	Verify objfmt.VerifyPolicy
}

// PrefetchController fills lookups' missing chunks from L2: the L2 side
// of the fill seam.
type PrefetchController struct {
	adapters []*l2.Adapter
	cfg      PrefetchConfig
	ad       *admission
	log      *slog.Logger
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	metrics  *metric.Set

	mu     sync.Mutex
	closed bool

	inflight, waitingG, acceptedG, budgetG atomic.Int64
	noL2, loaded, rejected, timeouts       atomic.Int64
	cancelled                              atomic.Int64
	l1Full                                 atomic.Int64
	waited                                 atomic.Int64
	chunksOK, chunksMiss, chunksFailed     []atomic.Int64 // per adapter
	chunksRejected, keyMismatches          []atomic.Int64 // per adapter: objects that failed the check
	badDeleted, badDeleteFailed            []atomic.Int64 // per adapter: deletes of rejected objects
	bytesLoaded                            []atomic.Int64
}

// NewPrefetchController returns a controller; reg may be nil.
func NewPrefetchController(l1 L1, adapters []*l2.Adapter, cfg PrefetchConfig, reg prometheus.Registerer, log *slog.Logger) (*PrefetchController, error) {
	if cfg.Budget == 0 {
		return nil, fmt.Errorf("tier: prefetch budget must be > 0")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultPrefetchTimeout
	}
	if cfg.AdmissionWait == 0 {
		cfg.AdmissionWait = DefaultAdmissionWait
	}
	if log == nil {
		log = slog.Default()
	}
	n := len(adapters)
	pc := &PrefetchController{adapters: adapters, cfg: cfg, log: log,
		chunksOK: make([]atomic.Int64, n), chunksMiss: make([]atomic.Int64, n),
		chunksFailed: make([]atomic.Int64, n), bytesLoaded: make([]atomic.Int64, n),
		chunksRejected: make([]atomic.Int64, n), keyMismatches: make([]atomic.Int64, n),
		badDeleted: make([]atomic.Int64, n), badDeleteFailed: make([]atomic.Int64, n)}
	pc.ad = &admission{l1: l1, budget: cfg.Budget, acceptedG: &pc.acceptedG, waitingG: &pc.waitingG}
	pc.ctx, pc.cancel = context.WithCancel(context.Background())
	pc.budgetG.Store(int64(cfg.Budget))
	c := &metric.Set{}
	const lk = "kvshim_l2_prefetch_lookups_total"
	const lkHelp = "Lookups that asked L2, by outcome: loaded (admitted and loading), no_l2 (nothing to load), rejected (over the byte budget: answered from L1), l1_full (admitted, but no L1 staging for the first chunk), timeout (past the deadline; also counted in another outcome), cancelled (the lookup was dropped — session closed, hold TTL — and its fill abandoned; also counted as loaded when it was loading)."
	c.Add(lk, lkHelp, false, &pc.loaded, "outcome", "loaded")
	c.Add(lk, lkHelp, false, &pc.noL2, "outcome", "no_l2")
	c.Add(lk, lkHelp, false, &pc.rejected, "outcome", "rejected")
	c.Add(lk, lkHelp, false, &pc.l1Full, "outcome", "l1_full")
	c.Add(lk, lkHelp, false, &pc.timeouts, "outcome", "timeout")
	c.Add(lk, lkHelp, false, &pc.cancelled, "outcome", "cancelled")
	c.Add("kvshim_l2_prefetch_waited_total", "Lookups that waited for admission budget.", false, &pc.waited)
	c.Add("kvshim_l2_prefetch_inflight_lookups", "Lookups being prefetched.", true, &pc.inflight)
	c.Add("kvshim_l2_prefetch_admission_queue", "Lookups waiting for admission budget (queue depth).", true, &pc.waitingG)
	c.Add("kvshim_l2_prefetch_accepted_bytes", "Bytes of admitted lookups not yet reserved in L1.", true, &pc.acceptedG)
	c.Add("kvshim_l2_prefetch_budget_bytes", "Admission budget: L1 prefetch bytes + accepted bytes stay below it.", true, &pc.budgetG)
	for i, a := range adapters {
		const ch = "kvshim_l2_prefetch_chunks_total"
		const chHelp = "Objects loaded from L2 into L1, by adapter and result: ok, miss, failed (the adapter's error), rejected (read, but the object header is corrupt, names another key or the payload checksum differs: never served, deleted from L2)."
		c.Add(ch, chHelp, false, &pc.chunksOK[i], "adapter", a.Name(), "result", "ok")
		c.Add(ch, chHelp, false, &pc.chunksMiss[i], "adapter", a.Name(), "result", "miss")
		c.Add(ch, chHelp, false, &pc.chunksFailed[i], "adapter", a.Name(), "result", "failed")
		c.Add(ch, chHelp, false, &pc.chunksRejected[i], "adapter", a.Name(), "result", "rejected")
		c.Add("kvshim_l2_prefetch_key_mismatches_total", "Objects read from L2 whose header names another key (namespace, rank or chunk hash) than the one loaded: bytes stored under the wrong name (also counted as rejected).", false, &pc.keyMismatches[i], "adapter", a.Name())
		const del = "kvshim_l2_prefetch_rejected_deletes_total"
		const delHelp = "Deletes of rejected L2 objects, by result (failed: e.g. held by another lookup; a later fill retries)."
		c.Add(del, delHelp, false, &pc.badDeleted[i], "adapter", a.Name(), "result", "ok")
		c.Add(del, delHelp, false, &pc.badDeleteFailed[i], "adapter", a.Name(), "result", "failed")
		c.Add("kvshim_l2_prefetch_bytes_total", "Bytes loaded from L2 into L1 (objects that passed the check).", false, &pc.bytesLoaded[i], "adapter", a.Name())
	}
	pc.metrics = c
	if err := c.Register(reg); err != nil {
		return nil, fmt.Errorf("tier: prefetch metrics: %w", err)
	}
	return pc, nil
}

// Samples are the controller's metrics now, as its Prometheus collector
// exports them (STATS carries them too).
func (pc *PrefetchController) Samples() []metric.Sample { return pc.metrics.Samples() }

// PrefetchStats are the controller's counters.
type PrefetchStats struct {
	// Lookups by outcome (Cancelled: fills abandoned because their lookup
	// was dropped), and those running now (Inflight).
	Inflight, Loaded, NoL2, Rejected, L1Full, Timeouts, Waited, Cancelled int64
	ChunksOK, ChunksMiss, ChunksFailed                                    []int64
	// Per adapter: objects read but rejected by the object check (corrupt,
	// or another key's: KeyMismatches), and the deletes of those objects.
	ChunksRejected, KeyMismatches, RejectedDeleted, RejectedDeleteFailed []int64
}

// Stats returns the counters now.
func (pc *PrefetchController) Stats() PrefetchStats {
	s := PrefetchStats{Inflight: pc.inflight.Load(), Loaded: pc.loaded.Load(), NoL2: pc.noL2.Load(),
		Rejected: pc.rejected.Load(), L1Full: pc.l1Full.Load(), Timeouts: pc.timeouts.Load(), Waited: pc.waited.Load(),
		Cancelled: pc.cancelled.Load()}
	for i := range pc.adapters {
		s.ChunksOK = append(s.ChunksOK, pc.chunksOK[i].Load())
		s.ChunksMiss = append(s.ChunksMiss, pc.chunksMiss[i].Load())
		s.ChunksFailed = append(s.ChunksFailed, pc.chunksFailed[i].Load())
		s.ChunksRejected = append(s.ChunksRejected, pc.chunksRejected[i].Load())
		s.KeyMismatches = append(s.KeyMismatches, pc.keyMismatches[i].Load())
		s.RejectedDeleted = append(s.RejectedDeleted, pc.badDeleted[i].Load())
		s.RejectedDeleteFailed = append(s.RejectedDeleteFailed, pc.badDeleteFailed[i].Load())
	}
	return s
}

// Fill starts filling req from L2 in the background and returns true, or
// returns false (nothing to do: no adapter, or closed). It never blocks.
// After true, f.Done is called exactly once (Filler).
func (pc *PrefetchController) Fill(req FillRequest, f Fill) bool {
	if len(pc.adapters) == 0 || len(req.Hashes) == 0 {
		return false
	}
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return false
	}
	pc.wg.Add(1) // under mu, so never concurrent with Close's Wait
	pc.mu.Unlock()
	pc.inflight.Add(1)
	go func() {
		defer pc.wg.Done()
		defer pc.inflight.Add(-1)
		pc.run(req, f)
	}()
	return true
}

// Close cancels running prefetches (they answer with what they have) and
// waits for them (bounded).
func (pc *PrefetchController) Close() {
	pc.mu.Lock()
	was := pc.closed
	pc.closed = true
	pc.mu.Unlock()
	if was {
		return
	}
	pc.cancel()
	done := make(chan struct{})
	go func() { pc.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(drainTimeout):
		pc.log.Warn("tier: prefetch controller: fills still running after close timeout")
	}
}

// checkObject verifies an object loaded from L2 for key: header (magic,
// format version, header checksum), the key it names, its size and, unless
// the policy is VerifyOff, its payload CRC, which must be set (the L2
// writer sets it before writing) and match. The server does not know the KV
// layout; the layout fingerprint and chunk tokens are the worker's to
// check.
func checkObject(obj []byte, key kv.Key, policy objfmt.VerifyPolicy) error {
	check := objfmt.Verify
	if policy == objfmt.VerifyOff {
		check = objfmt.VerifyHeader
	}
	_, err := check(obj, kv.Key{Namespace: key.Namespace, Rank: key.Rank, Hash: key.Hash})
	return err
}

// reject counts and logs an L2 object that failed checkObject.
func (pc *PrefetchController) reject(a int, key kv.Key, err error) {
	pc.chunksRejected[a].Add(1)
	what := "corrupt"
	if errors.Is(err, objfmt.ErrKeyMismatch) {
		pc.keyMismatches[a].Add(1)
		what = "key mismatch"
	}
	pc.log.Warn("tier: L2 object rejected ("+what+"): not served, deleting it", "adapter", pc.adapters[a].Name(), "key", key, "err", err)
}

// deleteRejected deletes the objects checkObject rejected, so a later
// store can write the right bytes under their keys (stores skip keys that
// exist). A delete that fails (another lookup holds the key, a backend
// error) is counted and logged; the next fill that reads it retries.
func (pc *PrefetchController) deleteRejected(bad [][]kv.Key) {
	for a, keys := range bad {
		if len(keys) == 0 {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), pc.cfg.Timeout)
		t := pc.adapters[a].Delete(ctx, keys)
		select {
		case <-t.Done():
		case <-ctx.Done():
		}
		cancel()
		select {
		case <-t.Done():
		default:
			pc.badDeleteFailed[a].Add(int64(len(keys)))
			pc.log.Warn("tier: delete of rejected L2 objects timed out", "adapter", pc.adapters[a].Name(), "keys", len(keys))
			continue
		}
		for i, r := range t.Results() {
			switch r.Status {
			case l2.StatusOK, l2.StatusMiss: // deleted, or gone already
				pc.badDeleted[a].Add(1)
			default:
				pc.badDeleteFailed[a].Add(1)
				pc.log.Warn("tier: delete of a rejected L2 object failed; a later fill retries", "adapter", pc.adapters[a].Name(), "key", keys[i], "err", r.Err)
			}
		}
	}
}

// release drops the holds toRelease names (keys[k] is cells[k]'s key).
func (pc *PrefetchController) release(results [][]l2.Result, keys []kv.Key, cells []cell, from int, others bool) {
	for a, idx := range toRelease(results, cells, from, others) {
		if len(idx) == 0 {
			continue
		}
		rel := make([]kv.Key, len(idx))
		for i, k := range idx {
			rel[i] = keys[k]
		}
		pc.adapters[a].Release(rel)
	}
}

func okKeys(t *l2.Task) []kv.Key {
	var keys []kv.Key
	for i, r := range t.Results() {
		if r.OK() {
			keys = append(keys, t.Keys()[i])
		}
	}
	return keys
}

func deadline(ctx context.Context) time.Time {
	d, _ := ctx.Deadline()
	return d
}
