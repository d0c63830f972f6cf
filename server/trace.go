package server

import (
	"encoding/hex"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l1"
	"github.com/kvshim/kvshim/server/tier"
	"github.com/kvshim/kvshim/trace"
)

// The server's lifecycle records (package trace; doc.go there lists the
// columns). Every hook is one call from the code it observes and costs one
// atomic load and a branch when tracing is off.

// traceSink is the Core's trace writer (nil: off).
type traceSink struct{ w atomic.Pointer[trace.Writer] }

// SetTrace makes the core write lifecycle records to w (nil: stop). The
// caller closes w after the core.
func (core *Core) SetTrace(w *trace.Writer) { core.trace.w.Store(w) }

func (core *Core) tracer() *trace.Writer { return core.trace.w.Load() }

func hexTag(t kv.Tag) string      { return hex.EncodeToString(t[:]) }
func hexNS(n kv.Namespace) string { return hex.EncodeToString(n[:]) }
func lookupRecord(k trace.Kind, ev string, lk *lookup) trace.Record {
	return trace.Record{Kind: k, Event: ev, LookupID: lk.id, Owner: hexTag(lk.owner.id), Namespace: hexNS(lk.ns),
		Rank: -1, Chunk: -1, StopRank: -1, World: lk.world, Chunks: uint32(len(lk.hashes))}
}

// traceRegistered: the ack of a LOOKUP, with the per-chunk fold across
// ranks (mu held), then "final" or "pending".
func (core *Core) traceRegistered(lk *lookup, p uint32) {
	w := core.tracer()
	if w == nil {
		return
	}
	sh, _ := core.l1.Shard(lk.ns, false)
	n := len(lk.hashes)
	found := make([]uint32, lk.ranks())
	inL1 := make([]bool, n)
	stop, stopRank := int32(-1), int32(-1)
	for c := range n {
		core.l1.FindRanks(sh, &lk.hashes[c], found)
		inL1[c] = true
		for r, i := range found {
			if i == l1.Nil {
				inL1[c] = false
				if stop < 0 {
					stop, stopRank = int32(c), int32(r)
				}
				break
			}
		}
	}
	r := lookupRecord(trace.KindLookup, "registered", lk)
	r.L1 = trace.Bitmap(n, func(i int) bool { return inL1[i] })
	r.Missing = trace.Bitmap(n, func(i int) bool { return !inL1[i] })
	r.Matched, r.Chunk, r.StopRank = p, stop, stopRank
	w.Emit(r)
	if lk.state == lkPending {
		r := lookupRecord(trace.KindLookup, "pending", lk)
		r.Matched = p
		r.Reason = fmt.Sprintf("L2 fill of chunks [%d, %d)", p, n)
		w.Emit(r)
		return
	}
	core.traceFinal(lk)
}

// traceFinal: a lookup's answer and why it stopped (mu held).
func (core *Core) traceFinal(lk *lookup) {
	w := core.tracer()
	if w == nil {
		return
	}
	if t := lk.fill; t != nil {
		// The L2 fill's outcome: chunks [Start, Start+chunks) were asked of
		// L2; matched of them now count (filled, or found resident).
		f := lookupRecord(trace.KindFill, "done", lk)
		f.Start, f.Chunks = t.Start, uint32(len(t.Hashes))
		f.Matched = lk.chunks - min(lk.chunks, t.Start)
		f.Failed = f.Chunks - f.Matched
		f.Result = "done"
		if t.cancelled {
			f.Result = "cancelled"
		} else if !t.done {
			f.Result, f.Reason = "answered_early", "the lookup was answered before the fill ended (prefetch timeout)"
		}
		w.Emit(f)
	}
	h := lookupRecord(trace.KindHold, "taken", lk)
	h.Matched = uint32(min(lk.holds, 1<<32-1))
	w.Emit(h)
	r := lookupRecord(trace.KindLookup, "final", lk)
	r.Matched = lk.chunks
	n := uint32(len(lk.hashes))
	if lk.chunks >= n {
		r.Result = "full"
	} else {
		r.Result, r.Chunk = "missing", int32(lk.chunks)
		sh, _ := core.l1.Shard(lk.ns, false)
		found := make([]uint32, lk.ranks())
		core.l1.FindRanks(sh, &lk.hashes[lk.chunks], found)
		for rk, i := range found {
			if i == l1.Nil {
				r.StopRank = int32(rk)
				break
			}
		}
		r.Reason = fmt.Sprintf("chunk %d absent on rank %d", lk.chunks, r.StopRank)
	}
	w.Emit(r)
}

// traceConsumed: the scheduler read the answer (mu held).
func (core *Core) traceConsumed(lk *lookup) {
	if w := core.tracer(); w != nil {
		r := lookupRecord(trace.KindLookup, "consumed", lk)
		r.Matched = lk.chunks
		w.Emit(r)
	}
}

var lookupStates = [...]string{lkPending: "pending", lkFinal: "final", lkConsumed: "consumed"}

