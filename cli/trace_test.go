package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/trace"
)

// writeTrace writes a server's and a worker's records of one request (a
// lookup of 4 chunks, 3 found, a load failing at chunk 2) and of one
// cancelled lookup, as two writers would.
func writeTrace(t *testing.T, dir string) {
	t.Helper()
	sw, err := trace.Open(dir, trace.Options{Source: "server"})
	assert.NilError(t, err)
	ww, err := trace.Open(dir, trace.Options{Source: "worker_r0"})
	assert.NilError(t, err)
	mono := int64(1_000_000)
	at := func(r trace.Record) trace.Record { mono += 1000; r.Mono = mono; return r }
	lk := func(ev string, id uint64, matched uint32, result string) trace.Record {
		return at(trace.Record{Kind: trace.KindLookup, Event: ev, LookupID: id, Owner: "aa", Rank: -1, Chunks: 4, Matched: matched, Result: result, Chunk: -1, StopRank: -1,
			L1: trace.Bitmap(4, func(i int) bool { return i < 3 })})
	}
	sw.Emit(lk("registered", 1, 3, ""))
	sw.Emit(lk("final", 1, 3, "missing"))
	sw.Emit(lk("consumed", 1, 3, ""))
	ld := func(ev string, chunk int32, result string) trace.Record {
		return at(trace.Record{Kind: trace.KindLoad, Event: ev, RequestID: "req-A", LookupID: 1, Owner: "aa", Chunks: 3, Chunk: chunk, Result: result})
	}
	ww.Emit(ld("planned", -1, ""))
	ww.Emit(ld("chunk", 0, "ok"))
	ww.Emit(ld("chunk", 1, "ok"))
	c := ld("chunk", 2, "checksum")
	c.Reason = "payload checksum"
	ww.Emit(c)
	d := ld("done", -1, "partial")
	d.Matched, d.Bytes, d.RetrieveNS, d.CheckNS, d.CopyNS = 2, 4096, 10, 20, 30
	ww.Emit(d)
	ww.Emit(at(trace.Record{Kind: trace.KindSave, Event: "commit", RequestID: "req-A", Chunks: 1, Matched: 1, Bytes: 2048, Result: "ok"}))
	sw.Emit(lk("registered", 2, 3, ""))
	sw.Emit(lk("final", 2, 3, "missing"))
	sw.Emit(at(trace.Record{Kind: trace.KindCancel, Event: "free", LookupID: 2, Owner: "aa", Matched: 3, Result: "final"}))
	sw.Emit(at(trace.Record{Kind: trace.KindEvict, Event: "evict", Chunks: 1, Bytes: 99}))
	sw.Emit(at(trace.Record{Kind: trace.KindSave, Event: "l2_saved", Chunks: 1, Matched: 1, Bytes: 2048, Result: "ok"}))
	sw.Emit(at(trace.Record{Kind: trace.KindSave, Event: "l2_saved", Chunks: 1, Failed: 1, Result: "failed"}))
	assert.NilError(t, sw.Close())
	assert.NilError(t, ww.Close())
}

func TestTraceJSON(t *testing.T) {
	dir := t.TempDir()
	writeTrace(t, dir)
	// A file still being written is skipped.
	assert.NilError(t, os.WriteFile(filepath.Join(dir, "x"+trace.Suffix+".part"), []byte("half"), 0o644))
	var out, errb bytes.Buffer
	assert.Equal(t, Trace([]string{"--json", dir}, &out, &errb), 0, errb.String())
	var rep traceReport
	assert.NilError(t, json.Unmarshal(out.Bytes(), &rep))
	assert.Equal(t, len(rep.Requests), 2)
	a := rep.Requests[0]
	assert.Equal(t, a.RequestID, "req-A") // server lookup records joined by (owner, lookup id)
	assert.Equal(t, *a.Found, uint32(3))
	assert.Equal(t, *a.Used, uint32(3))
	assert.Equal(t, *a.Loaded, uint32(2))
	assert.Equal(t, a.Saved, uint32(1))
	assert.Equal(t, len(a.Failures), 1)
	assert.Equal(t, a.Failures[0].Result, "checksum")
	assert.Equal(t, a.Timeline[0].Event, "registered")
	assert.Equal(t, a.Timeline[0].L1, "1110")
	b := rep.Requests[1]
	assert.Assert(t, b.Cancelled && b.Used == nil && b.RequestID == "")
	s := rep.Summary
	assert.Equal(t, s.HitsFound, uint64(6))
	assert.Equal(t, s.HitsUsed, uint64(3))
	assert.Equal(t, s.HitsLoaded, uint64(2))
	assert.Equal(t, s.Failures["checksum"], uint64(1))
	assert.Equal(t, s.PhaseNS, phases{10, 20, 30})
	assert.Equal(t, s.BytesLoaded, uint64(4096))
	assert.Equal(t, s.BytesSaved, uint64(2048))
	assert.Equal(t, s.Cancels, 1)
	assert.Equal(t, s.Evictions, uint64(1))
	assert.Equal(t, s.L2Saved, uint64(1))
	assert.Equal(t, s.L2SaveFailed, uint64(1))
	assert.Equal(t, s.BytesL2Saved, uint64(2048))
}

func TestTraceText(t *testing.T) {
	dir := t.TempDir()
	writeTrace(t, dir)
	var out, errb bytes.Buffer
	assert.Equal(t, Trace([]string{"--request", "req-A", dir}, &out, &errb), 0, errb.String())
	s := out.String()
	for _, want := range []string{"request req-A", "found 3  used 3  loaded 2", "result=checksum (payload checksum)", "hits found 6, used (load planned) 3, loaded 2", "load failures: checksum=1"} {
		assert.Assert(t, strings.Contains(s, want), "no %q in:\n%s", want, s)
	}
	assert.Assert(t, !strings.Contains(s, "CANCELLED"), s)
}

func TestTraceUsage(t *testing.T) {
	var out, errb bytes.Buffer
	assert.Equal(t, Trace(nil, &out, &errb), 2)
	assert.Assert(t, strings.Contains(errb.String(), "no trace file"))
	errb.Reset()
	assert.Equal(t, Trace([]string{filepath.Join(t.TempDir(), "nope.arrow")}, &out, &errb), 1)
	assert.Equal(t, Trace([]string{"--help"}, &out, &errb), 0)
	assert.Assert(t, strings.Contains(out.String(), "usage: kvshim trace"))
}
