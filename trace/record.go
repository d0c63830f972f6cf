package trace

import (
	"github.com/apache/arrow/go/v17/arrow"
	"github.com/apache/arrow/go/v17/arrow/array"
)

// Kind is a record kind: one Arrow schema, one file series.
type Kind uint8

// The record kinds (see doc.go for their columns and events).
const (
	KindLookup Kind = iota
	KindLoad
	KindSave
	KindCancel
	KindEvict
	KindFill
	KindWriter
	KindHold
	NumKinds
)

var kindNames = [NumKinds]string{"lookup", "load", "save", "cancel", "evict", "fill", "writer", "hold"}

func (k Kind) String() string {
	if k < NumKinds {
		return kindNames[k]
	}
	return "unknown"
}

// ParseKind is the inverse of Kind.String.
func ParseKind(s string) (Kind, bool) {
	for k, n := range kindNames {
		if n == s {
			return Kind(k), true
		}
	}
	return 0, false
}

// Record is one lifecycle record. The common fields are in every kind's
// schema; each kind's schema adds the fields doc.go lists for it (the
// others are not written). Mono and Wall are filled by Emit when zero.
type Record struct {
	Kind      Kind
	Mono      int64  // CLOCK_MONOTONIC, ns (host-wide: joins server and workers)
	Wall      int64  // unix ns
	Source    string // "server" or "worker" (set by the writer)
	PID       int32  // set by the writer
	Event     string // the stage, per kind (doc.go)
	RequestID string // vLLM's request id ("" on the server: it never sees one)
	LookupID  uint64
	Owner     string // the lookup owner's session tag (the scheduler's instance), hex
	Namespace string // hex
	Rank      int32  // KV rank (-1: all / not applicable)

	Start, End uint32 // chunk range [Start, End) the record covers
	Chunks     uint32 // lookup: chunks asked; load: planned; save: chunks in the step; evict: objects
	World      uint32
	Matched    uint32 // lookup: prefix chunks held; load: chunks restored; save: chunks committed
	Skipped    uint32
	Failed     uint32
	Blocks     uint32
	Chunk      int32  // the chunk a per-chunk record is about (-1: none)
	StopRank   int32  // lookup: first rank that lacked the stop chunk (-1: none)
	Result     string // ok | missing | checksum | key_mismatch | copy_error | timeout | unavailable | error ...
	Reason     string // free text: the error, or why a lookup stopped
	Bytes      uint64
	L1         []byte // lookup: bitmap of chunks present in L1 on every rank (bit i = chunk i, LSB first)
	Missing    []byte // lookup: bitmap of chunks absent on some rank
	RetrieveNS int64
	CheckNS    int64
	CopyNS     int64
	Written    uint64 // writer: records written so far
	Dropped    uint64 // writer: records dropped so far (buffer full)
}

// Bitmap sets bit i for each i with f(i), LSB first.
func Bitmap(n int, f func(i int) bool) []byte {
	b := make([]byte, (n+7)/8)
	for i := range n {
		if f(i) {
			b[i/8] |= 1 << (i % 8)
		}
	}
	return b
}

// Bit reports bit i of a Bitmap.
func Bit(b []byte, i int) bool { return i/8 < len(b) && b[i/8]&(1<<(i%8)) != 0 }

// column is one field of a schema and how a Record fills it.
type column struct {
	field  arrow.Field
	append func(b array.Builder, r *Record)
}

func i64(name string, get func(r *Record) int64) column {
	return column{arrow.Field{Name: name, Type: arrow.PrimitiveTypes.Int64}, func(b array.Builder, r *Record) { b.(*array.Int64Builder).Append(get(r)) }}
}
func u64(name string, get func(r *Record) uint64) column {
	return column{arrow.Field{Name: name, Type: arrow.PrimitiveTypes.Uint64}, func(b array.Builder, r *Record) { b.(*array.Uint64Builder).Append(get(r)) }}
}
func u32(name string, get func(r *Record) uint32) column {
	return column{arrow.Field{Name: name, Type: arrow.PrimitiveTypes.Uint32}, func(b array.Builder, r *Record) { b.(*array.Uint32Builder).Append(get(r)) }}
}
func i32(name string, get func(r *Record) int32) column {
	return column{arrow.Field{Name: name, Type: arrow.PrimitiveTypes.Int32}, func(b array.Builder, r *Record) { b.(*array.Int32Builder).Append(get(r)) }}
}
func str(name string, get func(r *Record) string) column {
	return column{arrow.Field{Name: name, Type: arrow.BinaryTypes.String}, func(b array.Builder, r *Record) { b.(*array.StringBuilder).Append(get(r)) }}
}
func bin(name string, get func(r *Record) []byte) column {
	return column{arrow.Field{Name: name, Type: arrow.BinaryTypes.Binary}, func(b array.Builder, r *Record) { b.(*array.BinaryBuilder).Append(get(r)) }}
}

