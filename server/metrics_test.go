package server

import (
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	"gotest.tools/v3/assert"
)

func TestMetricsHandlerAndStatsAgree(t *testing.T) {
	a := newCore(t, 4, Options{})
	b := newCore(t, 4, Options{}) // a second store in one process: private registries
	s := open(t, a, 0)
	hs := hashes("m", 3)
	save(t, a, s, 1, 0, hs)
	lookupNow(t, a, s, 1, 1, false, hs)
	srv := httptest.NewServer(a.MetricsHandler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	assert.NilError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	text := string(body)
	for _, want := range []string{
		"kvshim_l1_used_bytes 24576",
		`kvshim_l1_objects{state="resident"} 3`,
		"kvshim_l1_holds 3",
		"kvshim_lookup_hit_chunks_total 3",
		"kvshim_sessions 1",
		`kvshim_server_op_seconds_count{op="lookup"} 1`,
		`kvshim_l1_fragmentation_bytes{kind="slab_free"}`,
	} {
		assert.Assert(t, strings.Contains(text, want), "missing %q in:\n%s", want, text)
	}
	st, err := a.Stats(s)
	assert.NilError(t, err)
	names := map[string]float64{}
	for _, x := range st.Stats {
		names[x.Name] = x.Value
	}
	assert.Equal(t, names["kvshim_l1_used_bytes"], 24576.0)
	assert.Equal(t, names["kvshim_l1_objects{state=resident}"], 3.0)
	assert.Equal(t, stat(t, b, "kvshim_l1_used_bytes"), 0.0)
}
