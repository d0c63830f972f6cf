package shim

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/kv"
)

// BenchmarkEventsSave is what KV events cost per saved chunk: a save of 3
// chunks (lookup, alloc, step with the worker's ALLOC/copy/COMMIT, finish)
// on a rig without events and on one with them (plus the worker's
// reports, SaveReports and TakeEvents), rounds interleaved so that a
// shared machine's noise falls on both alike. Ends with one JSON line
// (make bench-events).
func BenchmarkEventsSave(b *testing.B) {
	off, on := newRig(b, 1), newRig(b, 1)
	on.sched.TakeEvents()
	on.workers[0].TakeSaveReports()
	const chunks = 3
	var offNs, onNs []float64
	round := func(r *rig, i int, events bool) float64 {
		tokens := tokensOf(uint32(2*i+3), uint32(i))
		start := time.Now()
		_, saved := saveChunks(b, r, fmt.Sprint("R", i), tokens, chunks)
		if events {
			if err := r.sched.SaveReports(r.workers[0].TakeSaveReports()); err != nil {
				b.Fatal(err)
			}
			if ev := r.sched.TakeEvents(); saved > 0 && len(ev.Events) != 1 {
				b.Fatalf("round %d: %d chunks saved, events %+v", i, saved, ev)
			}
		}
		return float64(time.Since(start).Nanoseconds()) / chunks
	}
	for i := 0; i < b.N; i++ {
		offNs = append(offNs, round(off, i, false))
		onNs = append(onNs, round(on, i, true))
	}
	if b.N < 10 {
		return // the framework's probe run: too few rounds to report
	}
	med := func(v []float64) float64 { v = slices.Clone(v); slices.Sort(v); return v[len(v)/2] }
	p99 := func(v []float64) float64 { v = slices.Clone(v); slices.Sort(v); return v[len(v)*99/100] }
	out, _ := json.Marshal(map[string]any{
		"bench": "events_save", "rounds": b.N, "chunks_per_save": chunks,
		"off_ns_per_chunk_median": med(offNs), "on_ns_per_chunk_median": med(onNs),
		"off_ns_per_chunk_p99": p99(offNs), "on_ns_per_chunk_p99": p99(onNs),
		"events_cost_ns_per_chunk_median": med(onNs) - med(offNs), "ratio_median": med(onNs) / med(offNs),
	})
	fmt.Println(string(out))
}

// BenchmarkEventsBookkeeping is the scheduler's own work per chunk with
// events on (announce at dispatch, the rank's report, the stored event,
// TakeEvents), without the server round trips BenchmarkEventsSave includes.
func BenchmarkEventsBookkeeping(b *testing.B) {
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk}
	s, err := NewScheduler(SchedulerConfig{Socket: "/nonexistent/kvshim.sock", Namespace: ns, BlockSize: tBS, Instance: uuid.New()})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	s.TakeEvents()
	const chunks = 16
	sv := SaveSpec{Req: "A", Hashes: make([]kv.Hash, chunks)}
	reps := make([]SaveReport, chunks)
	for j := range chunks {
		sv.Hashes[j][0], sv.Hashes[j][1] = byte(j), 0xee
		reps[j] = SaveReport{Req: "A", Hash: hex.EncodeToString(sv.Hashes[j][:]), OK: true}
	}
	b.ResetTimer()
	for range b.N {
		s.mu.Lock()
		s.announce([]SaveSpec{sv})
		s.mu.Unlock()
		if err := s.SaveReports(reps); err != nil {
			b.Fatal(err)
		}
		if ev := s.TakeEvents(); len(ev.Events) != 1 {
			b.Fatalf("%+v", ev)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*chunks), "ns/chunk")
}
