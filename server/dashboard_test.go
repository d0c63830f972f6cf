package server

import (
	"encoding/json"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"

	"gotest.tools/v3/assert"
)

// The Grafana dashboard (deploy/grafana-kvshim.json) asks only for what
// the server exports: every metric name in its PromQL is one the core's
// registry gathers (with an L2 adapter configured, so the L2 metrics
// exist), every label it matches or groups by is one that metric has, and
// every exact label value is one the server emits.

const dashboardPath = "../deploy/grafana-kvshim.json"

// Labels Prometheus adds to every scraped series.
var targetLabels = map[string]bool{"instance": true, "job": true}

// PromQL words that are not metric names.
var promqlFuncs = map[string]bool{"sum": true, "rate": true, "irate": true, "increase": true, "histogram_quantile": true,
	"clamp_min": true, "clamp_max": true, "max": true, "min": true, "avg": true, "count": true, "topk": true,
	"label_values": true, "delta": true, "deriv": true, "abs": true, "max_over_time": true, "avg_over_time": true}
var promqlKeywords = map[string]bool{"by": true, "without": true, "bool": true, "and": true, "or": true, "unless": true,
	"on": true, "ignoring": true, "group_left": true, "group_right": true, "offset": true}

// exported is name → label → values the server emits for it.
type exported map[string]map[string]map[string]bool

func gatherExported(t *testing.T) exported {
	t.Helper()
	dir := t.TempDir()
	st := newCore(t, 4, Options{}, func(c *Config) {
		c.L2Adapters = []string{`{"type": "fs", "base_path": "` + dir + `/l2"}`}
	})
	mfs, err := st.Registry().Gather()
	assert.NilError(t, err)
	out := exported{}
	add := func(name string, labels [][2]string, extra ...string) {
		if out[name] == nil {
			out[name] = map[string]map[string]bool{}
		}
		for _, l := range labels {
			if out[name][l[0]] == nil {
				out[name][l[0]] = map[string]bool{}
			}
			out[name][l[0]][l[1]] = true
		}
		for _, l := range extra {
			if out[name][l] == nil {
				out[name][l] = map[string]bool{}
			}
		}
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels [][2]string
			for _, l := range m.GetLabel() {
				labels = append(labels, [2]string{l.GetName(), l.GetValue()})
			}
			n := mf.GetName()
			if m.GetHistogram() != nil {
				add(n+"_bucket", labels, "le")
				add(n+"_sum", labels)
				add(n+"_count", labels)
				continue
			}
			add(n, labels)
		}
	}
	return out
}

