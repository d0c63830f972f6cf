package trace

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
)

func TestWriterRoundTrip(t *testing.T) {
	dir := t.TempDir()
	w, err := Open(dir, Options{Source: "test"})
	assert.NilError(t, err)
	for i := range 10 {
		w.Emit(Record{Kind: KindLoad, Event: "chunk", RequestID: "r1", LookupID: 7, Chunk: int32(i), Result: "ok", Bytes: 100})
	}
	w.Emit(Record{Kind: KindLookup, Event: "registered", LookupID: 7, Chunks: 10, L1: Bitmap(10, func(i int) bool { return i < 3 })})
	assert.NilError(t, w.Close())
	recs, err := ReadFiles(mustGlob(t, dir))
	assert.NilError(t, err)
	var loads, lookups, writers int
	for _, r := range recs {
		switch r.Kind {
		case KindLoad:
			assert.Equal(t, r.Chunk, int32(loads))
			assert.Equal(t, r.RequestID, "r1")
			assert.Equal(t, r.Source, "test")
			assert.Assert(t, r.Mono > 0)
			loads++
		case KindLookup:
			assert.Assert(t, Bit(r.L1, 2) && !Bit(r.L1, 3))
			lookups++
		case KindWriter:
			assert.Equal(t, r.Written, uint64(11))
			writers++
		}
	}
	assert.Equal(t, loads, 10)
	assert.Equal(t, lookups, 1)
	assert.Equal(t, writers, 1)
}

func mustGlob(t *testing.T, dir string) []string {
	t.Helper()
	fs, err := filepath.Glob(filepath.Join(dir, "*"+Suffix))
	assert.NilError(t, err)
	return fs
}

// Rotation by size: a tiny MaxBytes closes a file after each batch.
func TestWriterRotatesBySize(t *testing.T) {
	dir := t.TempDir()
	w, err := Open(dir, Options{Source: "test", MaxBytes: 1, BatchRows: 5})
	assert.NilError(t, err)
	for i := range 20 {
		w.Emit(Record{Kind: KindLoad, Chunk: int32(i)})
	}
	assert.NilError(t, w.Close())
	files := mustGlob(t, dir)
	var loadFiles int
	for _, f := range files {
		if strings.Contains(f, "-load-") {
			loadFiles++
		}
	}
	assert.Equal(t, loadFiles, 4, "%v", files)
	recs, err := ReadFiles(files)
	assert.NilError(t, err)
	assert.Equal(t, len(recs), 21)
}

// Rotation by age: a file older than MaxAge is closed at the next flush
// tick, readable while the writer keeps running.
func TestWriterRotatesByAge(t *testing.T) {
	dir := t.TempDir()
	w, err := Open(dir, Options{Source: "test", MaxAge: 20 * time.Millisecond, Flush: 10 * time.Millisecond})
	assert.NilError(t, err)
	defer w.Close()
	w.Emit(Record{Kind: KindSave, Event: "commit"})
	testkit.Eventually(t, 5*time.Second, "a file closed by age", func() bool { return len(mustGlob(t, dir)) > 0 })
	recs, err := ReadFiles(mustGlob(t, dir))
	assert.NilError(t, err)
	assert.Equal(t, len(recs), 1)
	assert.Equal(t, recs[0].Event, "commit")
}

// A full queue drops and counts; Emit never blocks.
func TestWriterDropsWhenFull(t *testing.T) {
	dir := t.TempDir()
	w, err := Open(dir, Options{Source: "test", Buffer: 4})
	assert.NilError(t, err)
	// Stall the writer goroutine: the directory is gone, so the first
	// batch fails... instead, fill faster than it drains: 1e5 records in
	// a tight loop against a 4-record queue.
	start := time.Now()
	const n = 100000
	for range n {
		w.Emit(Record{Kind: KindLoad})
	}
	took := time.Since(start)
	assert.NilError(t, w.Close())
	st := w.Stats()
	assert.Assert(t, st.Dropped > 0, "%+v", st)
	assert.Equal(t, st.Written+st.Dropped, uint64(n)+1) // + the writer's close record
	assert.Assert(t, took < 2*time.Second, "Emit blocked: %v", took)
	_ = os.RemoveAll(dir)
}

func TestNilWriterIsOff(t *testing.T) {
	var w *Writer
	w.Emit(Record{})
	assert.Assert(t, !w.On())
	assert.NilError(t, w.Close())
}

// TestWriteSample writes a sample trace into $KVSHIM_TRACE_SAMPLE_DIR (for
// tests/test_trace_pyarrow.py, which reads it with pyarrow and pandas).
func TestWriteSample(t *testing.T) {
	dir := os.Getenv("KVSHIM_TRACE_SAMPLE_DIR")
	if dir == "" {
		t.Skip("KVSHIM_TRACE_SAMPLE_DIR not set")
	}
	w, err := Open(dir, Options{Source: "server"})
	assert.NilError(t, err)
	w.Emit(Record{Kind: KindLookup, Event: "registered", LookupID: 1, Owner: "aa", Rank: -1, Chunks: 4, Matched: 3,
		L1: Bitmap(4, func(i int) bool { return i < 3 }), Missing: Bitmap(4, func(i int) bool { return i >= 3 }), Chunk: 3, StopRank: 0})
	for c := range 3 {
		w.Emit(Record{Kind: KindLoad, Event: "chunk", RequestID: "req-A", LookupID: 1, Owner: "aa", Chunk: int32(c), Result: "ok", Bytes: 1024})
	}
	assert.NilError(t, w.Close())
}

// BenchmarkEmit is the cost of one record on the caller's thread (the
// queue send; encoding runs on the writer's goroutine).
func BenchmarkEmit(b *testing.B) {
	w, err := Open(b.TempDir(), Options{Source: "bench"})
	assert.NilError(b, err)
	defer w.Close()
	r := Record{Kind: KindLoad, Event: "chunk", RequestID: "req-0123456789", Owner: "00112233445566778899aabbccddeeff", Result: "ok", Bytes: 32 << 20}
	b.ResetTimer()
	for range b.N {
		w.Emit(r)
	}
	b.StopTimer()
	b.ReportMetric(float64(w.Stats().Dropped)/float64(b.N), "dropped/op")
}

// BenchmarkEmitOff: a nil writer (tracing off).
func BenchmarkEmitOff(b *testing.B) {
	var w *Writer
	r := Record{Kind: KindLoad}
	for range b.N {
		w.Emit(r)
	}
}
