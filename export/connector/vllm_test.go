package connector

import (
	"encoding/json"
	"errors"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/kvshim/kvshim/shim"
)

func TestParseSettings(t *testing.T) {
	layouts := []string{"LBNHC", "BLNHC", "BLHNC"}
	for _, tc := range []struct {
		extra string
		check func(s Settings) bool
	}{
		{`{}`, func(s Settings) bool {
			return s.Server == "embedded" && s.ChunkSize == 256 && s.L1SizeGB == 16 && s.TimeoutMS == 5000 &&
				s.HoldTTLS == 1800 && s.Verify == "l2" && s.L1PrefaultGB == nil && s.Model == nil && len(s.L2Adapters) == 0
		}},
		{`{"kvshim": {"l1_size_gb": 4}}`, func(s Settings) bool { return s.L1SizeGB == 4 }},
		{`{"kvshim": {"l1_size_gb": 4}, "kvshim.l1_size_gb": 4.0}`, func(s Settings) bool { return s.L1SizeGB == 4 }},
		{`{"kvshim.chunk_size": "512", "kvshim.l1_prefault_gb": 0}`, func(s Settings) bool {
			return s.ChunkSize == 512 && s.L1PrefaultGB != nil && *s.L1PrefaultGB == 0
		}},
		{`{"kvshim.l2_adapters": "[{\"type\": \"fs\", \"base_path\": \"/x\"}]"}`, func(s Settings) bool {
			return len(s.L2Adapters) == 1 && string(s.L2Adapters[0]) == `{"base_path":"/x","type":"fs"}`
		}},
		{`{"kvshim.l2_adapters": {"type": "fs"}}`, func(s Settings) bool { return len(s.L2Adapters) == 1 }},
		{`{"kvshim.l2_adapters": ["{\"type\":\"fs\"}"]}`, func(s Settings) bool { return string(s.L2Adapters[0]) == `"{\"type\":\"fs\"}"` }},
		{`{"kvshim.layerwise": "on", "kvshim.metrics_port": "9100"}`, func(s Settings) bool { return s.Layerwise && s.MetricsPort == 9100 }},
		{`{"kvshim.kv_cache_layout": "BLNHC", "kvshim.model": "m", "kvshim.trace_dir": null}`, func(s Settings) bool {
			return *s.KVCacheLayout == "BLNHC" && *s.Model == "m" && s.TraceDir == nil
		}},
		{`{"other_connector.key": 1}`, func(s Settings) bool { return s.ChunkSize == 256 }},
	} {
		s, err := ParseSettings([]byte(tc.extra), layouts)
		if err != nil || !tc.check(s) {
			t.Errorf("%s: %+v, %v", tc.extra, s, err)
		}
	}
}

func TestParseSettingsRefuses(t *testing.T) {
	for _, tc := range []struct{ extra, msg string }{
		{`{"kvshim": {"l1_size": 4}}`, `unknown kv_connector_extra_config key(s) ["kvshim.l1_size"]`},
		{`{"kvshim": {"l1_size_gb": 4}, "kvshim.l1_size_gb": 8}`, "kvshim.l1_size_gb is given twice, as 8 and 4"},
		{`{"kvshim": 3}`, "kvshim: want an object of kvshim settings, got 3"},
		{`[]`, "kv_connector_extra_config: want a JSON object"},
		{`{"kvshim.l1_size_gb": 0}`, "kvshim.l1_size_gb: must be > 0, got 0"},
		{`{"kvshim.l1_size_gb": -1}`, "kvshim.l1_size_gb: must be > 0, got -1"},
		{`{"kvshim.hold_ttl_s": "NaN"}`, "kvshim.hold_ttl_s: want a number"},
		{`{"kvshim.chunk_size": "abc"}`, `kvshim.chunk_size: want a number, got "abc"`},
		{`{"kvshim.chunk_size": 1.5}`, "kvshim.chunk_size: want a whole number"},
		{`{"kvshim.timeout_ms": true}`, "kvshim.timeout_ms: want a number, got true"},
		{`{"kvshim.l2_adapters": "[{"}`, "kvshim.l2_adapters: not a JSON list of adapters"},
		{`{"kvshim.l2_adapters": 3}`, "kvshim.l2_adapters: want a list of adapters"},
		{`{"kvshim.l2_adapters": [1]}`, "kvshim.l2_adapters: want a list of adapters"},
		{`{"kvshim.verify": "sometimes"}`, `kvshim.verify: "sometimes" is not one of [l2, always, off]`},
		{`{"kvshim.kv_cache_layout": "XYZ"}`, `kvshim.kv_cache_layout: "XYZ" is not one of [LBNHC, BLNHC, BLHNC]`},
		{`{"kvshim.l1_prefault_gb": -2}`, "kvshim.l1_prefault_gb: must be >= 0"},
		{`{"kvshim.server": ""}`, "kvshim.server: want a non-empty string"},
		{`{"kvshim.metrics_port": 70000}`, "kvshim.metrics_port: want a TCP port"},
		{`{"kvshim.layerwise": "maybe"}`, `kvshim.layerwise: want true or false, got "maybe"`},
	} {
		_, err := ParseSettings([]byte(tc.extra), []string{"LBNHC", "BLNHC", "BLHNC"})
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want ErrConfig saying %q", tc.extra, err, tc.msg)
		}
	}
}

