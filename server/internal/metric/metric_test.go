package metric

import (
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestSampleStatName(t *testing.T) {
	for _, tc := range []struct {
		s    Sample
		want string
	}{
		{Sample{Name: "kvshim_sessions"}, "kvshim_sessions"},
		{Sample{Name: "kvshim_l1_objects", Labels: "state=resident"}, "kvshim_l1_objects{state=resident}"},
		{Sample{Name: "x_total", Labels: "adapter=a,result=ok"}, "x_total{adapter=a,result=ok}"},
	} {
		if got := tc.s.StatName(); got != tc.want {
			t.Errorf("StatName(%+v) = %q; want %q", tc.s, got, tc.want)
		}
	}
}

// A Set exports its atomics' values at scrape time, with their kind,
// labels and the Set's const labels, as the text format shows them.
func TestSetExports(t *testing.T) {
	var hits, depth atomic.Int64
	s := &Set{Const: prometheus.Labels{"adapter": "fs"}}
	s.Add("kvshim_test_hits_total", "Hits.", false, &hits, "op", "lookup", "result", "ok")
	s.Add("kvshim_test_depth", "Depth.", true, &depth)
	reg := prometheus.NewRegistry()
	if err := s.Register(reg); err != nil {
		t.Fatal(err)
	}
	hits.Add(3)
	depth.Store(-2)
	want := `
# HELP kvshim_test_depth Depth.
# TYPE kvshim_test_depth gauge
kvshim_test_depth{adapter="fs"} -2
# HELP kvshim_test_hits_total Hits.
# TYPE kvshim_test_hits_total counter
kvshim_test_hits_total{adapter="fs",op="lookup",result="ok"} 3
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	got := s.Samples()
	if len(got) != 2 || got[0].StatName() != "kvshim_test_hits_total{op=lookup,result=ok}" || got[0].Value != 3 || !got[0].Counter {
		t.Fatalf("Samples = %+v", got)
	}
	// the same const labels twice are refused (two adapters of one name);
	// others are not
	if err := (&Set{Const: prometheus.Labels{"adapter": "fs"}, list: s.list}).Register(reg); err == nil {
		t.Fatal("a second Set with the same names and const labels was registered")
	}
	if err := (&Set{Const: prometheus.Labels{"adapter": "redis"}, list: s.list}).Register(reg); err != nil {
		t.Fatalf("a Set of another adapter: %v", err)
	}
}
