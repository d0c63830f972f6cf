package cli

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"time"
)

// statReader reads a snapshot's numbers and remembers which it used, so
// that numbers this build does not know (added to the server later) are
// still printed, under "other".
type statReader struct {
	s    *snapshot
	used map[string]bool
}

func (r *statReader) get(name string) float64 {
	r.used[name] = true
	return r.s.Stats[name]
}

// opt is get for numbers only some server versions export.
func (r *statReader) opt(name string) (float64, bool) {
	v, ok := r.s.Stats[name]
	r.used[name] = ok
	return v, ok
}

// family returns the label values and numbers of a labelled metric, in
// the server's order: family("kvshim_l1_objects", "state").
func (r *statReader) family(name, key string) (labels []string, values []float64) {
	prefix := name + "{" + key + "="
	for _, n := range r.s.order {
		if v, ok := strings.CutPrefix(n, prefix); ok && strings.HasSuffix(v, "}") {
			labels = append(labels, strings.TrimSuffix(v, "}"))
			values = append(values, r.get(n))
		}
	}
	return labels, values
}

// printSnapshot prints s for a person: one topic per line.
func printSnapshot(w io.Writer, s *snapshot) {
	r := &statReader{s: s, used: map[string]bool{}}
	line := func(topic, f string, a ...any) { fmt.Fprintf(w, "%-11s %s\n", topic, fmt.Sprintf(f, a...)) }

	fmt.Fprintf(w, "kvshim server at %s (instance %s)\n", s.Socket, s.Server)
	capacity := r.get("kvshim_l1_capacity_bytes")
	used, mapped := r.get("kvshim_l1_used_bytes"), r.get("kvshim_l1_mapped_bytes")
	line("L1", "used %s of %s (%s), mapped %s (%s), slabs %s (%s)",
		fmtBytes(used), fmtBytes(capacity), pct(used, capacity),
		fmtBytes(mapped), pct(mapped, capacity), fmtBytes(r.get("kvshim_l1_slab_bytes")), pct(r.get("kvshim_l1_slab_bytes"), capacity))
	peak := ""
	if v, ok := r.opt("kvshim_l1_used_max_bytes"); ok {
		peak = fmt.Sprintf("; peak used %s (%s)", fmtBytes(v), pct(v, capacity))
	}
	line("", "%.0f segments, %.0f slabs, %.0f size classes%s",
		r.get("kvshim_l1_segments"), r.get("kvshim_l1_slabs"), r.get("kvshim_l1_size_classes"), peak)
	states, counts := r.family("kvshim_l1_objects", "state")
	bstates, bytes := r.family("kvshim_l1_object_bytes", "state")
	objBytes := map[string]float64{}
	for i, st := range bstates {
		objBytes[st] = bytes[i]
	}
	var objs []string
	for i, st := range states {
		objs = append(objs, fmt.Sprintf("%s %.0f (%s)", st, counts[i], fmtBytes(objBytes[st])))
	}
	line("objects", "%s", strings.Join(objs, ", "))
	pinned := ""
	if v, ok := r.opt("kvshim_l1_pinned"); ok {
		pinned = fmt.Sprintf(", %.0f pinned for L2 writes", v)
	}
	line("holds", "%.0f read holds%s", r.get("kvshim_l1_holds"), pinned)
	if v, ok := r.opt("kvshim_l1_prefetch_bytes"); ok {
		line("prefetch", "%s of L1 in objects loaded from L2 (%s)", fmtBytes(v), pct(v, capacity))
	}
	hit, miss := r.get("kvshim_lookup_hit_chunks_total"), r.get("kvshim_lookup_missed_chunks_total")
	line("lookups", "%.0f total, %.0f live, %.0f pending; chunks hit %.0f, miss %.0f (%s hit)",
		r.get("kvshim_lookups_total"), r.get("kvshim_lookups_live"), r.get("kvshim_lookups_pending"), hit, miss, pct(hit, hit+miss))
	line("evictions", "%.0f objects, %s", r.get("kvshim_l1_evictions_total"), fmtBytes(r.get("kvshim_l1_evicted_bytes_total")))
	line("writes", "%.0f commits, %.0f aborts, %.0f discarded duplicates",
		r.get("kvshim_l1_commits_total"), r.get("kvshim_l1_aborts_total"), r.get("kvshim_l1_discarded_total"))
	line("alloc keys", "%s", joinFamily(r.family("kvshim_l1_alloc_keys_total", "status")))
	line("sessions", "%.0f connected (%.0f opened, %.0f closed)",
		r.get("kvshim_sessions"), r.get("kvshim_sessions_opened_total"), r.get("kvshim_sessions_closed_total"))
	line("reclaimed", "hold TTL %.0f holds, staging TTL %.0f objects, CLEAR %.0f objects",
		r.get("kvshim_l1_ttl_reclaimed_holds_total"), r.get("kvshim_l1_ttl_reclaimed_staging_total"), r.get("kvshim_l1_cleared_objects_total"))
	kinds, frag := r.family("kvshim_l1_fragmentation_bytes", "kind")
	var fr []string
	for i, k := range kinds {
		fr = append(fr, fmt.Sprintf("%s %s", k, fmtBytes(frag[i])))
	}
	line("fragments", "%s", strings.Join(fr, ", "))
	line("errors", "%.0f segment failures", r.get("kvshim_l1_segment_errors_total"))

	// Numbers this build does not lay out: latencies (any *_seconds*) as
	// durations, the rest as they are.
	var rest []string
	for _, n := range s.order {
		if !r.used[n] {
			rest = append(rest, n)
		}
	}
	sort.Strings(rest)
	for _, n := range rest {
		if strings.Contains(n, "_seconds") {
			line("latency", "%s %v", n, time.Duration(s.Stats[n]*float64(time.Second)))
		}
	}
	for _, n := range rest {
		if !strings.Contains(n, "_seconds") {
			line("other", "%s %g", n, s.Stats[n])
		}
	}
}

func joinFamily(labels []string, values []float64) string {
	parts := make([]string, len(labels))
	for i := range labels {
		parts[i] = fmt.Sprintf("%s %.0f", labels[i], values[i])
	}
	return strings.Join(parts, ", ")
}

// fmtBytes prints n bytes with a binary unit: 0 B, 512 B, 4.0 KiB, 1.5 GiB.
func fmtBytes(n float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
	i := 0
	for n >= 1024 && i < len(units)-1 {
		n /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%.0f B", n)
	}
	return fmt.Sprintf("%.1f %s", n, units[i])
}

// pct is part/whole as a percentage, or "-" when whole is 0.
func pct(part, whole float64) string {
	if whole <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*part/whole)
}
