package tier

import (
	"context"
	"sync"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
)

// cell is one (rank, chunk) of the fill that L1 lacks; its L2 key is the
// same index of the fill's keys. A fill of a long lookup has one per chunk
// and rank until it ends: keep it small.
type cell struct {
	rank, chunk uint32 // chunk: lookup index
	src         int    // adapter index, -1: none
	size        uint64 // object bytes
}

// fillRun is one lookup's fill on its way through the phases of run. Each
// phase returns false when it has ended the fill (Done called).
type fillRun struct {
	pc  *PrefetchController
	req FillRequest
	f   Fill
	// ctx ends at the deadline, on Close, or when the lookup is dropped
	// (gone is then closed, before ctx ends; nil: never dropped).
	ctx  context.Context
	gone <-chan struct{}

	cells   []cell        // every cell L1 lacks, by chunk then rank
	keys    []kv.Key      // keys[i] is cells[i]'s L2 key
	results [][]l2.Result // per adapter: its lookup of keys (nil: no answer)
	plan    []cell        // the cells to load: a prefix of cells
	bytes   uint64        // the plan's slot bytes (admitted)
	waited  time.Duration // spent waiting for admission
	mems    [][]byte      // mems[i]: plan[i]'s L1 staging
}

// run is one lookup's fill: L2 lookup, plan, admission, L1 reservation,
// loads.
func (pc *PrefetchController) run(req FillRequest, f Fill) {
	parent, drop := context.WithCancel(pc.ctx)
	defer drop()
	r := &fillRun{pc: pc, req: req, f: f}
	if fc := f.Context(); fc != nil {
		r.gone = fc.Done()
		stop := context.AfterFunc(fc, drop)
		defer stop()
	}
	ctx, cancel := context.WithTimeout(parent, pc.cfg.Timeout)
	defer cancel()
	r.ctx = ctx
	if r.lookup() && r.planLoads() && r.admit() && r.reserve() {
		r.load()
	}
}

// dropped reports whether the lookup was dropped.
func (r *fillRun) dropped() bool {
	select {
	case <-r.gone:
		return true
	default:
		return false
	}
}

// lookup is phase 1: the L2 lookup (with holds) of every cell L1 lacks, on
// every adapter.
func (r *fillRun) lookup() bool {
	pc, req := r.pc, r.req
	R := req.Ranks
	missing := len(req.Hashes) * int(R)
	for _, res := range req.Resident {
		if res {
			missing--
		}
	}
	r.cells = make([]cell, 0, missing)
	r.keys = make([]kv.Key, 0, missing)
	for i := range req.Hashes {
		for rank := range R {
			if req.Resident != nil && req.Resident[uint32(i)*R+rank] {
				continue
			}
			r.cells = append(r.cells, cell{rank: rank, chunk: req.Start + uint32(i), src: -1})
			r.keys = append(r.keys, Key(req.Namespace, rank, req.Hashes[i]))
		}
	}
	looks := make([]*l2.Task, len(pc.adapters))
	for a, ad := range pc.adapters {
		looks[a] = ad.LookupAndHold(r.ctx, r.keys)
	}
	r.results = make([][]l2.Result, len(pc.adapters))
	for a, t := range looks {
		select {
		case <-t.Done():
			r.results[a] = t.Results()
		case <-time.After(time.Until(deadline(r.ctx)) + time.Second):
			// The task ends by its own deadline; release what it holds then.
			ad := pc.adapters[a]
			go func() { <-t.Done(); ad.Release(okKeys(t)) }()
		}
	}
	// A dropped lookup's L2 lookups end early (their context ended);
	// give back their holds and stop here.
	if r.dropped() {
		pc.cancelled.Add(1)
		pc.release(r.results, r.keys, r.cells, 0, true)
		r.f.Done()
		return false
	}
	return true
}

