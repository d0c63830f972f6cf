package tier

import (
	"context"
	"sync"

	"github.com/kvshim/kvshim/kv"
)

// L1 is what the controllers need from L1 (the server's Core).
type L1 interface {
	// Unpin drops the controller-owned holds of objs (taken at commit).
	Unpin(objs []Object)
	// PrefetchBytes is the L1 slot bytes (4 KiB rounded) now used by
	// prefetch staging and temporary (prefetched) objects.
	PrefetchBytes() uint64
}

// Object is an L1 object pinned for an L2 write: Mem stays valid and
// unchanged until it is unpinned.
type Object struct {
	Key kv.Key
	Mem []byte
	Ref uint64 // the core's handle for Unpin
}

// Filler is the L2 side of the fill seam: it is asked to fill the missing
// suffix of a lookup into L1 while the lookup stays pending.
// PrefetchController is the one that loads from L2 adapters.
//
// Fill is called without L1's lock, once per lookup that misses at least
// one chunk. It must not block: it starts the work and returns true, or
// returns false when it has nothing to do (the lookup is then final at
// once). After returning true it must call f.Done exactly once, from any
// goroutine, when it has finished (loaded, failed or given up). Between
// the two it may Reserve / Commit objects through f. f.Context() ends when
// the lookup is dropped (its session closes, the hold TTL): the filler
// should then abandon the work, still calling Done.
type Filler interface {
	Fill(req FillRequest, f Fill) bool
}

// Fill is the L1 side of the fill seam: one lookup's missing suffix
// (server.FillTask implements it).
type Fill interface {
	// Reserve stages size bytes for (rank, chunk); ok=false: no L1 space.
	Reserve(rank, chunk uint32, size uint64, temporary bool) (mem []byte, ok bool, err error)
	// Commit publishes (ok) or frees (!ok) a reservation.
	Commit(rank, chunk uint32, ok bool) error
	// Answer makes the lookup final now; reservations not yet committed stay
	// until committed (then freed) or Done.
	Answer()
	// Done ends the fill: frees what is still reserved and answers the
	// lookup if Answer was not called. Called exactly once.
	Done()
	// Context ends when the lookup is dropped (nil: never). The filler then
	// stops the fill's L2 lookups and loads (their context ends), its
	// admission wait and its remaining steps, and gives back its budget,
	// holds and staging; a load already writing into staging keeps it
	// until the load reports, as after the deadline.
	Context() context.Context
	// TraceAdmission records the fill's admission decision (traces).
	TraceAdmission(Admission)
}

// SourceRecorder is a Fill that wants to know which adapter served each
// chunk (vLLM's hit sources: a disk or a remote store). The filler calls
// Served for a loaded, checked object before committing it.
type SourceRecorder interface {
	Served(chunk uint32, adapterType string)
}

// FillRequest describes a fill: chunks [Start, Start+len(Hashes)) of a
// lookup over Ranks storage ranks (1 for MLA).
type FillRequest struct {
	Namespace kv.Namespace
	Ranks     uint32
	Start     uint32
	Hashes    []kv.Hash
	// Resident[i*Ranks+r]: cell (rank r, chunk Start+i) was resident in L1
	// when the lookup arrived (nil: none).
	Resident []bool
	// SizeHint is the size of an L1 object of the lookup (0: unknown).
	SizeHint uint64
}

// Key is the L2 key of (namespace, rank, hash).
func Key(ns kv.Namespace, rank uint32, h kv.Hash) kv.Key {
	return kv.Key{Namespace: ns, Rank: rank, Hash: h}
}

// SizeHints remembers the object size last seen per (namespace, rank), for
// adapters whose lookups do not report sizes (mooncake_store).
type SizeHints struct{ m sync.Map }

type hintKey struct {
	ns   kv.Namespace
	rank uint32
}

// Learn records size for (ns, rank).
func (h *SizeHints) Learn(ns kv.Namespace, rank uint32, size uint64) {
	if h != nil && size > 0 {
		h.m.Store(hintKey{ns, rank}, size)
	}
}

// Get returns the recorded size or 0.
func (h *SizeHints) Get(ns kv.Namespace, rank uint32) uint64 {
	if h == nil {
		return 0
	}
	if v, ok := h.m.Load(hintKey{ns, rank}); ok {
		return v.(uint64)
	}
	return 0
}

// page rounds n up to the L1 slot granularity (4 KiB).
func page(n uint64) uint64 { return (n + 4095) &^ 4095 }