func vllmIn(role string, extra string, groups ...shim.VLLMGroup) VLLMIn {
	return VLLMIn{Extra: json.RawMessage(extra), Role: role, EngineID: "e1", KVRole: "kv_both", Rank: 1,
		VLLM: &shim.VLLMSpec{Model: "tiny", CacheDType: "auto", BlockSize: 16, WorldSize: 2, TPSize: 2, Groups: groups}}
}

func TestResolveVLLMRoles(t *testing.T) {
	extra := `{"kvshim.l1_size_gb": 2, "kvshim.l2_adapters": [{"type": "fs", "base_path": "/x"}, "{\"type\":\"fs\",\"name\":\"b\"}"],
		"kvshim.verify": "always", "kvshim.trace_dir": "/tmp/t", "kvshim.model": "m@1"}`
	sched, err := ResolveVLLM(vllmIn("scheduler", extra))
	if err != nil {
		t.Fatal(err)
	}
	worker, err := ResolveVLLM(vllmIn("worker", extra))
	if err != nil {
		t.Fatal(err)
	}
	if sched.Open.Namespace != worker.Open.Namespace || sched.Open.Namespace.Model != "m@1" || sched.Open.Namespace.ChunkSize != 256 {
		t.Errorf("one namespace in every role: %+v, %+v", sched.Open.Namespace, worker.Open.Namespace)
	}
	s, w := sched.Open, worker.Open
	if s.BlockSize != 16 || s.L1SizeGB != 2 || s.HoldTTLS != 1800 || s.KVRole != "kv_both" || s.TraceDir != "/tmp/t" ||
		strings.Join(s.L2Adapters, " ") != `{"base_path":"/x","type":"fs"} {"type":"fs","name":"b"}` {
		t.Errorf("scheduler open config %+v", s)
	}
	if w.Rank != 1 || w.Verify != "always" || w.L1SizeGB != 0 || w.L2Adapters != nil || w.BlockSize != 0 {
		t.Errorf("worker open config %+v: a worker carries no server settings", w)
	}
	if !strings.Contains(sched.Summary, "l1_size_gb=2 l2_adapters=2") || !strings.Contains(worker.Summary, "rank=1") {
		t.Errorf("summaries %q, %q", sched.Summary, worker.Summary)
	}
	// What kvshim_open is given is what it accepts.
	for _, c := range []*Config{s, w} {
		raw, _ := json.Marshal(c)
		if _, _, err := Parse(raw); err != nil {
			t.Errorf("kvshim_open refuses its own config %s: %v", raw, err)
		}
	}
	if only, err := ResolveVLLM(VLLMIn{Extra: json.RawMessage(`{}`)}); err != nil || only.Open != nil || only.Settings.ChunkSize != 256 {
		t.Errorf("settings alone: %+v, %v", only, err)
	}
}

func TestResolveVLLMSyncLoadsNeedOneFullGroup(t *testing.T) {
	full := shim.VLLMGroup{Classes: []string{"FullAttentionSpec", "AttentionSpec"}, Layers: []string{"a"}, BlockSize: 16}
	window := shim.VLLMGroup{Classes: []string{"SlidingWindowSpec", "AttentionSpec"}, Layers: []string{"b"}, BlockSize: 16, SlidingWindow: 64}
	for _, tc := range []struct {
		extra                  string
		groups                 []shim.VLLMGroup
		layerwise, sync, byReq bool
		warning                string
	}{
		{`{}`, []shim.VLLMGroup{full}, false, false, false, ""},
		{`{"kvshim.layerwise": true}`, []shim.VLLMGroup{full}, true, true, false, ""},
		{`{"kvshim.sync_load": true}`, []shim.VLLMGroup{full}, false, true, false, ""},
		{`{"kvshim.sync_load": "on", "kvshim.layerwise": true}`, []shim.VLLMGroup{full}, true, true, false, ""},
		{`{"kvshim.layerwise": true}`, []shim.VLLMGroup{full, window}, false, false, true, "kvshim.layerwise: off"},
		{`{"kvshim.sync_load": true}`, []shim.VLLMGroup{full, window}, false, false, true, "kvshim.sync_load: off"},
	} {
		out, err := ResolveVLLM(vllmIn("worker", tc.extra, tc.groups...))
		if err != nil || out.Layerwise != tc.layerwise || out.SyncLoad != tc.sync || out.ByRequest != tc.byReq {
			t.Errorf("%s, %d groups: %+v, %v", tc.extra, len(tc.groups), out, err)
			continue
		}
		if got := strings.Join(out.Warnings, "; "); (tc.warning == "") != (got == "") || !strings.Contains(got, tc.warning) {
			t.Errorf("%s, %d groups: warnings %q, want %q", tc.extra, len(tc.groups), got, tc.warning)
		}
	}
}

