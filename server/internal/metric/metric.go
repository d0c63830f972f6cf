// Package metric is the server's one way of exporting numbers: the code
// keeps each number where it belongs (an atomic, a counter under the
// core's lock) and, at scrape time, a Collector turns a list of Samples
// into Prometheus const metrics. The same Samples answer STATS (ipc
// OpStats, `kvshim stat`), so the two can never disagree. Latency
// histograms are the one exception: they stay live prometheus.Histograms
// (a histogram is not a number to read at scrape time), and STATS reads
// the L2 adapters' one (kvshim_l2_task_seconds) back from the registry as
// count, sum and quantile estimates (server's adapterLatency).
//
// Used by package server (the core's snapshot), server/tier (the L2
// controllers' atomics) and server/l2 (each adapter's counters, its
// backend's own through l2.Sampler: the fs evictions, Redis OOM answers,
// plugin host restarts).
package metric

import (
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Sample is one number at scrape time.
type Sample struct {
	Name, Help string
	Counter    bool    // a counter; else a gauge
	Labels     string  // "k=v,k2=v2" (values hold no ',' or '='), "" for none
	Value      float64 // the number
}

// StatName is how STATS names s: "name" or "name{k=v,k2=v2}".
func (s Sample) StatName() string {
	if s.Labels == "" {
		return s.Name
	}
	return s.Name + "{" + s.Labels + "}"
}

// Collector is a prometheus.Collector exporting the Samples it returns on
// each scrape (one call per scrape: one lock, one consistent snapshot).
type Collector struct {
	Samples func() []Sample
	// Const labels every sample carries (server/l2: adapter=<name>, so
	// that two adapters' collectors differ and one name twice is refused).
	Const prometheus.Labels
}

// Describe implements prometheus.Collector (an unchecked collector would
// need fixed descriptors; these come from the first scrape).
func (c *Collector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	descs := map[string]*prometheus.Desc{}
	for _, s := range c.Samples() {
		var names, values []string
		if s.Labels != "" {
			for _, kv := range strings.Split(s.Labels, ",") {
				k, v, _ := strings.Cut(kv, "=")
				names, values = append(names, k), append(values, v)
			}
		}
		d := descs[s.Name]
		if d == nil {
			d = prometheus.NewDesc(s.Name, s.Help, names, c.Const)
			descs[s.Name] = d
		}
		t := prometheus.GaugeValue
		if s.Counter {
			t = prometheus.CounterValue
		}
		ch <- prometheus.MustNewConstMetric(d, t, s.Value, values...)
	}
}

// Set is a fixed list of atomics exported as Samples: for numbers updated
// on a hot path with no lock.
type Set struct {
	Const prometheus.Labels // as Collector.Const
	list  []entry
}

type entry struct {
	s Sample
	v *atomic.Int64
}

// Add exports v as name (a gauge when gauge, else a counter) with the
// labels kv: "k", "v", "k2", "v2"...
func (c *Set) Add(name, help string, gauge bool, v *atomic.Int64, kv ...string) {
	var l []string
	for i := 0; i+1 < len(kv); i += 2 {
		l = append(l, kv[i]+"="+kv[i+1])
	}
	c.list = append(c.list, entry{s: Sample{Name: name, Help: help, Counter: !gauge, Labels: strings.Join(l, ",")}, v: v})
}

// Samples reads every atomic now.
func (c *Set) Samples() []Sample {
	out := make([]Sample, len(c.list))
	for i, e := range c.list {
		out[i] = e.s
		out[i].Value = float64(e.v.Load())
	}
	return out
}

// Register registers the Set's collector with reg (nil: none).
func (c *Set) Register(reg prometheus.Registerer) error {
	if reg == nil {
		return nil
	}
	return reg.Register(&Collector{Samples: c.Samples, Const: c.Const})
}
