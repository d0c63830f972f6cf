package shim

import (
	"sync"
	"time"
)

// Load and save latencies for vLLM's /metrics (build_prom_metrics): each
// load job's and save job's duration, from the job's start to its end
// (copies, checks, COMMIT or RELEASE included), kept until taken.
// Bounded: past maxLatencies samples of a kind, later ones are counted as
// dropped, not kept (vLLM takes them every step).

const maxLatencies = 4096

type latencies struct {
	mu      sync.Mutex
	load    []float64 // seconds
	save    []float64
	dropped uint64
}

func (l *latencies) observe(dst *[]float64, d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(*dst) >= maxLatencies {
		l.dropped++
		return
	}
	*dst = append(*dst, d.Seconds())
}

// Latencies are the load and save durations (seconds) since the last call.
type Latencies struct {
	Load    []float64 `json:"load"`
	Save    []float64 `json:"save"`
	Dropped uint64    `json:"dropped"` // samples not kept (over the bound) since the last call
}

// TakeLatencies returns the latencies recorded since the last call.
func (w *Worker) TakeLatencies() Latencies {
	l := &w.lat
	l.mu.Lock()
	defer l.mu.Unlock()
	out := Latencies{Load: l.load, Save: l.save, Dropped: l.dropped}
	l.load, l.save, l.dropped = nil, nil, 0
	return out
}
