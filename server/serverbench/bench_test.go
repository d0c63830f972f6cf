package serverbench

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"
)

// TestRunSmall runs the benchmark at a tiny size (it must work; the
// numbers are not checked here, except the leak and metadata bounds).
func TestRunSmall(t *testing.T) {
	r, err := Run(Options{Chunks: 16, Ranks: 2, Background: 1000, LookupIters: 20,
		AllocObjects: 5000, MetaObjects: 20000, MaxDuration: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(r)
	t.Log(string(b))
	if r.BytesLeakedAfterClear != 0 {
		t.Fatalf("leaked %d bytes", r.BytesLeakedAfterClear)
	}
	if r.MetadataBytesPerObject > 200 {
		t.Fatalf("metadata %.0f bytes per object > 200", r.MetadataBytesPerObject)
	}
}

// BenchmarkRun is the full benchmark:
//
//	go test -run='^$' -bench=Run -benchtime=1x ./server/serverbench/
func BenchmarkRun(b *testing.B) {
	for b.Loop() {
		r, err := Run(Options{})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(r.Lookup4096KeysServerUs, "lookup_4096_keys_server_us")
		b.ReportMetric(r.AllocCommitObjectsPerS, "alloc_commit_objects/s")
		b.ReportMetric(r.MetadataBytesPerObject, "metadata_bytes/object")
		b.ReportMetric(float64(r.BytesLeakedAfterClear), "bytes_leaked_after_clear")
		js, _ := json.Marshal(r)
		fmt.Println(string(js)) // the make target keeps the last line starting with {
	}
}

// BenchmarkLookupCycle times LOOKUP + RESULT + FREE of 512 chunks × 8 ranks.
func BenchmarkLookupCycle(b *testing.B) {
	o := Options{Background: 100_000}
	o.defaults()
	st, s, hs, err := lookupSetup(o)
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	var id uint64
	for b.Loop() {
		id++
		if err := lookupOnce(st, s, hs, o.Ranks, id); err != nil {
			b.Fatal(err)
		}
	}
}