var common = []column{
	i64("mono_ns", func(r *Record) int64 { return r.Mono }),
	i64("wall_ns", func(r *Record) int64 { return r.Wall }),
	str("source", func(r *Record) string { return r.Source }),
	i32("pid", func(r *Record) int32 { return r.PID }),
	str("event", func(r *Record) string { return r.Event }),
	str("request_id", func(r *Record) string { return r.RequestID }),
	u64("lookup_id", func(r *Record) uint64 { return r.LookupID }),
	str("owner", func(r *Record) string { return r.Owner }),
	str("namespace", func(r *Record) string { return r.Namespace }),
	i32("rank", func(r *Record) int32 { return r.Rank }),
}

var (
	cStart    = u32("start", func(r *Record) uint32 { return r.Start })
	cEnd      = u32("end", func(r *Record) uint32 { return r.End })
	cChunks   = u32("chunks", func(r *Record) uint32 { return r.Chunks })
	cWorld    = u32("world", func(r *Record) uint32 { return r.World })
	cMatched  = u32("matched", func(r *Record) uint32 { return r.Matched })
	cSkipped  = u32("skipped", func(r *Record) uint32 { return r.Skipped })
	cFailed   = u32("failed", func(r *Record) uint32 { return r.Failed })
	cBlocks   = u32("blocks", func(r *Record) uint32 { return r.Blocks })
	cChunk    = i32("chunk", func(r *Record) int32 { return r.Chunk })
	cStopRank = i32("stop_rank", func(r *Record) int32 { return r.StopRank })
	cResult   = str("result", func(r *Record) string { return r.Result })
	cReason   = str("reason", func(r *Record) string { return r.Reason })
	cBytes    = u64("bytes", func(r *Record) uint64 { return r.Bytes })
	cL1       = bin("l1_bitmap", func(r *Record) []byte { return r.L1 })
	cMissing  = bin("missing_bitmap", func(r *Record) []byte { return r.Missing })
	cRetrieve = i64("retrieve_ns", func(r *Record) int64 { return r.RetrieveNS })
	cCheck    = i64("check_ns", func(r *Record) int64 { return r.CheckNS })
	cCopy     = i64("copy_ns", func(r *Record) int64 { return r.CopyNS })
	cWritten  = u64("written", func(r *Record) uint64 { return r.Written })
	cDropped  = u64("dropped", func(r *Record) uint64 { return r.Dropped })
)

// kindColumns lists each kind's own columns, after the common ones.
var kindColumns = [NumKinds][]column{
	KindLookup: {cChunks, cWorld, cL1, cMissing, cMatched, cChunk, cStopRank, cResult, cReason},
	KindLoad:   {cStart, cEnd, cChunks, cBlocks, cChunk, cMatched, cResult, cReason, cBytes, cRetrieve, cCheck, cCopy},
	KindSave:   {cChunks, cMatched, cSkipped, cFailed, cBytes, cResult, cReason},
	KindCancel: {cStart, cEnd, cChunks, cMatched, cResult, cReason},
	KindEvict:  {cChunks, cBytes, cReason},
	KindFill:   {cStart, cChunks, cMatched, cFailed, cBytes, cResult, cReason},
	KindWriter: {cWritten, cDropped},
	KindHold:   {cChunks, cWorld, cMatched, cResult, cReason},
}

var schemas [NumKinds]*arrow.Schema

func init() {
	for k := range NumKinds {
		cols := columnsOf(k)
		fs := make([]arrow.Field, len(cols))
		for i, c := range cols {
			fs[i] = c.field
		}
		md := arrow.NewMetadata([]string{"kvshim.trace.kind", "kvshim.trace.version"}, []string{k.String(), "1"})
		schemas[k] = arrow.NewSchema(fs, &md)
	}
}

func columnsOf(k Kind) []column {
	return append(append([]column(nil), common...), kindColumns[k]...)
}

// Schema is kind k's Arrow schema.
func Schema(k Kind) *arrow.Schema { return schemas[k] }
