package main

import (
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvshim/kvshim/export/connector"
	"github.com/kvshim/kvshim/export/schema"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/shim"
)

// jsonFields are the JSON names encoding/json gives t's fields.
func jsonFields(t reflect.Type) []string {
	var out []string
	for f := range t.Fields() {
		name := f.Name
		if tag := f.Tag.Get("json"); tag != "" {
			name, _, _ = strings.Cut(tag, ",")
		}
		if name != "-" {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// The schemas and the Go structs that decode or encode the documents name
// the same fields: a field added on one side only fails here.
func TestSchemaFieldsMatchGoStructs(t *testing.T) {
	for _, tc := range []struct {
		schema string
		path   []string
		goType reflect.Type
		extra  []string // keys the schema has that the struct gets elsewhere
	}{
		{"open.json", nil, reflect.TypeFor[connector.Config](), nil},
		{"open.json", []string{"$defs", "namespace"}, reflect.TypeFor[connector.Namespace](), nil},
		{"tensors.json", []string{"items"}, reflect.TypeFor[layout.TensorDesc](), nil},
		{"poll.json", nil, reflect.TypeFor[pollJSON](), nil},
		{"stats.json", []string{"$defs", "worker"}, reflect.TypeFor[shim.WorkerStats](), nil},
		{"vllm_config.json", nil, reflect.TypeFor[connector.VLLMIn](), nil},
		{"vllm_config.json", []string{"$defs", "out"}, reflect.TypeFor[connector.VLLMOut](), nil},
		{"vllm_config.json", []string{"$defs", "settings"}, reflect.TypeFor[connector.Settings](), nil},
		{"vllm_tensors.json", nil, reflect.TypeFor[shim.VLLMTensorsIn](), nil},
		{"vllm_tensors.json", []string{"$defs", "group"}, reflect.TypeFor[shim.VLLMGroup](), nil},
		{"vllm_tensors.json", []string{"$defs", "tensor"}, reflect.TypeFor[shim.VLLMTensor](), nil},
	} {
		props, err := schema.Properties(tc.schema, tc.path...)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(props)
		want := jsonFields(tc.goType)
		if !slices.Equal(props, want) {
			t.Errorf("%s %v: schema properties %v; %s has %v", tc.schema, tc.path, props, tc.goType, want)
		}
	}
}

// Every documented example matches its schema.
func TestSchemaExamplesValid(t *testing.T) {
	for _, n := range schema.Names {
		ex, err := schema.Examples(n)
		if err != nil {
			t.Fatal(err)
		}
		if len(ex) == 0 {
			t.Errorf("%s has no examples", n)
		}
		for i, e := range ex {
			if err := schema.Validate(n, e); err != nil {
				t.Errorf("%s example %d: %v", n, i, err)
			}
		}
	}
}

// What Go emits matches: the poll result with nothing to report (lists
// were null before encodePoll) and with something, and both stats shapes.
func TestGoOutputMatchesSchema(t *testing.T) {
	mustJSON := func(v any) []byte {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name, schema string
		doc          []byte
	}{
		{"poll, nothing", "poll.json", encodePoll(nil, nil, nil, nil)},
		{"poll, all", "poll.json", encodePoll([]string{"a"}, []string{"b"}, []int64{3}, []string{"b"})},
		{"stats, scheduler", "stats.json", mustJSON(schedStatsDoc(2, &ipc.StatsResp{Stats: []ipc.Stat{
			{Name: "kvshim_sessions", Value: 2}, {Name: "kvshim_l1_objects{state=resident}", Value: 7}}}, nil))},
		{"stats, scheduler, no server", "stats.json", mustJSON(schedStatsDoc(0, nil, errors.New("connection refused")))},
		{"stats, worker", "stats.json", mustJSON(workerStatsDoc(shim.WorkerStats{SavedChunks: 1, PopulatePending: 2}, 3))},
		{"step stats, worker", "step_stats.json", mustJSON(shim.WorkerStats{SavedChunks: 1, PopulatePending: 2}.Counters())},
	} {
		if err := schema.Validate(tc.schema, tc.doc); err != nil {
			t.Errorf("%s: %s: %v", tc.name, tc.doc, err)
		}
	}
	// what json.Marshal writes for nil lists is refused: the schema is strict
	null := `{"sending":null,"recving":[],"error_blocks":[],"failed":[]}`
	if err := schema.Validate("poll.json", []byte(null)); !errors.Is(err, schema.ErrInvalid) {
		t.Errorf("%s: %v; want ErrInvalid", null, err)
	}
}

// The open schema and Go's own checks (connector.Parse) agree on which
// configs are refused: another engine reading the schema is refused by
// the library for the same reasons.
func TestOpenSchemaAgreesWithParse(t *testing.T) {
	for _, tc := range []struct {
		doc   string
		valid bool
	}{
		{`{"role":"worker","server":"/tmp/k.sock","rank":1}`, true},
		{`{"role":"scheduler","server":"/tmp/k.sock","l1_size_gb":-1}`, false},
		{`{"role":"scheduler","server":"/tmp/k.sock","hold_ttl_s":-1}`, false},
		{`{"role":"scheduler","server":"/tmp/k.sock","timeout_ms":-5}`, false},
		{`{"role":"scheduler","server":"/tmp/k.sock","metrics_port":70000}`, false},
		{`{"role":"worker","server":"/tmp/k.sock","rank":-1}`, false},
		{`{"role":"worker","server":"/tmp/k.sock","no_such_key":1}`, false},
		{`{"role":"worker","server":"/tmp/k.sock","namespace":{"no_such_key":1}}`, false},
		{`{"role":"scheduler","server":"embedded","engine_id":"a b"}`, false},
	} {
		serr := schema.Validate("open.json", []byte(tc.doc))
		_, _, perr := connector.Parse([]byte(tc.doc))
		if (serr == nil) != tc.valid || (perr == nil) != tc.valid {
			t.Errorf("%s: schema says %v, Parse says %v; want valid=%v", tc.doc, serr, perr, tc.valid)
		}
		if serr != nil && !errors.Is(serr, schema.ErrInvalid) {
			t.Errorf("%s: %v does not wrap schema.ErrInvalid", tc.doc, serr)
		}
	}
}

// kvshim_vllm_tensors' answer to each documented input is a
// kvshim_worker_register array (tensors.json), and the two agree on what
// a single field refuses.
func TestVLLMTensorsSchema(t *testing.T) {
	ex, err := schema.Examples("vllm_tensors.json")
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range ex {
		descs, err := shim.ParseVLLMTensors(e)
		if err != nil {
			t.Fatalf("example %d: %v", i, err)
		}
		out, _ := json.Marshal(descs)
		if err := schema.Validate("tensors.json", out); err != nil {
			t.Errorf("example %d: %s: %v", i, out, err)
		}
	}
	tensor := func(key string, v any) string { // one field of a valid tensor changed (nil: none)
		x := map[string]any{"layer": "a", "device": "cpu", "data_ptr": 4096, "dtype_size": 2,
			"shape": []int{64, 16, 128}, "strides": []int{2048, 128, 1}}
		if key != "" {
			x[key] = v
		}
		b, _ := json.Marshal(map[string]any{"block_size": 16, "tensors": []any{x}})
		return string(b)
	}
	for _, tc := range []struct {
		doc   string
		valid bool
	}{
		{tensor("", nil), true},
		{`{"block_size": 16}`, true},
		{`{"block_size": 0}`, false},
		{`{"tensors": []}`, false},
		{`{"block_size": 16, "extra": 1}`, false},
		{`{"block_size": 16, "groups": [{"classes": [], "layers": []}]}`, false},
		{`{"block_size": 16, "groups": [{"classes": ["A"], "block_size": -1}]}`, false},
		{`{"block_size": 16, "groups": [{"classes": ["A"], "kind": "full"}]}`, false},
		{tensor("device", "tpu"), false},
		{tensor("dtype_size", 0), false},
		{tensor("layer", ""), false},
		{tensor("shape", []int{64, -16, 128}), false},
		{tensor("data_ptr", -1), false},
		{tensor("stride_bytes", []int{1}), false},
	} {
		serr := schema.Validate("vllm_tensors.json", []byte(tc.doc))
		_, perr := shim.ParseVLLMTensors([]byte(tc.doc))
		if (serr == nil) != tc.valid || (perr == nil) != tc.valid {
			t.Errorf("%s: schema says %v, Go says %v; want valid=%v", tc.doc, serr, perr, tc.valid)
		}
	}
}