// traceFree: FREE of chunks [start, end): the holds it is about to release
// were never loaded (mu held; called before the release).
func (core *Core) traceFree(lk *lookup, start, end uint32) {
	w := core.tracer()
	if w == nil {
		return
	}
	r := lookupRecord(trace.KindCancel, "free", lk)
	r.Start, r.End = start, end
	for _, row := range lk.held {
		for c := start; c < min(end, uint32(len(row))); c++ {
			if row[c] != l1.Nil {
				r.Matched++
			}
		}
	}
	r.Result = lookupStates[lk.state]
	w.Emit(r)
}

// traceDrop: a lookup forgotten with holds or a fill outstanding (session
// end, hold TTL, close); a lookup that ends normally (answer read, nothing
// held) has no drop record (mu held; called before the release).
func (core *Core) traceDrop(lk *lookup) {
	w := core.tracer()
	if w == nil || (lk.holds == 0 && lk.state != lkPending) {
		return
	}
	r := lookupRecord(trace.KindCancel, "drop", lk)
	r.Matched = uint32(min(lk.holds, 1<<32-1))
	r.Result = lookupStates[lk.state]
	r.Reason = "lookup forgotten while holding (session ended, hold TTL or store closed)"
	w.Emit(r)
}

// traceCommit: the objects a COMMIT published (L1 readable).
func (core *Core) traceCommit(s *Session, req *ipc.CommitReq, resp *ipc.CommitResp, err error) {
	w := core.tracer()
	if w == nil {
		return
	}
	r := trace.Record{Kind: trace.KindSave, Event: "committed", Owner: hexTag(s.id), Namespace: hexNS(req.Namespace),
		Rank: int32(req.Rank), Chunks: uint32(len(req.Hashes)), Result: "ok"}
	if err != nil {
		r.Result, r.Reason, r.Failed = "error", err.Error(), r.Chunks
	} else {
		for _, s := range resp.Status {
			if s == ipc.StatusOK {
				r.Matched++
			} else {
				r.Failed++
			}
		}
		if r.Failed > 0 {
			r.Result, r.Reason = "partial", "keys not staged by this session (aborted, fenced or reaped)"
		}
	}
	w.Emit(r)
}

// traceEvict: an object evicted from L1 (l1.Config.OnEvict; mu held).
func (core *Core) traceEvict(ns kv.Namespace, rank uint32, size uint64) {
	w := core.tracer()
	if w == nil {
		return
	}
	w.Emit(trace.Record{Kind: trace.KindEvict, Event: "evict", Namespace: hexNS(ns), Rank: int32(rank), Chunks: 1, Bytes: size,
		Reason: "lru watermark", Chunk: -1})
}

// TraceL2Saved (tier.L2Tracer): an L2 write ended (the third
// "done" of a save: L2 saved).
func (core *Core) TraceL2Saved(adapter string, key kv.Key, bytes int, err error) {
	w := core.tracer()
	if w == nil {
		return
	}
	r := trace.Record{Kind: trace.KindSave, Event: "l2_saved", Namespace: hex.EncodeToString(key.Namespace[:]), Rank: int32(key.Rank),
		Chunks: 1, Matched: 1, Bytes: uint64(bytes), Result: "ok", Reason: adapter, Chunk: -1, StopRank: -1}
	if err != nil {
		r.Matched, r.Failed, r.Bytes, r.Result, r.Reason = 0, 1, 0, "failed", adapter+": "+err.Error()
	}
	w.Emit(r)
}

// traceRelease: a worker's RELEASE of its rank's holds after its copies
// (mu held; called before the release).
func (core *Core) traceRelease(lk *lookup, rank uint32) {
	w := core.tracer()
	if w == nil {
		return
	}
	r := lookupRecord(trace.KindHold, "released", lk)
	r.Rank = int32(rank)
	for _, i := range lk.held[rank] {
		if i != l1.Nil {
			r.Matched++
		}
	}
	w.Emit(r)
}

// TraceAdmission records the L2 prefetch's admission decision for t's
// lookup (fill records, event admission; see trace/doc.go; tier.Fill).
func (t *FillTask) TraceAdmission(a tier.Admission) {
	core := t.core
	w := core.tracer()
	if w == nil {
		return
	}
	core.mu.Lock()
	rec := trace.Record{Kind: trace.KindFill, Namespace: hexNS(t.Namespace), Rank: -1, Chunk: -1, StopRank: -1}
	if t.lk != nil {
		rec = lookupRecord(trace.KindFill, "", t.lk)
	}
	core.mu.Unlock()
	rec.Event, rec.Start, rec.Chunks, rec.Matched = "admission", t.Start, uint32(a.Cells), uint32(a.Staged)
	rec.Bytes, rec.Result = a.Bytes, a.Result
	if a.Waited > 0 {
		rec.Reason = fmt.Sprintf("waited %v for the prefetch byte budget", a.Waited.Round(time.Microsecond))
	}
	w.Emit(rec)
}
