package cli

import (
	"fmt"
	"io"
	"sort"
	"strconv"
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
	printAdapters(r, line)

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

// labelled is one number of a family: its full STATS name and labels.
type labelled struct {
	stat   string
	labels map[string]string
}

// series returns the numbers of the family name, in the server's order.
func (r *statReader) series(name string) []labelled {
	var out []labelled
	for _, n := range r.s.order {
		base, ls := splitStatName(n)
		if base != name || ls == nil {
			continue
		}
		m := map[string]string{}
		for _, l := range ls {
			m[l[0]] = l[1]
		}
		out = append(out, labelled{n, m})
	}
	return out
}

// sum adds the numbers of family name whose labels include want (all of
// them), marking them used; ok is false when none matched.
func (r *statReader) sum(name string, want map[string]string) (v float64, ok bool) {
next:
	for _, x := range r.series(name) {
		for k, w := range want {
			if x.labels[k] != w {
				continue next
			}
		}
		v += r.get(x.stat)
		ok = true
	}
	return v, ok
}

// printAdapters prints one block per L2 adapter, by name: what the L2
// store and prefetch controllers did with it (objects saved, chunks
// loaded, missed, failed or rejected), its errors by operation and its
// latency by operation (p50 and p99 estimated from the histogram, mean).
func printAdapters(r *statReader, line func(topic, f string, a ...any)) {
	var names []string
	seen := map[string]bool{}
	for _, fam := range []string{"kvshim_l2_store_saved_objects_total", "kvshim_l2_prefetch_chunks_total",
		"kvshim_l2_errors_total", "kvshim_l2_task_seconds_count"} {
		for _, x := range r.series(fam) {
			if a, ok := x.labels["adapter"]; ok && !seen[a] {
				seen[a] = true
				names = append(names, a)
			}
		}
	}
	for _, a := range names {
		by := map[string]string{"adapter": a}
		saved, _ := r.sum("kvshim_l2_store_saved_objects_total", by)
		savedB, _ := r.sum("kvshim_l2_store_saved_bytes_total", by)
		werr, _ := r.sum("kvshim_l2_store_errors_total", by)
		chunk := func(res string) float64 {
			v, _ := r.sum("kvshim_l2_prefetch_chunks_total", map[string]string{"adapter": a, "result": res})
			return v
		}
		loadedB, _ := r.sum("kvshim_l2_prefetch_bytes_total", by)
		line("L2 adapter", "%s: saved %.0f objects (%s), %.0f write errors; loaded %.0f chunks (%s), %.0f missed, %.0f failed, %.0f rejected",
			a, saved, fmtBytes(savedB), werr, chunk("ok"), fmtBytes(loadedB), chunk("miss"), chunk("failed"), chunk("rejected"))
		r.sum("kvshim_l2_prefetch_key_mismatches_total", by) // counted in rejected
		if v, _ := r.sum("kvshim_l2_prefetch_rejected_deletes_total", map[string]string{"adapter": a, "result": "failed"}); v > 0 {
			line("", "%s: %.0f deletes of rejected objects failed", a, v)
		}
		r.sum("kvshim_l2_prefetch_rejected_deletes_total", by)
		var errs []string
		for _, x := range r.series("kvshim_l2_errors_total") {
			if x.labels["adapter"] == a {
				errs = append(errs, fmt.Sprintf("%s %.0f", x.labels["op"], r.get(x.stat)))
			}
		}
		if len(errs) > 0 {
			line("", "%s errors: %s", a, strings.Join(errs, ", "))
		}
		var lat []string
		for _, x := range r.series("kvshim_l2_task_seconds_count") {
			if x.labels["adapter"] != a {
				continue
			}
			op := x.labels["op"]
			opBy := map[string]string{"adapter": a, "op": op}
			n := r.get(x.stat)
			total, _ := r.sum("kvshim_l2_task_seconds_sum", opBy)
			p50, _ := r.sum("kvshim_l2_task_seconds", map[string]string{"adapter": a, "op": op, "quantile": "0.5"})
			p99, _ := r.sum("kvshim_l2_task_seconds", map[string]string{"adapter": a, "op": op, "quantile": "0.99"})
			if n == 0 {
				continue
			}
			lat = append(lat, fmt.Sprintf("%s p50 %v, p99 %v, mean %v (%.0f tasks)", op,
				dur(p50), dur(p99), dur(total/n), n))
		}
		if len(lat) > 0 {
			line("", "%s latency: %s", a, strings.Join(lat, "; "))
		}
		// Work under way, when there is some.
		queued, _ := r.sum("kvshim_l2_queue_depth", by)
		inflight, _ := r.sum("kvshim_l2_inflight_tasks", by)
		held, _ := r.sum("kvshim_l2_held_keys", by)
		if queued+inflight+held > 0 {
			line("", "%s now: %.0f tiles queued, %.0f batches in flight, %.0f keys held", a, queued, inflight, held)
		}
		// The rest of the adapter's families are read here and shown above.
		r.sum("kvshim_l2_keys_total", by)
		r.sum("kvshim_l2_bytes_total", by)
		r.sum("kvshim_l2_tasks_total", by)
		r.sum("kvshim_l2_lane_workers", by)
		r.sum("kvshim_l2_task_seconds", by)
		r.sum("kvshim_l2_task_seconds_sum", by)
		r.sum("kvshim_l2_task_seconds_count", by)
		// Its backend's own numbers (kvshim_l2_<type>_...: fs evictions,
		// Redis OOM answers, plugin host restarts), as they are.
		if own := adapterOwn(r, a); len(own) > 0 {
			line("", "%s: %s", a, strings.Join(own, ", "))
		}
	}
}

// adapterOwn reads the kvshim_l2_* numbers of adapter a not read yet, as
// "name value" without the kvshim_l2_ prefix and the adapter label.
func adapterOwn(r *statReader, a string) []string {
	var out []string
	for _, n := range r.s.order {
		base, ls := splitStatName(n)
		rest, ok := strings.CutPrefix(base, "kvshim_l2_")
		if r.used[n] || !ok {
			continue
		}
		mine := false
		var other []string
		for _, l := range ls {
			if l[0] == "adapter" {
				mine = l[1] == a
				continue
			}
			other = append(other, l[0]+"="+l[1])
		}
		if !mine {
			continue
		}
		if len(other) > 0 {
			rest += "{" + strings.Join(other, ",") + "}"
		}
		out = append(out, rest+" "+strconv.FormatFloat(r.get(n), 'f', -1, 64))
	}
	return out
}

// dur is seconds as a duration rounded to 3 significant digits.
func dur(sec float64) time.Duration {
	d := time.Duration(sec * float64(time.Second))
	p := time.Duration(1)
	for d/p >= 1000 {
		p *= 10
	}
	return d.Round(p)
}
