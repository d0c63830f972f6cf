package trace

import (
	"fmt"
	"os"
	"sort"

	"github.com/apache/arrow/go/v17/arrow"
	"github.com/apache/arrow/go/v17/arrow/array"
	"github.com/apache/arrow/go/v17/arrow/ipc"
)

// ReadFile reads every record of one trace file.
func ReadFile(path string) ([]Record, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r, err := ipc.NewFileReader(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer r.Close()
	md := r.Schema().Metadata()
	i := md.FindKey("kvshim.trace.kind")
	if i < 0 {
		return nil, fmt.Errorf("%s: not a kvshim trace file (no kvshim.trace.kind)", path)
	}
	kind, ok := ParseKind(md.Values()[i])
	if !ok {
		return nil, fmt.Errorf("%s: unknown record kind %q", path, md.Values()[i])
	}
	var out []Record
	for b := range r.NumRecords() {
		rec, err := r.Record(b)
		if err != nil {
			return out, fmt.Errorf("%s: batch %d: %w", path, b, err)
		}
		out = appendRecords(out, kind, rec)
	}
	return out, nil
}

// ReadFiles reads files and returns their records ordered by mono_ns.
func ReadFiles(paths []string) ([]Record, error) {
	var all []Record
	for _, p := range paths {
		rs, err := ReadFile(p)
		if err != nil {
			return nil, err
		}
		all = append(all, rs...)
	}
	sort.SliceStable(all, func(i, j int) bool { return all[i].Mono < all[j].Mono })
	return all, nil
}

func appendRecords(out []Record, kind Kind, rec arrow.Record) []Record {
	n := int(rec.NumRows())
	base := len(out)
	for range n {
		out = append(out, Record{Kind: kind})
	}
	sc := rec.Schema()
	for c := range int(rec.NumCols()) {
		set := setter(sc.Field(c).Name)
		if set == nil {
			continue // a column of a later version
		}
		col := rec.Column(c)
		for i := range n {
			set(&out[base+i], col, i)
		}
	}
	return out
}

func setter(name string) func(r *Record, a arrow.Array, i int) {
	i64 := func(f func(r *Record) *int64) func(*Record, arrow.Array, int) {
		return func(r *Record, a arrow.Array, i int) { *f(r) = a.(*array.Int64).Value(i) }
	}
	u64 := func(f func(r *Record) *uint64) func(*Record, arrow.Array, int) {
		return func(r *Record, a arrow.Array, i int) { *f(r) = a.(*array.Uint64).Value(i) }
	}
	u32 := func(f func(r *Record) *uint32) func(*Record, arrow.Array, int) {
		return func(r *Record, a arrow.Array, i int) { *f(r) = a.(*array.Uint32).Value(i) }
	}
	i32 := func(f func(r *Record) *int32) func(*Record, arrow.Array, int) {
		return func(r *Record, a arrow.Array, i int) { *f(r) = a.(*array.Int32).Value(i) }
	}
	str := func(f func(r *Record) *string) func(*Record, arrow.Array, int) {
		return func(r *Record, a arrow.Array, i int) { *f(r) = a.(*array.String).Value(i) }
	}
	bin := func(f func(r *Record) *[]byte) func(*Record, arrow.Array, int) {
		return func(r *Record, a arrow.Array, i int) { *f(r) = append([]byte(nil), a.(*array.Binary).Value(i)...) }
	}
	switch name {
	case "mono_ns":
		return i64(func(r *Record) *int64 { return &r.Mono })
	case "wall_ns":
		return i64(func(r *Record) *int64 { return &r.Wall })
	case "source":
		return str(func(r *Record) *string { return &r.Source })
	case "pid":
		return i32(func(r *Record) *int32 { return &r.PID })
	case "event":
		return str(func(r *Record) *string { return &r.Event })
	case "request_id":
		return str(func(r *Record) *string { return &r.RequestID })
	case "lookup_id":
		return u64(func(r *Record) *uint64 { return &r.LookupID })
	case "owner":
		return str(func(r *Record) *string { return &r.Owner })
	case "namespace":
		return str(func(r *Record) *string { return &r.Namespace })
	case "rank":
		return i32(func(r *Record) *int32 { return &r.Rank })
	case "start":
		return u32(func(r *Record) *uint32 { return &r.Start })
	case "end":
		return u32(func(r *Record) *uint32 { return &r.End })
	case "chunks":
		return u32(func(r *Record) *uint32 { return &r.Chunks })
	case "world":
		return u32(func(r *Record) *uint32 { return &r.World })
	case "matched":
		return u32(func(r *Record) *uint32 { return &r.Matched })
	case "skipped":
		return u32(func(r *Record) *uint32 { return &r.Skipped })
	case "failed":
		return u32(func(r *Record) *uint32 { return &r.Failed })
	case "blocks":
		return u32(func(r *Record) *uint32 { return &r.Blocks })
	case "chunk":
		return i32(func(r *Record) *int32 { return &r.Chunk })
	case "stop_rank":
		return i32(func(r *Record) *int32 { return &r.StopRank })
	case "result":
		return str(func(r *Record) *string { return &r.Result })
	case "reason":
		return str(func(r *Record) *string { return &r.Reason })
	case "bytes":
		return u64(func(r *Record) *uint64 { return &r.Bytes })
	case "l1_bitmap":
		return bin(func(r *Record) *[]byte { return &r.L1 })
	case "missing_bitmap":
		return bin(func(r *Record) *[]byte { return &r.Missing })
	case "retrieve_ns":
		return i64(func(r *Record) *int64 { return &r.RetrieveNS })
	case "check_ns":
		return i64(func(r *Record) *int64 { return &r.CheckNS })
	case "copy_ns":
		return i64(func(r *Record) *int64 { return &r.CopyNS })
	case "written":
		return u64(func(r *Record) *uint64 { return &r.Written })
	case "dropped":
		return u64(func(r *Record) *uint64 { return &r.Dropped })
	}
	return nil
}
