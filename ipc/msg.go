package ipc

import "github.com/kvshim/kvshim/kv"

// This file is the protocol contract between clients (shim/, export/) and the
// server (server/). It declares the operations and their Go shapes; codec.go
// encodes and decodes them (little-endian, fixed headers, explicit lengths,
// bounds-checked). Op codes are stable wire identifiers: never reorder or
// reuse them, only append.

// ProtocolVersion is carried in the hello and checked by both sides.
// Version 2: the hello carries flags (HelloDrained), the ring's closed word
// a reason. Version 3: OpReset; a lookup's answer carries its namespace's
// generation and the tier that served each chunk. Version 4: OpEvents and
// the answers' FlagEventsPending (events.go); a version-3 peer is still
// accepted (it never sends OpEvents, so it never sees the flag). Version 5:
// LookupReq.AnswerFinal, a LOOKUP whose ack carries its answer when it is
// final at registration (older clients never ask for it).
const ProtocolVersion uint32 = 5

// MinProtocolVersion is the oldest version a hello may carry.
const MinProtocolVersion uint32 = 3

// Op identifies a request type on the submission ring. Responses on the
// completion ring carry the same Op.
type Op uint16

const (
	OpAlloc        Op = 1  // reserve staging space for new objects
	OpCommit       Op = 2  // publish staging objects (staging → resident)
	OpAbort        Op = 3  // drop staging objects, free their space
	OpLookup       Op = 4  // register a lookup; answer is an ack
	OpLookupResult Op = 5  // pending | final n | unknown; final is consumed once
	OpFree         Op = 6  // release a lookup's holds in a chunk range without loading
	OpRetrieve     Op = 7  // offsets of the objects a lookup holds for one rank
	OpRelease      Op = 8  // drop one rank's remaining holds of a lookup
	OpStats        Op = 9  // server counters
	OpClear        Op = 10 // drop every resident object that has no holds
	OpPing         Op = 11 // liveness / round-trip probe; the answer echoes the request body
	OpReset        Op = 12 // new generation for namespaces: every chunk stored before misses (controls.go)
	// OpEvents = 13 (events.go): announce chunk keys, take the session's KV events.
)

// Status is the per-response (and per-key) outcome. Zero is success.
type Status int32

const (
	StatusOK         Status = 0
	StatusResident   Status = 1 // ALLOC: already resident, skip the write
	StatusNoSpace    Status = 2 // ALLOC: L1 full even after eviction; save skipped
	StatusPending    Status = 3 // LOOKUP_RESULT: still being answered
	StatusUnknown    Status = 4 // unknown lookup id, or result already consumed
	StatusNotFound   Status = 5 // COMMIT/ABORT/RETRIEVE: no such staging object / hold
	StatusBadRequest Status = 6 // malformed or out-of-range request
	StatusInternal   Status = 7 // server-side failure, see the message
	StatusInProgress Status = 8 // ALLOC: another writer of the same tag is staging the key
)

// Loc is where an object lives on the wire: kv.Loc, so that L1's
// bookkeeping (server/l1) names places without importing the transport.
type Loc = kv.Loc

// MaxKeys bounds every batch (a 1M-token prompt at chunk 256 is 4,096 chunks).
const MaxKeys = 1 << 16

// AllocReq reserves staging space for one rank's new chunk objects.
type AllocReq struct {
	Tag       kv.Tag
	Namespace kv.Namespace
	Rank      uint32
	Hashes    []kv.Hash
	Sizes     []uint64 // one per hash, bytes including the object header
}

// AllocResp has one entry per requested key, in order.
type AllocResp struct {
	Status []Status // OK (Loc valid), Resident, NoSpace, InProgress
	Locs   []Loc
}

// CommitReq publishes (OpCommit) or drops (OpAbort) a writer's staging objects.
type CommitReq struct {
	Tag       kv.Tag
	Namespace kv.Namespace
	Rank      uint32
	Hashes    []kv.Hash
}

// CommitResp has one status per key: OK, NotFound.
type CommitResp struct {
	Status []Status
}

// LookupReq registers a lookup, owned by the session that sends it (its
// instance id from the hello is the Owner other sessions name it by). The
// server takes read holds on what it will
// serve. A chunk counts only if present on every rank 0..WorldSize-1 (MLA
// namespaces are stored once, under rank 0, and read by Readers ranks).
type LookupReq struct {
	LookupID  uint64 // chosen by the client, unique per session
	Namespace kv.Namespace
	WorldSize uint32
	MLA       bool
	// AnswerFinal (protocol 5): when the lookup is final at registration
	// (no fill to wait for), its ack is its LookupResultResp, consumed as
	// OpLookupResult would; a pending lookup's ack stays empty. Saves the
	// round trip of asking at once.
	AnswerFinal bool
	Hashes      []kv.Hash
}

// LookupResultReq asks for (and, when final, consumes) a lookup's answer.
type LookupResultReq struct {
	LookupID uint64
}

// LookupResultResp: Status is Pending, Unknown, or OK with Chunks final.
// With OK, Generation is the lookup's namespace generation when it was
// registered (a client keyed with an older one looked up stale keys: see
// OpReset) and Sources the tier of each of the Chunks, as runs.
type LookupResultResp struct {
	Status     Status
	Chunks     uint32
	Generation uint64
	Sources    []SourceRun
}

// FreeReq releases the holds of chunks [Start, End) of a lookup on every rank
// (End = ^uint32(0) means all). A lookup with no holds left is forgotten.
type FreeReq struct {
	LookupID uint64
	Start    uint32
	End      uint32
}

// RetrieveReq asks for the locations of chunks [Start, End) that lookup holds
// for Rank. Owner is the instance id of the session that made the lookup.
type RetrieveReq struct {
	Owner    kv.Tag
	LookupID uint64
	Rank     uint32
	Start    uint32
	End      uint32
}

// RetrieveResp has one entry per chunk in [Start, End): OK with Loc, or NotFound.
type RetrieveResp struct {
	Status []Status
	Locs   []Loc
}

// ReleaseReq drops Rank's remaining holds in a lookup (after its copies end).
type ReleaseReq struct {
	Owner    kv.Tag
	LookupID uint64
	Rank     uint32
}

// Stat is one named counter of a STATS answer.
type Stat struct {
	Name  string
	Value float64
}

// StatsResp carries the server's counters.
type StatsResp struct {
	Stats []Stat
}

// ClearResp reports how many objects and bytes CLEAR dropped.
type ClearResp struct {
	Objects uint64
	Bytes   uint64
}
