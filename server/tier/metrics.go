package tier

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// counter is one exported number: a labelled atomic read at scrape time.
type counter struct {
	name, help string
	gauge      bool
	labels     []string
	values     []string
	v          *atomic.Int64
}

// collector exports a fixed set of atomics.
type collector struct{ cs []counter }

func (c *collector) add(name, help string, gauge bool, v *atomic.Int64, kv ...string) {
	var ls, vs []string
	for i := 0; i+1 < len(kv); i += 2 {
		ls, vs = append(ls, kv[i]), append(vs, kv[i+1])
	}
	c.cs = append(c.cs, counter{name: name, help: help, gauge: gauge, labels: ls, values: vs, v: v})
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	descs := map[string]*prometheus.Desc{}
	for _, x := range c.cs {
		d := descs[x.name]
		if d == nil {
			d = prometheus.NewDesc(x.name, x.help, x.labels, nil)
			descs[x.name] = d
		}
		t := prometheus.CounterValue
		if x.gauge {
			t = prometheus.GaugeValue
		}
		ch <- prometheus.MustNewConstMetric(d, t, float64(x.v.Load()), x.values...)
	}
}

func register(reg prometheus.Registerer, c *collector) error {
	if reg == nil {
		return nil
	}
	return reg.Register(c)
}

// each calls fn for every number, with its labels as "k=v,k2=v2".
func (c *collector) each(fn func(name, labels string, value float64, isCounter bool)) {
	for _, x := range c.cs {
		l := ""
		for i := range x.labels {
			if i > 0 {
				l += ","
			}
			l += x.labels[i] + "=" + x.values[i]
		}
		fn(x.name, l, float64(x.v.Load()), !x.gauge)
	}
}