// dashboardQueries are the PromQL texts of the dashboard: every panel
// target (rows' nested panels too) and every templating query.
func dashboardQueries(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(dashboardPath)
	assert.NilError(t, err)
	var d struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	assert.NilError(t, json.Unmarshal(data, &d))
	var qs []string
	var walk func(raw []json.RawMessage)
	walk = func(raw []json.RawMessage) {
		for _, r := range raw {
			var p struct {
				Type    string `json:"type"`
				Title   string `json:"title"`
				Targets []struct {
					Expr string `json:"expr"`
				} `json:"targets"`
				Panels []json.RawMessage `json:"panels"`
			}
			assert.NilError(t, json.Unmarshal(r, &p))
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			assert.Check(t, len(p.Targets) > 0, "panel %q has no query", p.Title)
			for _, tg := range p.Targets {
				assert.Check(t, tg.Expr != "", "panel %q has a target without expr", p.Title)
				qs = append(qs, tg.Expr)
			}
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if json.Unmarshal(v.Query, &q) != nil {
			assert.NilError(t, json.Unmarshal(v.Query, &q.Query))
		}
		qs = append(qs, q.Query)
	}
	return qs
}

var (
	reSelector   = regexp.MustCompile(`([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}`)
	reMatcher    = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"`)
	reGrouping   = regexp.MustCompile(`\b(by|without|on|ignoring)\s*\(([^)]*)\)`)
	reLabelVals  = regexp.MustCompile(`label_values\(\s*([^,]+?)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)`)
	reIdent      = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	reRange      = regexp.MustCompile(`\[[^\]]*\]`)
	reNumber     = regexp.MustCompile(`\b\d+(\.\d+)?(e[-+]?\d+)?\b`)
	reWhitespace = regexp.MustCompile(`\s+`)
)

// checkQuery returns what is wrong with one PromQL text.
func checkQuery(q string, ex exported) []string {
	var bad []string
	var metrics []string
	hasLabel := func(label string) bool {
		if targetLabels[label] {
			return true
		}
		for _, m := range metrics {
			if _, ok := ex[m][label]; ok {
				return true
			}
		}
		return false
	}
	// Metric names: identifiers that are no function, keyword or label.
	body := reLabelVals.ReplaceAllString(q, "$1")
	body = reSelector.ReplaceAllString(body, "$1")
	body = reGrouping.ReplaceAllString(body, "")
	body = reRange.ReplaceAllString(body, "")
	body = reNumber.ReplaceAllString(body, "")
	for _, loc := range reIdent.FindAllStringIndex(body, -1) {
		w := body[loc[0]:loc[1]]
		rest := strings.TrimLeft(body[loc[1]:], " \t\n")
		switch {
		case strings.HasPrefix(rest, "("):
			if !promqlFuncs[w] {
				bad = append(bad, "unknown function "+w)
			}
		case promqlKeywords[w]:
		case ex[w] != nil:
			metrics = append(metrics, w)
		default:
			bad = append(bad, "metric "+w+" is not exported by the server")
		}
	}
	if len(metrics) == 0 {
		bad = append(bad, "names no kvshim metric")
	}
	// Matchers: the metric has the label; an exact value is one it emits.
	for _, m := range reSelector.FindAllStringSubmatch(q, -1) {
		name := m[1]
		if ex[name] == nil {
			continue // reported above
		}
		for _, mt := range reMatcher.FindAllStringSubmatch(m[2], -1) {
			label, op, val := mt[1], mt[2], mt[3]
			if targetLabels[label] {
				continue
			}
			vals, ok := ex[name][label]
			switch {
			case !ok:
				bad = append(bad, name+" has no label "+label)
			case op == "=" && !strings.Contains(val, "$") && !vals[val]:
				bad = append(bad, name+"{"+label+"} is never "+val)
			}
		}
	}
	for _, g := range reGrouping.FindAllStringSubmatch(q, -1) {
		for _, l := range strings.Split(g[2], ",") {
			if l = strings.TrimSpace(l); l != "" && !hasLabel(l) {
				bad = append(bad, g[1]+" ("+l+"): no metric of the query has that label")
			}
		}
	}
	for _, lv := range reLabelVals.FindAllStringSubmatch(q, -1) {
		if !hasLabel(lv[2]) {
			bad = append(bad, "label_values(…, "+lv[2]+"): no such label")
		}
	}
	return bad
}

func TestDashboardQueriesNameExportedMetrics(t *testing.T) {
	ex := gatherExported(t)
	qs := dashboardQueries(t)
	assert.Assert(t, len(qs) > 20, "the dashboard has %d queries", len(qs))
	used := map[string]bool{}
	for _, q := range qs {
		for _, p := range checkQuery(q, ex) {
			t.Errorf("%s\n    in: %s", p, reWhitespace.ReplaceAllString(q, " "))
		}
		for _, w := range reIdent.FindAllString(q, -1) {
			if ex[w] != nil {
				used[w] = true
			}
		}
	}
	// Both halves covered: L1 and L2 metrics are on it.
	var l1, l2 int
	for n := range used {
		if strings.HasPrefix(n, "kvshim_l2_") {
			l2++
		} else {
			l1++
		}
	}
	assert.Check(t, l1 >= 10 && l2 >= 8, "the dashboard uses %d L1/server and %d L2 metrics", l1, l2)
}

// The checker itself catches what it must: a metric the server does not
// export, a label it lacks, a value it never emits, an unknown function.
func TestDashboardCheckerCatches(t *testing.T) {
	ex := gatherExported(t)
	for _, tc := range []struct{ q, want string }{
		{`rate(kvshim_l1_hits_total[5m])`, "metric kvshim_l1_hits_total is not exported"},
		{`sum by (adapter) (kvshim_l1_used_bytes)`, "by (adapter): no metric of the query has that label"},
		{`kvshim_l1_objects{status="resident"}`, "kvshim_l1_objects has no label status"},
		{`kvshim_l1_objects{state="gone"}`, "kvshim_l1_objects{state} is never gone"},
		{`up{job="kvshim"}`, "metric up is not exported"},
		{`rat(kvshim_l1_commits_total[5m])`, "unknown function rat"},
		{`histogram_quantile(0.5, rate(kvshim_server_op_seconds[5m]))`, "metric kvshim_server_op_seconds is not exported"},
	} {
		got := checkQuery(tc.q, ex)
		sort.Strings(got)
		assert.Check(t, strings.Contains(strings.Join(got, "\n"), tc.want), "%s: got %q", tc.q, got)
	}
	assert.Check(t, len(checkQuery(`histogram_quantile(0.99, sum by (le, op) (rate(kvshim_server_op_seconds_bucket{instance=~"$instance", op="lookup"}[5m])))`, ex)) == 0)
}
