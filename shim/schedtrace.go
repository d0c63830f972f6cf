package shim

import (
	"encoding/hex"
	"sync/atomic"

	"github.com/kvshim/kvshim/trace"
)

// schedTrace is the scheduler's trace writer (nil: off).
type schedTrace struct{ w atomic.Pointer[trace.Writer] }

// SetTrace makes s write one record per lookup it submits (kind lookup,
// event request: the request id with the lookup's owner and id), which is
// what joins the server's records of a lookup (they carry no request id:
// LOOKUP does not send one) to its request in `kvshim trace`, also for a
// lookup that is never loaded. nil turns it off; the caller closes w.
func (s *Scheduler) SetTrace(w *trace.Writer) { s.trace.w.Store(w) }

func (s *Scheduler) traceSubmitted(r *schedReq, lookupID uint64, ns [16]byte) {
	w := s.trace.w.Load()
	if w == nil {
		return
	}
	w.Emit(trace.Record{Kind: trace.KindLookup, Event: "request", RequestID: r.id, LookupID: lookupID,
		Owner: hex.EncodeToString(s.cfg.Instance[:]), Namespace: hex.EncodeToString(ns[:]),
		Chunks: uint32(len(r.hashes)), World: uint32(s.cfg.Namespace.KVWorldSize()), Rank: -1, Chunk: -1, StopRank: -1})
}
