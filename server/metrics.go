package server

import (
	"net/http"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/kvshim/kvshim/server/l1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Operation names for the latency histogram's "op" label.
const (
	opAlloc        = "alloc"
	opCommit       = "commit"
	opAbort        = "abort"
	opLookup       = "lookup"
	opLookupResult = "lookup_result"
	opFree         = "free"
	opRetrieve     = "retrieve"
	opRelease      = "release"
	opStats        = "stats"
	opClear        = "clear"
	opReset        = "reset"
)

var opNames = []string{opAlloc, opCommit, opAbort, opLookup, opLookupResult, opFree,
	opRetrieve, opRelease, opStats, opClear, opReset}

// metrics is the core's Prometheus side, on a private registry so several
// stores (tests, embedded + standalone) coexist in one process.
type metrics struct {
	reg     *prometheus.Registry
	latency map[string]prometheus.Observer
	usage   lookupUsage // lookup limits (lookup.go), guarded by Core.mu
}

func newMetrics(core *Core) *metrics {
	m := &metrics{reg: prometheus.NewRegistry(), latency: map[string]prometheus.Observer{},
		usage: lookupUsage{cells: map[*Session]uint64{}}}
	hist := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kvshim_server_op_seconds",
		Help:    "Server-side latency of each operation (store lock included).",
		Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12), // 1 µs … 4 s
	}, []string{"op"})
	for _, op := range opNames {
		m.latency[op] = hist.WithLabelValues(op)
	}
	core.metrics = m                                                    // registering collects a snapshot, which reads m.usage
	m.reg.MustRegister(hist, &metric.Collector{Samples: core.snapshot}) // one lock per scrape
	return m
}

func (m *metrics) observe(op string, start time.Time) {
	m.latency[op].Observe(time.Since(start).Seconds())
}

// Registry is the core's private Prometheus registry.
func (core *Core) Registry() *prometheus.Registry { return core.metrics.reg }

// MetricsHandler serves the core's metrics in the Prometheus text format
// (mount it at /metrics).
func (core *Core) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(core.metrics.reg, promhttp.HandlerOpts{Registry: core.metrics.reg})
}

// HealthHandler answers liveness probes (mount it at /healthz): 200 "ok"
// while the core is open, 503 "closed" once Close has begun.
func (core *Core) HealthHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		core.mu.Lock()
		closed := core.closed
		core.mu.Unlock()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if closed {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("closed\n"))
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
}

