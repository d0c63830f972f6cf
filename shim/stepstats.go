package shim

import (
	"reflect"
	"strings"
	"unicode"
)

// Step stats are what vLLM's get_kv_connector_stats reports: each role's
// counters since the previous report, by metric name. vLLM adds them up
// across workers and over its logging interval (KVShimStats.aggregate)
// and prints them; kvshim.prom turns them into vLLM's /metrics.

// TakeStepStats returns the hits since the last call: hit_tokens, the
// tokens vLLM was told to load (update_state_after_alloc), and
// hit_requests, the requests with such a hit.
func (s *Scheduler) TakeStepStats() map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]any{"hit_tokens": s.hitTokens, "hit_requests": s.hitRequests}
	s.hitTokens, s.hitRequests = 0, 0
	return out
}

// Counters are st's counters by metric name (SavedChunks: saved_chunks).
// The Populate* fields describe the start-up's L1 mapping (a gauge among
// them), not a step's work, and are left out.
func (st WorkerStats) Counters() map[string]uint64 {
	out := map[string]uint64{}
	v := reflect.ValueOf(st)
	for _, f := range reflect.VisibleFields(v.Type()) {
		if strings.HasPrefix(f.Name, "Populate") || f.Type.Kind() != reflect.Uint64 {
			continue
		}
		out[snake(f.Name)] = v.FieldByIndex(f.Index).Uint()
	}
	return out
}

func snake(name string) string {
	var b strings.Builder
	for i, r := range name {
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}

// StepStats is a worker's side of the step stats: its counters' growth
// since prev (a Counters snapshot, nil at first), and the load and save
// job durations since the last TakeLatencies (load_seconds,
// save_seconds, when there are any).
func (w *Worker) StepStats(prev map[string]uint64) (out map[string]any, now map[string]uint64) {
	now = w.Stats().Counters()
	out = make(map[string]any, len(now)+2)
	for k, v := range now {
		out[k] = v - prev[k]
	}
	lat := w.TakeLatencies()
	if len(lat.Load) > 0 {
		out["load_seconds"] = lat.Load
	}
	if len(lat.Save) > 0 {
		out["save_seconds"] = lat.Save
	}
	return out, now
}
