package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/internal/metric"
)

// BuildInfo is what kvshim_build_info{version,abi,protocol} reports.
type BuildInfo struct {
	Version string // "" is reported as "unknown"
	ABI     int    // the C ABI of libkvshim.so: MAJOR*1000 + MINOR (kvshim_abi_version)
}

// MetricsServer is the HTTP listener of `kvshim serve --metrics-port` and
// of the embedded server's kvshim.metrics_port: /metrics (the core's
// metrics, the Go runtime and process collectors, kvshim_build_info) and
// /healthz (Core.HealthHandler).
type MetricsServer struct {
	hs   *http.Server
	addr string
	errc chan error
}

// ServeMetrics serves the core's metrics endpoint on ln until Close.
func (core *Core) ServeMetrics(ln net.Listener, bi BuildInfo) *MetricsServer {
	proc := prometheus.NewRegistry()
	version := bi.Version
	if version == "" {
		version = "unknown"
	}
	build := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvshim_build_info",
		Help: "Always 1; the labels name this build: version, C ABI and wire protocol.",
		ConstLabels: prometheus.Labels{"version": version, "abi": fmt.Sprintf("%d.%d", bi.ABI/1000, bi.ABI%1000), // MAJOR.MINOR
			"protocol": strconv.Itoa(int(ipc.ProtocolVersion))}})
	build.Set(1)
	proc.MustRegister(build, collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	g := prometheus.Gatherers{core.metrics.reg, proc}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{Registry: proc}))
	mux.Handle("/healthz", core.HealthHandler())
	m := &MetricsServer{hs: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second},
		addr: ln.Addr().String(), errc: make(chan error, 1)}
	go func() {
		err := m.hs.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		m.errc <- err
	}()
	return m
}

// URL is the metrics endpoint, http://ADDR/metrics.
func (m *MetricsServer) URL() string { return "http://" + m.addr + "/metrics" }

// Failed delivers the listener's error if it stops before Close.
func (m *MetricsServer) Failed() <-chan error { return m.errc }

// Close stops the listener, waiting at most 2 s for scrapes in flight.
func (m *MetricsServer) Close() error {
	if m == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return m.hs.Shutdown(ctx)
}

// adapterLatency is the one STATS path that reads the registry rather than
// Samples: an adapter's latency histogram (kvshim_l2_task_seconds) is a
// live prometheus.Histogram, the exception server/internal/metric's doc
// names, so its buckets exist only as what the registry gathers. STATS
// carries it as _count, _sum and {quantile=0.5|0.99} estimates (linear
// within the bucket), so that `kvshim stat` shows each adapter's latency.
// The adapters' counters and gauges come from Adapter.Samples, as they
// reach /metrics. Labels are "k=v" joined by ",", in the registry's
// (sorted) order: adapter, op.
func (core *Core) adapterLatency() []metric.Sample {
	const family = "kvshim_l2_task_seconds"
	fams, err := core.metrics.reg.Gather()
	if err != nil && len(fams) == 0 {
		return nil
	}
	var out []metric.Sample
	for _, f := range fams {
		if f.GetName() != family {
			continue
		}
		for _, m := range f.GetMetric() {
			h := m.GetHistogram()
			if h == nil {
				continue
			}
			var l []string
			for _, p := range m.GetLabel() {
				l = append(l, p.GetName()+"="+p.GetValue())
			}
			labels := strings.Join(l, ",")
			out = append(out,
				metric.Sample{Name: family + "_count", Labels: labels, Value: float64(h.GetSampleCount()), Counter: true},
				metric.Sample{Name: family + "_sum", Labels: labels, Value: h.GetSampleSum(), Counter: true})
			for _, q := range statQuantiles {
				out = append(out, metric.Sample{Name: family, Labels: labels + ",quantile=" + strconv.FormatFloat(q, 'g', -1, 64),
					Value: bucketQuantile(q, h)})
			}
		}
	}
	return out
}

// statQuantiles are the latency quantiles STATS estimates from an
// adapter's histogram buckets.
var statQuantiles = []float64{0.5, 0.99}

// bucketQuantile estimates quantile q of a histogram from its cumulative
// buckets (as Prometheus' histogram_quantile does); 0 when it is empty.
func bucketQuantile(q float64, h *dto.Histogram) float64 {
	n := float64(h.GetSampleCount())
	if n == 0 {
		return 0
	}
	rank := q * n
	lower, below := 0.0, 0.0
	for _, b := range h.GetBucket() {
		upper, cum := b.GetUpperBound(), float64(b.GetCumulativeCount())
		if cum >= rank {
			if cum == below {
				return upper
			}
			return lower + (upper-lower)*(rank-below)/(cum-below)
		}
		lower, below = upper, cum
	}
	return lower // past the last finite bucket: its bound
}