// planLoads is phase 2: the longest run of chunks whose every missing cell
// is in some adapter (the first adapter holding it), with a known size,
// trimmed to the budget. Every hold outside the plan is released now.
func (r *fillRun) planLoads() bool {
	pc, req := r.pc, r.req
	planned, bytes := planPrefix(r.cells, r.results, pc.cfg.Budget, func(rank uint32) uint64 {
		if req.SizeHint != 0 {
			return req.SizeHint
		}
		return pc.cfg.Hints.Get(req.Namespace, rank)
	})
	for _, cl := range r.cells[:planned] {
		pc.cfg.Hints.Learn(req.Namespace, cl.rank, cl.size)
	}
	pc.release(r.results, r.keys, r.cells, planned, true)
	if planned == 0 {
		pc.noL2.Add(1)
		r.f.TraceAdmission(Admission{Result: "no_l2"})
		r.f.Done()
		return false
	}
	r.plan, r.bytes = r.cells[:planned], bytes
	return true
}

// admit is phase 3: the plan's bytes are admitted against the budget, at
// once or after waiting (at most AdmissionWait, never past the deadline).
func (r *fillRun) admit() bool {
	pc := r.pc
	wait := min(pc.cfg.AdmissionWait, time.Until(deadline(r.ctx)))
	if pc.ad.acquire(r.ctx, r.bytes, 0) {
		return true
	}
	pc.waited.Add(1)
	t0 := time.Now()
	ok := pc.ad.acquire(r.ctx, r.bytes, wait)
	r.waited = time.Since(t0)
	if ok {
		return true
	}
	result := "rejected"
	if r.dropped() {
		pc.cancelled.Add(1)
		result = "cancelled"
	} else {
		pc.rejected.Add(1)
	}
	r.f.TraceAdmission(Admission{Cells: len(r.plan), Bytes: r.bytes, Result: result, Waited: r.waited})
	pc.release(r.results, r.keys, r.plan, 0, false)
	r.f.Done()
	return false
}

// reserve is phase 4: L1 staging for the plan, in chunk order; a chunk
// that finds no space (or is already resident) ends the plan there. A
// dropped lookup's reservations fail.
func (r *fillRun) reserve() bool {
	pc, f, plan := r.pc, r.f, r.plan
	mems := make([][]byte, len(plan))
	n := 0
	for n < len(plan) {
		c := plan[n].chunk
		k := n
		for ; k < len(plan) && plan[k].chunk == c; k++ {
			mem, ok, err := f.Reserve(plan[k].rank, c, plan[k].size, !pc.cfg.Retain)
			if err != nil || !ok {
				break
			}
			mems[k] = mem
		}
		if k < len(plan) && plan[k].chunk == c { // this chunk is incomplete
			for q := n; q < k; q++ {
				_ = f.Commit(plan[q].rank, c, false)
			}
			break
		}
		n = k
	}
	pc.ad.reserved(r.bytes)
	pc.release(r.results, r.keys, plan, n, false) // holds of cells not reserved
	adm := Admission{Cells: len(plan), Bytes: r.bytes, Staged: n, Result: "admitted", Waited: r.waited}
	r.plan, r.mems = plan[:n], mems[:n]
	if n == 0 || r.dropped() {
		// Nothing loads into the staging yet: Done frees it.
		if r.dropped() {
			pc.cancelled.Add(1)
			adm.Result = "cancelled"
		} else {
			pc.l1Full.Add(1)
			adm.Result = "l1_full"
		}
		f.TraceAdmission(adm)
		r.finish(nil)
		return false
	}
	f.TraceAdmission(adm)
	return true
}

// load is phase 5: each adapter loads its cells of the plan, each key is
// checked and committed as it arrives, and the fill ends when the loads
// do or at the deadline.
func (r *fillRun) load() {
	pc := r.pc
	if pc.cfg.BeforeLoad != nil {
		pc.cfg.BeforeLoad(append([]kv.Key(nil), r.keys[:len(r.plan)]...))
	}
	allDone, bad := r.startLoads()
	pc.loaded.Add(1)
	r.await(allDone, bad)
}

