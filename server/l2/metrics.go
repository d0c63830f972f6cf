package l2

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvshim/kvshim/server/internal/metric"
)

// metrics are one adapter's numbers, in the server's one style
// (server/internal/metric): atomics exported at scrape time, the latency
// histograms live. Every series carries the const label
// adapter=<Config.Name>, and op=<lane> where it applies.
type metrics struct {
	set      metric.Set
	backend  func() []metric.Sample  // the backend's own numbers (Sampler); nil: none
	tasks    [numOps]atomic.Int64    // kvshim_l2_tasks_total{op}
	keys     [numOps][3]atomic.Int64 // kvshim_l2_keys_total{op,result}, by Status
	bytes    [numOps]atomic.Int64    // kvshim_l2_bytes_total{op}
	errors   [numOps]atomic.Int64    // kvshim_l2_errors_total{op}
	depth    [numOps]atomic.Int64    // kvshim_l2_queue_depth{op}
	inflight [numOps]atomic.Int64    // kvshim_l2_inflight_tasks{op}
	workers  [numOps]atomic.Int64    // kvshim_l2_lane_workers{op}
	holds    atomic.Int64            // kvshim_l2_held_keys

	latency   *prometheus.HistogramVec // kvshim_l2_task_seconds{op}
	queueWait *prometheus.HistogramVec // kvshim_l2_queue_wait_seconds{op}
	// cached children, so the hot path does no label lookups
	latencyO [numOps]prometheus.Observer
	waitO    [numOps]prometheus.Observer
}

// latencyBuckets span 50 µs .. ~26 s.
var latencyBuckets = prometheus.ExponentialBuckets(50e-6, 2, 20)

func newMetrics(name string, reg prometheus.Registerer, lanes LaneConfig, b Backend) (*metrics, error) {
	cl := prometheus.Labels{"adapter": name}
	m := &metrics{
		set: metric.Set{Const: cl},
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvshim_l2_task_seconds",
			Help: "Batch latency, submission to last key final.", ConstLabels: cl, Buckets: latencyBuckets}, []string{"op"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvshim_l2_queue_wait_seconds",
			Help: "Time a tile waited in its lane queue.", ConstLabels: cl, Buckets: latencyBuckets}, []string{"op"}),
	}
	const counter, gauge = false, true
	for op := Op(0); op < numOps; op++ {
		s := op.String()
		m.set.Add("kvshim_l2_tasks_total", "L2 batch operations submitted.", counter, &m.tasks[op], "op", s)
		for st := StatusFailed; st <= StatusMiss; st++ {
			m.set.Add("kvshim_l2_keys_total", "L2 keys by final result (ok, miss, failed).", counter, &m.keys[op][st],
				"op", s, "result", st.String())
		}
		m.set.Add("kvshim_l2_bytes_total", "Payload bytes stored or loaded.", counter, &m.bytes[op], "op", s)
		m.set.Add("kvshim_l2_errors_total", "Keys whose operation failed.", counter, &m.errors[op], "op", s)
		m.set.Add("kvshim_l2_queue_depth", "Tiles waiting in the lane queue.", gauge, &m.depth[op], "op", s)
		m.set.Add("kvshim_l2_inflight_tasks", "Batches submitted and not yet final.", gauge, &m.inflight[op], "op", s)
		m.set.Add("kvshim_l2_lane_workers", "Workers serving the op (shared pool size for ops without a dedicated lane).",
			gauge, &m.workers[op], "op", s)
		m.latencyO[op] = m.latency.WithLabelValues(s)
		m.waitO[op] = m.queueWait.WithLabelValues(s)
		m.workers[op].Store(int64(lanes.Workers(op)))
	}
	m.set.Add("kvshim_l2_held_keys", "Keys with at least one lookup hold.", gauge, &m.holds)
	if s, ok := b.(Sampler); ok {
		m.backend = s.Samples
	}
	if reg != nil {
		if err := reg.Register(&metric.Collector{Samples: m.samples, Const: cl}); err != nil {
			return nil, err
		}
		for _, c := range []prometheus.Collector{m.latency, m.queueWait} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

// samples are the adapter's numbers and its backend's, now (without the
// const label adapter=<name>).
func (m *metrics) samples() []metric.Sample {
	out := m.set.Samples()
	if m.backend != nil {
		out = append(out, m.backend()...)
	}
	return out
}

func (m *metrics) key(op Op, r Result) {
	m.keys[op][r.Status].Add(1)
	if r.Status == StatusFailed {
		m.errors[op].Add(1)
	}
	if r.Status == StatusOK && (op == OpStore || op == OpRetrieve) {
		m.bytes[op].Add(int64(r.Bytes))
	}
}

func (m *metrics) depthAdd(op Op, d float64)     { m.depth[op].Add(int64(d)) }
func (m *metrics) waited(op Op, d time.Duration) { m.waitO[op].Observe(d.Seconds()) }
func (m *metrics) taskDone(op Op, d time.Duration) {
	m.latencyO[op].Observe(d.Seconds())
	m.inflight[op].Add(-1)
}
func (m *metrics) taskStart(op Op) { m.tasks[op].Add(1); m.inflight[op].Add(1) }
