package l2

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are one adapter's Prometheus collectors; every series carries the
// const label adapter=<Config.Name>, and op=<lane> where it applies.
type metrics struct {
	tasks     *prometheus.CounterVec   // kvshim_l2_tasks_total{op}
	keys      *prometheus.CounterVec   // kvshim_l2_keys_total{op,result}
	bytes     *prometheus.CounterVec   // kvshim_l2_bytes_total{op}
	errors    *prometheus.CounterVec   // kvshim_l2_errors_total{op}
	latency   *prometheus.HistogramVec // kvshim_l2_task_seconds{op}
	queueWait *prometheus.HistogramVec // kvshim_l2_queue_wait_seconds{op}
	depth     *prometheus.GaugeVec     // kvshim_l2_queue_depth{op}
	inflight  *prometheus.GaugeVec     // kvshim_l2_inflight_tasks{op}
	workers   *prometheus.GaugeVec     // kvshim_l2_lane_workers{op}
	holds     prometheus.Gauge         // kvshim_l2_held_keys

	// cached children, so the hot path does no label lookups
	keysC    [numOps][3]prometheus.Counter
	bytesC   [numOps]prometheus.Counter
	errorsC  [numOps]prometheus.Counter
	latencyO [numOps]prometheus.Observer
	waitO    [numOps]prometheus.Observer
	depthG   [numOps]prometheus.Gauge
	inflG    [numOps]prometheus.Gauge
	tasksC   [numOps]prometheus.Counter
}

// latencyBuckets span 50 µs .. ~26 s.
var latencyBuckets = prometheus.ExponentialBuckets(50e-6, 2, 20)

func newMetrics(name string, reg prometheus.Registerer, lanes LaneConfig) (*metrics, error) {
	cl := prometheus.Labels{"adapter": name}
	m := &metrics{
		tasks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvshim_l2_tasks_total",
			Help: "L2 batch operations submitted.", ConstLabels: cl}, []string{"op"}),
		keys: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvshim_l2_keys_total",
			Help: "L2 keys by final result (ok, miss, failed).", ConstLabels: cl}, []string{"op", "result"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvshim_l2_bytes_total",
			Help: "Payload bytes stored or loaded.", ConstLabels: cl}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvshim_l2_errors_total",
			Help: "Keys whose operation failed.", ConstLabels: cl}, []string{"op"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvshim_l2_task_seconds",
			Help: "Batch latency, submission to last key final.", ConstLabels: cl, Buckets: latencyBuckets}, []string{"op"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvshim_l2_queue_wait_seconds",
			Help: "Time a tile waited in its lane queue.", ConstLabels: cl, Buckets: latencyBuckets}, []string{"op"}),
		depth: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvshim_l2_queue_depth",
			Help: "Tiles waiting in the lane queue.", ConstLabels: cl}, []string{"op"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvshim_l2_inflight_tasks",
			Help: "Batches submitted and not yet final.", ConstLabels: cl}, []string{"op"}),
		workers: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvshim_l2_lane_workers",
			Help: "Workers serving the op (shared pool size for ops without a dedicated lane).", ConstLabels: cl}, []string{"op"}),
		holds: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvshim_l2_held_keys",
			Help: "Keys with at least one lookup hold.", ConstLabels: cl}),
	}
	for op := Op(0); op < numOps; op++ {
		s := op.String()
		for st := StatusFailed; st <= StatusMiss; st++ {
			m.keysC[op][st] = m.keys.WithLabelValues(s, st.String())
		}
		m.bytesC[op] = m.bytes.WithLabelValues(s)
		m.errorsC[op] = m.errors.WithLabelValues(s)
		m.latencyO[op] = m.latency.WithLabelValues(s)
		m.waitO[op] = m.queueWait.WithLabelValues(s)
		m.depthG[op] = m.depth.WithLabelValues(s)
		m.inflG[op] = m.inflight.WithLabelValues(s)
		m.tasksC[op] = m.tasks.WithLabelValues(s)
		m.workers.WithLabelValues(s).Set(float64(lanes.Workers(op)))
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.tasks, m.keys, m.bytes, m.errors, m.latency,
			m.queueWait, m.depth, m.inflight, m.workers, m.holds} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *metrics) key(op Op, r Result) {
	m.keysC[op][r.Status].Inc()
	if r.Status == StatusFailed {
		m.errorsC[op].Inc()
	}
	if r.Status == StatusOK && (op == OpStore || op == OpRetrieve) {
		m.bytesC[op].Add(float64(r.Bytes))
	}
}

func (m *metrics) depthAdd(op Op, d float64)     { m.depthG[op].Add(d) }
func (m *metrics) waited(op Op, d time.Duration) { m.waitO[op].Observe(d.Seconds()) }
func (m *metrics) taskDone(op Op, d time.Duration) {
	m.latencyO[op].Observe(d.Seconds())
	m.inflG[op].Dec()
}
func (m *metrics) taskStart(op Op) { m.tasksC[op].Inc(); m.inflG[op].Inc() }