// startLoads submits one load per adapter and commits each key as its
// result arrives. allDone is closed when every load has reported; bad[a]
// then holds the keys whose objects adapter a returned but the check
// rejected (each adapter's events goroutine appends to its own slice).
func (r *fillRun) startLoads() (allDone chan struct{}, bad [][]kv.Key) {
	pc, plan, keys, mems := r.pc, r.plan, r.keys, r.mems
	var loads sync.WaitGroup
	bad = make([][]kv.Key, len(pc.adapters))
	for a := range pc.adapters {
		var idx []int
		for i := range plan {
			if plan[i].src == a {
				idx = append(idx, i)
			}
		}
		if len(idx) == 0 {
			continue
		}
		lkeys := make([]kv.Key, len(idx))
		bufs := make([][]byte, len(idx))
		for q, i := range idx {
			lkeys[q], bufs[q] = keys[i], mems[i]
		}
		t := pc.adapters[a].Load(r.ctx, lkeys, bufs)
		loads.Add(1)
		go func() {
			defer loads.Done()
			for ev := range t.Events() {
				i := idx[ev.Index]
				cl, key := &plan[i], keys[i]
				ok := ev.OK()
				switch ev.Status {
				case l2.StatusOK:
					// Bytes from a disk or a network: check the header names
					// the key asked for and the payload checksum before the
					// object can be served.
					if err := checkObject(mems[i], key, pc.cfg.Verify); err != nil {
						ok = false
						pc.reject(a, key, err)
						bad[a] = append(bad[a], key)
						break
					}
					pc.chunksOK[a].Add(1)
					pc.bytesLoaded[a].Add(int64(ev.Bytes))
					if sr, ok := r.f.(SourceRecorder); ok {
						sr.Served(cl.chunk, pc.adapters[a].Type())
					}
				case l2.StatusMiss:
					pc.chunksMiss[a].Add(1)
				default:
					pc.chunksFailed[a].Add(1)
					pc.log.Debug("tier: L2 load failed", "adapter", pc.adapters[a].Name(), "key", ev.Key, "err", ev.Err)
				}
				_ = r.f.Commit(cl.rank, cl.chunk, ok)
			}
		}()
	}
	allDone = make(chan struct{})
	go func() { loads.Wait(); close(allDone) }()
	return allDone, bad
}

// await waits for the loads, or for the deadline (or the lookup's drop):
// then the lookup is answered with what has arrived (a dropped lookup
// takes nothing), and the staging of loads still running is freed only
// when their keys report.
func (r *fillRun) await(allDone <-chan struct{}, bad [][]kv.Key) {
	pc := r.pc
	select {
	case <-allDone:
		switch {
		case r.dropped():
			pc.cancelled.Add(1)
		case !time.Now().Before(deadline(r.ctx)): // the loads ended by the deadline
			// (by the clock: a backend's socket deadline can fire just
			// before the context's timer)
			pc.timeouts.Add(1)
		}
	case <-r.ctx.Done():
		if r.dropped() {
			pc.cancelled.Add(1)
		} else {
			pc.timeouts.Add(1)
		}
		r.f.Answer()
		select {
		case <-allDone:
		case <-time.After(drainTimeout):
			pc.log.Warn("tier: L2 loads still running after the deadline (or the lookup was dropped); their staging stays reserved")
			go func() { <-allDone; r.finish(bad) }()
			return
		}
	}
	r.finish(bad)
}

// finish ends the fill: Done, the plan's L2 holds released, the admission
// queue woken, rejected objects deleted (after the release: an adapter
// refuses to delete held keys).
func (r *fillRun) finish(bad [][]kv.Key) {
	r.f.Done()
	r.pc.release(r.results, r.keys, r.plan, 0, false)
	r.pc.ad.kick()
	r.pc.deleteRejected(bad)
}
