package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvshim/kvshim/export/connector"
	"github.com/kvshim/kvshim/export/schema"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
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
		{"vllm_namespace.json", nil, reflect.TypeFor[shim.VLLMSpec](), nil},
		{"vllm_namespace.json", []string{"$defs", "out"}, reflect.TypeFor[shim.VLLMLayout](), nil},
		{"step.json", nil, reflect.TypeFor[shim.Step](), nil},
		{"step.json", []string{"$defs", "request"}, reflect.TypeFor[shim.StepRequest](), nil},
		{"latencies.json", nil, reflect.TypeFor[shim.Latencies](), nil},
		{"save_reports.json", []string{"$defs", "report"}, reflect.TypeFor[shim.SaveReport](), nil},
		{"events.json", nil, reflect.TypeFor[shim.Events](), nil},
		{"events.json", []string{"$defs", "event"}, reflect.TypeFor[shim.Event](), nil},
		{"meta.json", nil, reflect.TypeFor[shim.StepMeta](), nil},
		{"meta.json", []string{"$defs", "load"}, reflect.TypeFor[shim.LoadSpec](), nil},
		{"meta.json", []string{"$defs", "save"}, reflect.TypeFor[shim.SaveSpec](), nil},
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

// Every documented example matches its schema, and every schema file is
// in schema.Names (so its examples and Go's checks run).
func TestSchemaExamplesValid(t *testing.T) {
	files, err := filepath.Glob("schema/*.json")
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range files {
		files[i] = filepath.Base(f)
	}
	if names := slices.Sorted(slices.Values(schema.Names)); !slices.Equal(files, names) {
		t.Errorf("export/schema holds %v; schema.Names is %v", files, names)
	}
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

// hash64 is a chunk hash in hex, as documents carry it.
const hash64 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

// metaJSON is what kvshim_meta_json writes for m: its binary form read
// back by the workers' decoder, as JSON.
func metaJSON(t *testing.T, m *shim.StepMeta) []byte {
	t.Helper()
	b, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	back, err := shim.ReadStepMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	out, err := json.Marshal(back)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// What Go emits matches: the poll result with nothing to report (lists
// were null before encodePoll) and with something, both stats shapes, and
// the controls', events' and kvshim_meta_json's results, empty and full.
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
		{"latencies, none", "latencies.json", mustJSON(new(shim.Worker).TakeLatencies())},
		{"latencies, some", "latencies.json", mustJSON(shim.Latencies{Load: []float64{0.5}, Save: []float64{0.25, 1}, Dropped: 3})},
		{"save reports, none", "save_reports.json", mustJSON(new(shim.Worker).TakeSaveReports())},
		{"save reports, some", "save_reports.json", mustJSON([]shim.SaveReport{{Req: "a", Group: 1, Rank: 2, Hash: hash64, OK: true}})},
		{"hit sources, none", "hit_sources.json", mustJSON(map[shim.HitSource]int{})},
		{"hit sources, all", "hit_sources.json", mustJSON(map[shim.HitSource]int{shim.SourceHost: 1, shim.SourceDisk: 2, shim.SourceUnspecified: 3})},
		{"events, none", "events.json", mustJSON(&shim.Events{Events: []shim.Event{}, Done: []string{}})},
		{"events, all kinds", "events.json", mustJSON(&shim.Events{Events: []shim.Event{
			{Kind: "stored", Req: "a", Group: 1, FirstBlock: 4, Blocks: 2, Medium: shim.MediumL1, Chunks: []string{hash64}},
			{Kind: "cleared"},
			{Kind: "removed", Medium: shim.MediumL2, Chunk: hash64},
			{Kind: "stored_chunk", Medium: shim.MediumL2, Chunk: hash64}}, Done: []string{"a"}, Dropped: 1, Pending: 2, Reported: 3})},
		{"meta, empty", "meta.json", metaJSON(t, &shim.StepMeta{})},
		{"meta, all", "meta.json", metaJSON(t, &shim.StepMeta{
			Loads:    []shim.LoadSpec{{Req: "a", Group: 1, Lookup: 7, Start: 0, End: 1, Hashes: []kv.Hash{{1}}, Blocks: []int64{-1, 3}}},
			Saves:    []shim.SaveSpec{{Req: "b", First: 2, Hashes: []kv.Hash{{2}}, Blocks: []int64{4, -1}}},
			Finished: []string{"c"}, Preempted: []string{"d"}})},
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

// agree checks that a schema and Go's decoder of the same document accept
// and refuse the same documents.
func agree(t *testing.T, name string, decode func([]byte) error, cases []agreeCase) {
	t.Helper()
	for _, tc := range cases {
		serr := schema.Validate(name, []byte(tc.doc))
		gerr := decode([]byte(tc.doc))
		if (serr == nil) != tc.valid || (gerr == nil) != tc.valid {
			t.Errorf("%s: %s: schema says %v, Go says %v; want valid=%v", name, tc.doc, serr, gerr, tc.valid)
		}
	}
}

type agreeCase struct {
	doc   string
	valid bool
}

// The input documents of the scheduler's exports: each schema refuses
// what the export's decoder refuses (decodeStrict, shim.DecodeExtras,
// shim.DecodeRequestOptions), and its examples are accepted by both.
func TestSchedulerInputSchemasAgreeWithGo(t *testing.T) {
	withExamples := func(name string, cases []agreeCase) []agreeCase {
		ex, err := schema.Examples(name)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ex {
			cases = append(cases, agreeCase{string(e), true})
		}
		return cases
	}
	agree(t, "step.json", func(b []byte) error { return decodeStrict(b, new(shim.Step), "step_json") }, withExamples("step.json", []agreeCase{
		{`{"requests": [{"req": "a", "blocks": [1, 2], "computed": 0, "scheduled": 32}], "preempted": null}`, true},
		{`{"requests": [{"req": "a", "group_blocks": [[1]]}]}`, false}, // dropped in ABI 6.0
		{`{"requests": [{"req": "a", "tokens": [-1]}]}`, false},
		{`{"requests": [{"req": "a", "tokens": [4294967296]}]}`, false},
		{`{"requests": [{"req": "a", "blocks": ["1"]}]}`, false},
		{`{"requests": [{"req": "a", "computed": 1.5}]}`, false},
		{`{"finished": []}`, false},
		{`[]`, false},
	}))
	agree(t, "extras.json", func(b []byte) error { _, err := shim.DecodeExtras(b); return err }, withExamples("extras.json", []agreeCase{
		{`{"cache_salt": null, "lora": null, "mm": null}`, true},
		{`{"lora": {"name": "", "path": ""}}`, true},
		{`{"lora": {"name": "a"}}`, false},
		{`{"lora": "a:/p"}`, false},
		{`{"mm": [{"hash": "h", "offset": 0, "length": 0}]}`, false},
		{`{"mm": [{"hash": "", "offset": 0, "length": 1}]}`, false},
		{`{"mm": [{"hash": "h", "offset": -1, "length": 1}]}`, false},
		{`{"mm": [{"hash": "h", "offset": 0}]}`, false},
		{`{"cache_salt": 3}`, false},
		{`{"salt": "x"}`, false},
		{`null`, false},
	}))
	agree(t, "request_options.json", func(b []byte) error { _, err := shim.DecodeRequestOptions(b); return err },
		withExamples("request_options.json", []agreeCase{
			{`null`, true},
			{`{"other": {"kvshim.skip_save": 1}}`, true},
			{`{"kvshim.skip_save": "yes"}`, false},
			{`{"kvshim.skip_saves": true}`, false},
			{`[]`, false},
		}))
	agree(t, "received.json", func(b []byte) error { var ids []string; return decodeStrict(b, &ids, "ids_json") },
		withExamples("received.json", []agreeCase{
			{`null`, true},
			{`[1]`, false},
			{`{"ids": ["a"]}`, false},
		}))
	step := "save_reports.json#/$defs/step"
	agree(t, step, func(b []byte) error { var r [][]shim.SaveReport; return decodeStrict(b, &r, "reports_json") }, []agreeCase{
		{`[]`, true},
		{`[[], [{"r": "a", "g": 0, "k": 1, "h": "` + hash64 + `", "ok": true}]]`, true},
		{`[[{"r": "a", "g": 0, "k": 1, "h": "` + hash64 + `", "ok": true, "x": 1}]]`, false},
		{`[[{"r": "a", "g": -1, "k": 1, "h": "` + hash64 + `", "ok": true}]]`, false},
		{`[{"r": "a"}]`, false},
	})
	for _, e := range withExamples("save_reports.json", nil) { // a rank's array, one step of it
		if err := schema.Validate(step, []byte("["+e.doc+"]")); err != nil {
			t.Errorf("%s: [%s]: %v", step, e.doc, err)
		}
	}
	// the hit sources' names are shim's
	src, err := schema.Raw("hit_sources.json")
	if err != nil {
		t.Fatal(err)
	}
	var hs struct {
		PropertyNames struct {
			Enum []shim.HitSource `json:"enum"`
		} `json:"propertyNames"`
	}
	if err := json.Unmarshal(src, &hs); err != nil {
		t.Fatal(err)
	}
	if want := []shim.HitSource{shim.SourceHost, shim.SourceDisk, shim.SourceUnspecified}; !slices.Equal(hs.PropertyNames.Enum, want) {
		t.Errorf("hit_sources.json names %v; shim has %v", hs.PropertyNames.Enum, want)
	}
}

// kvshim_vllm_namespace and kvshim_vllm_config: every documented input
// decodes as the export decodes it and its answer matches $defs.out; the
// config's "vllm" is the namespace's input (vllm_namespace.json).
func TestVLLMNamespaceAndConfigSchemas(t *testing.T) {
	strict := func(b []byte, v any) error {
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		return dec.Decode(v)
	}
	for name, resolve := range map[string]func([]byte) (any, error){
		"vllm_namespace.json": func(b []byte) (any, error) {
			var s shim.VLLMSpec
			if err := strict(b, &s); err != nil {
				return nil, err
			}
			return shim.ResolveVLLM(s)
		},
		"vllm_config.json": func(b []byte) (any, error) {
			var in connector.VLLMIn
			if err := strict(b, &in); err != nil {
				return nil, err
			}
			return connector.ResolveVLLM(in)
		},
	} {
		ex, err := schema.Examples(name)
		if err != nil {
			t.Fatal(err)
		}
		for i, e := range ex {
			out, err := resolve(e)
			if err != nil {
				t.Errorf("%s example %d: %v", name, i, err)
				continue
			}
			b, _ := json.Marshal(out)
			if err := schema.Validate(name+"#/$defs/out", b); err != nil {
				t.Errorf("%s example %d: answer %s: %v", name, i, b, err)
			}
		}
	}
	for _, tc := range []agreeCase{
		{`{"extra": {}, "vllm": {"model": "m", "cache_dtype": "auto", "block_size": 16, "world_size": 1, "tp_size": 1}}`, true},
		{`{"extra": {}, "vllm": null}`, true},
		{`{"extra": {}, "vllm": {"model": "m", "no_such_key": 1}}`, false},
		{`{"extra": {}, "vllm": {"groups": [{"classes": ["A"], "no_such_key": 1}]}}`, false},
		{`{"extra": {}, "vllm": {"pp_stages": [[0, "16"]]}}`, false},
		{`{"extra": {}, "vllm": {"pp_stages": [[0, 8, 16]]}}`, false}, // a third number is not dropped
		{`{"extra": {}, "vllm": {"pp_stages": [[0, 8], [8, 16]], "total_layers": 16}}`, true},
	} {
		serr := schema.Validate("vllm_config.json", []byte(tc.doc))
		gerr := strict([]byte(tc.doc), new(connector.VLLMIn))
		if (serr == nil) != tc.valid || (gerr == nil) != tc.valid {
			t.Errorf("%s: schema says %v, Go says %v; want valid=%v", tc.doc, serr, gerr, tc.valid)
		}
	}
	if err := schema.Validate("vllm_config.json#/no/such", []byte(`{}`)); !errors.Is(err, schema.ErrUnknown) {
		t.Errorf("an unknown part: %v; want ErrUnknown", err)
	}
}
