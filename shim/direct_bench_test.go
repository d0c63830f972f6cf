package shim

import (
	"fmt"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/server"
)

// BenchmarkMatchDirectVsRing: a 64-chunk lookup (Match until final, then
// Finished) from schedulers in the embedded server's own process, one
// calling the core directly and one over the ring, alternating, each after
// a 3 ms idle gap (as between two scheduler steps). Reports p50 µs per path.
//
//	go test -run '^$' -bench MatchDirectVsRing -benchtime 300x ./shim
func BenchmarkMatchDirectVsRing(b *testing.B) {
	sock := filepath.Join(b.TempDir(), "kvshim.sock")
	cfg := server.DefaultConfig()
	cfg.Socket, cfg.L1SizeGB, cfg.L1PrefaultGB = sock, 0.0625, 0
	srv, err := server.Start(cfg, nil, server.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "bench", ObjectFormat: 1, WorldSize: 1, ChunkSize: 256}
	scheds := map[string]*Scheduler{}
	for _, path := range []string{"direct", "ring"} {
		s, err := NewScheduler(SchedulerConfig{Socket: sock, Namespace: ns, BlockSize: 16, Timeout: 5 * time.Second,
			Instance: uuid.New(), RingOnly: path == "ring"})
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		scheds[path] = s
	}
	tokens := make([]uint32, 64*256)
	for i := range tokens {
		tokens[i] = uint32(i*7 + 1)
	}
	us := map[string][]float64{}
	b.ResetTimer()
	for n := range b.N {
		for _, path := range []string{"direct", "ring"} {
			s := scheds[path]
			time.Sleep(3 * time.Millisecond)
			req := fmt.Sprint(path, n)
			t0 := time.Now()
			for {
				_, pending, err := s.Match(req, tokens, Extras{}, 0)
				if err != nil {
					b.Fatal(err)
				}
				if !pending {
					break
				}
			}
			us[path] = append(us[path], float64(time.Since(t0).Nanoseconds())/1e3)
			s.Finished(req)
		}
	}
	for path, v := range us {
		sort.Float64s(v)
		b.ReportMetric(v[len(v)/2], path+"_p50_us")
		b.ReportMetric(v[len(v)*99/100], path+"_p99_us")
	}
}