func TestResolveVLLMRefuses(t *testing.T) {
	bad := vllmIn("engine", `{}`)
	if _, err := ResolveVLLM(bad); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), `role "engine"`) {
		t.Errorf("unknown role: %v", err)
	}
	neg := vllmIn("worker", `{}`)
	neg.Rank = -1
	if _, err := ResolveVLLM(neg); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "rank -1") {
		t.Errorf("negative rank: %v", err)
	}
	noBlock := vllmIn("worker", `{}`)
	noBlock.VLLM.BlockSize = 0
	if _, err := ResolveVLLM(noBlock); !errors.Is(err, shim.ErrBadNamespaceSpec) || !strings.Contains(err.Error(), "block_size") {
		t.Errorf("spec errors keep their sentinel: %v", err)
	}
}

// FuzzParseSettings: any kv_connector_extra_config is settings or
// ErrConfig, never a panic, and what it accepts is in range.
func FuzzParseSettings(f *testing.F) {
	for _, s := range []string{`{}`, `{"kvshim": {"chunk_size": "64"}}`, `{"kvshim.l2_adapters": "[{}]"}`, `{"kvshim.l1_prefault_gb": 0}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, extra []byte) {
		s, err := ParseSettings(extra, nil)
		if err != nil {
			if !errors.Is(err, ErrConfig) {
				t.Fatalf("%q: %v is no ErrConfig", extra, err)
			}
			return
		}
		if s.ChunkSize < 1 || s.TimeoutMS < 1 || s.L1SizeGB <= 0 || s.HoldTTLS <= 0 || s.MetricsPort < 0 || s.MetricsPort > 65535 ||
			s.L1PrefaultGB != nil && *s.L1PrefaultGB < 0 || s.Server == "" {
			t.Fatalf("%q: accepted out of range: %+v", extra, s)
		}
	})
}

// FuzzResolveVLLM: any kvshim_vllm_config input (decoded strictly, as the
// export does) is an answer or an error, never a panic; an answer's open
// config is one kvshim_open accepts (the resolver and the open-time checks
// agree on every key).
func FuzzResolveVLLM(f *testing.F) {
	for _, s := range []string{
		`{"extra": {}, "role": "scheduler", "engine_id": "e", "vllm": {"model": "m", "cache_dtype": "auto", "block_size": 16, "world_size": 1, "tp_size": 1}}`,
		`{"extra": {"kvshim.l2_adapters": [{"type": "fs", "base_path": "/x"}]}, "role": "worker", "engine_id": "e", "rank": 1,
		  "vllm": {"model": "m", "cache_dtype": "auto", "block_size": 16, "world_size": 2, "tp_size": 1, "pp_stages": [[0, 2], [2, 4]], "total_layers": 4}}`,
		`{"extra": {}, "vllm": {"pp_stages": [[0, 8, 16]]}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		var in VLLMIn
		dec := json.NewDecoder(strings.NewReader(string(raw)))
		dec.DisallowUnknownFields()
		if dec.Decode(&in) != nil {
			return
		}
		out, err := ResolveVLLM(in)
		if err != nil || out.Open == nil {
			return
		}
		b, err := json.Marshal(out.Open)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := Parse(b); err != nil {
			t.Fatalf("%s: resolved to an open config kvshim_open refuses: %s: %v", raw, b, err)
		}
	})
}

// The README's kv_connector_extra_config table lists every key there is.
func TestReadmeListsEverySetting(t *testing.T) {
	raw, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, m := range regexp.MustCompile("(?m)^\\| `(kvshim\\.[a-z0-9_]+)` \\|").FindAllStringSubmatch(string(raw), -1) {
		listed = append(listed, m[1])
	}
	sort.Strings(listed)
	if !slices.Equal(listed, SettingKeys()) {
		t.Errorf("README lists %v, the settings are %v", listed, SettingKeys())
	}
}