// snapshot returns every number of the core, under the lock: exported
// as Prometheus metrics and as STATS entries (labels folded into the name,
// e.g. "kvshim_l1_objects{state=resident}").
func (core *Core) snapshot() []metric.Sample {
	core.mu.Lock()
	defer core.mu.Unlock()
	a := core.l1.Stats()
	c := &core.cnt
	g := func(name, help string, v uint64) metric.Sample {
		return metric.Sample{Name: name, Help: help, Value: float64(v)}
	}
	k := func(name, help string, v uint64) metric.Sample {
		return metric.Sample{Name: name, Help: help, Counter: true, Value: float64(v)}
	}
	out := []metric.Sample{
		g("kvshim_l1_capacity_bytes", "L1 size limit.", a.Capacity),
		g("kvshim_l1_mapped_bytes", "Bytes of L1 segments created so far.", a.Mapped),
		g("kvshim_l1_used_bytes", "Bytes of L1 slots holding objects (4 KiB rounded); watermarks apply to it.", a.Used),
		g("kvshim_l1_used_max_bytes", "High-water mark of kvshim_l1_used_bytes since start.", a.MaxUsed),
		g("kvshim_l1_prefetch_bytes", "L1 slot bytes of prefetch staging and temporary objects (the prefetch budget counts them).", a.PrefetchBytes),
		g("kvshim_l1_pinned", "Holds owned by the L2 store controller (objects being written to L2).", c.pins),
		g("kvshim_l1_slab_bytes", "Bytes of L1 carved into slabs.", a.Slab),
		g("kvshim_l1_segments", "L1 segments.", uint64(a.Segments)),
		g("kvshim_l1_slabs", "L1 slabs.", uint64(a.Slabs)),
		g("kvshim_l1_size_classes", "L1 slab size classes in use.", uint64(a.Classes)),
		g("kvshim_l1_holds", "Read holds outstanding.", a.Holds),
		g("kvshim_lookups_live", "Lookups registered and not yet forgotten.", c.lookupsNow),
		g("kvshim_lookups_pending", "Lookups waiting for a fill.", c.pending),
		g("kvshim_lookup_cells", "Hold-table cells (chunks × readers) of live lookups; each session's are bounded by --max-lookup-cells-per-session.", core.metrics.usage.total),
		g("kvshim_sessions", "Connected sessions.", uint64(len(core.sessions))),
		k("kvshim_lookups_total", "Lookups registered.", c.lookups),
		k("kvshim_lookup_hit_chunks_total", "Chunks answered present on every rank.", c.hitChunks),
		k("kvshim_lookup_missed_chunks_total", "Chunks beyond the answered prefix.", c.missedChunks),
		k("kvshim_l1_evictions_total", "Objects evicted (LRU).", a.Evictions),
		k("kvshim_l1_evicted_bytes_total", "Bytes evicted (LRU).", a.EvictedBytes),
		k("kvshim_l1_discarded_total", "Committed copies discarded because the key was already resident.", a.Discarded),
		k("kvshim_l1_commits_total", "Staging objects committed.", c.commits),
		k("kvshim_l1_aborts_total", "Staging objects aborted.", c.aborts),
		k("kvshim_l1_ttl_reclaimed_holds_total", "Holds reclaimed by the hold TTL.", c.ttlHolds),
		k("kvshim_l1_ttl_reclaimed_staging_total", "Staging objects reclaimed by the staging TTL.", c.ttlStaging),
		k("kvshim_l1_cleared_objects_total", "Objects dropped by CLEAR or a reset.", c.cleared),
		k("kvshim_l2_store_admitted_by_lookups_total", "Objects handed to the L2 writer once --l2-store-after-lookups lookups found them.", c.admittedL2),
		k("kvshim_resets_total", "Namespaces reset (a new generation: every chunk stored before misses).", c.resets),
		k("kvshim_l1_segment_errors_total", "Failures to obtain a new L1 segment.", a.SegmentErrors),
		k("kvshim_sessions_opened_total", "Sessions opened.", c.sessionsOpened),
		k("kvshim_sessions_closed_total", "Sessions closed.", c.sessionsClosed),
		{Name: "kvshim_l1_fences_lifted_total", Counter: true, Help: "Ended sessions whose fenced staging slots were freed, by what proved the writer done.", Labels: "by=exit", Value: float64(c.fencesExited)},
		{Name: "kvshim_l1_fences_lifted_total", Counter: true, Help: "Ended sessions whose fenced staging slots were freed, by what proved the writer done.", Labels: "by=drained", Value: float64(c.fencesDrained)},
	}
	for s := l1.Staging; s < l1.NumStates; s++ {
		out = append(out,
			metric.Sample{Name: "kvshim_l1_objects", Help: "L1 objects by state.", Labels: "state=" + s.String(), Value: float64(a.Objects[s])},
			metric.Sample{Name: "kvshim_l1_object_bytes", Help: "Requested bytes of L1 objects by state.", Labels: "state=" + s.String(), Value: float64(a.ObjectBytes[s])})
	}
	for l, v := range core.metrics.usage.rejected {
		out = append(out, metric.Sample{Name: "kvshim_lookups_rejected_total", Counter: true, Labels: "limit=" + lookupLimitNames[l], Value: float64(v),
			Help: "LOOKUPs refused (StatusBadRequest) because the session was at a limit: lookups = --max-lookups-per-session, cells = --max-lookup-cells-per-session."})
	}
	frag := func(kind string, v uint64) metric.Sample {
		return metric.Sample{Name: "kvshim_l1_fragmentation_bytes", Labels: "kind=" + kind, Value: float64(v),
			Help: "L1 bytes lost to fragmentation: rounding = slot padding to 4 KiB; slab_free = free slots inside slabs."}
	}
	out = append(out, frag("rounding", a.Used-a.Requested), frag("slab_free", a.Slab-a.Used))
	for _, r := range []struct {
		name string
		v    uint64
	}{{"ok", c.allocOK}, {"resident", c.allocResident}, {"in_progress", c.allocInProgress}, {"no_space", c.allocNoSpace}} {
		out = append(out, metric.Sample{Name: "kvshim_l1_alloc_keys_total", Help: "ALLOC keys by outcome.",
			Counter: true, Labels: "status=" + r.name, Value: float64(r.v)})
	}
	return out
}

// stats is the snapshot plus the L2 controllers' and adapters' numbers
// (their Prometheus collectors are registered separately): the adapters'
// Samples, their backends' included (l2.Sampler), and their latency
// histograms' summaries (adapterLatency).
func (core *Core) stats() []metric.Sample {
	out := core.snapshot()
	if core.tier != nil {
		out = append(out, core.tier.wr.Samples()...)
		out = append(out, core.tier.pc.Samples()...)
		for _, a := range core.tier.adapters {
			out = append(out, a.Samples()...)
		}
		out = append(out, core.adapterLatency()...)
	}
	return out
}

// Stats answers OpStats with the same numbers the metrics export,
// including the L2 controllers'. Labelled metrics are named
// "name{key=value}" ("name{k=v,k2=v2}" with two labels).
func (core *Core) Stats(s *Session) (*ipc.StatsResp, error) {
	defer core.metrics.observe(opStats, time.Now())
	snap := core.stats()
	core.mu.Lock()
	err := core.check(s)
	core.mu.Unlock()
	if err != nil {
		return nil, err
	}
	resp := &ipc.StatsResp{Stats: make([]ipc.Stat, len(snap))}
	for i, x := range snap {
		resp.Stats[i] = ipc.Stat{Name: x.StatName(), Value: x.Value}
	}
	return resp, nil
}

// Stat returns one STATS value by name (as Stats names it), for tests and
// callers in the same process; ok is false for an unknown name.
func (core *Core) Stat(name string) (v float64, ok bool) {
	for _, x := range core.stats() {
		if x.StatName() == name {
			return x.Value, true
		}
	}
	return 0, false
}
