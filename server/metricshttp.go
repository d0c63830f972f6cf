package server

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvshim/kvshim/ipc"
)

// BuildInfo is what kvshim_build_info{version,abi,protocol} reports.
type BuildInfo struct {
	Version string // "" is reported as "unknown"
	ABI     int    // the C ABI of libkvshim.so
}

// MetricsServer is the HTTP listener of `kvshim serve --metrics-port` and
// of the embedded server's kvshim.metrics_port: /metrics (the store's
// metrics, the Go runtime and process collectors, kvshim_build_info) and
// /healthz (Store.HealthHandler).
type MetricsServer struct {
	hs   *http.Server
	addr string
	errc chan error
}

// ServeMetrics serves the store's metrics endpoint on ln until Close.
func (st *Store) ServeMetrics(ln net.Listener, bi BuildInfo) *MetricsServer {
	proc := prometheus.NewRegistry()
	version := bi.Version
	if version == "" {
		version = "unknown"
	}
	build := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvshim_build_info",
		Help: "Always 1; the labels name this build: version, C ABI and wire protocol.",
		ConstLabels: prometheus.Labels{"version": version, "abi": strconv.Itoa(bi.ABI),
			"protocol": strconv.Itoa(int(ipc.ProtocolVersion))}})
	build.Set(1)
	proc.MustRegister(build, collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	g := prometheus.Gatherers{st.metrics.reg, proc}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{Registry: proc}))
	mux.Handle("/healthz", st.HealthHandler())
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
