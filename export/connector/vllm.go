package connector

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/shim"
)

// Settings are the kvshim.* keys of vLLM's kv_connector_extra_config,
// checked and with their defaults: the one place either is written (the
// Python connector only passes vLLM's dict through kvshim_vllm_config).
type Settings struct {
	Server        string            `json:"kvshim.server"`
	ChunkSize     int               `json:"kvshim.chunk_size"`
	L1SizeGB      float64           `json:"kvshim.l1_size_gb"`
	L1PrefaultGB  *float64          `json:"kvshim.l1_prefault_gb"` // nil: server.Config's default
	TimeoutMS     int               `json:"kvshim.timeout_ms"`
	HoldTTLS      float64           `json:"kvshim.hold_ttl_s"`
	Model         *string           `json:"kvshim.model"` // nil: model@revision
	L2Adapters    []json.RawMessage `json:"kvshim.l2_adapters"`
	Verify        string            `json:"kvshim.verify"`
	KVCacheLayout *string           `json:"kvshim.kv_cache_layout"` // nil: vLLM's choice
	TraceDir      *string           `json:"kvshim.trace_dir"`       // nil: off
	MetricsPort   int               `json:"kvshim.metrics_port"`
	Layerwise     bool              `json:"kvshim.layerwise"`
	SyncLoad      bool              `json:"kvshim.sync_load"`
}

// DefaultChunkSize is kvshim.chunk_size's default, in tokens.
const DefaultChunkSize = 256

// DefaultSettings are the settings of an empty kv_connector_extra_config.
func DefaultSettings() Settings {
	return Settings{Server: "embedded", ChunkSize: DefaultChunkSize, L1SizeGB: server.DefaultL1SizeGB,
		TimeoutMS: int(DefaultTimeout / time.Millisecond), HoldTTLS: server.DefaultHoldTTL.Seconds(),
		L2Adapters: []json.RawMessage{}, Verify: "l2"}
}

// A setting parses one key's value. Values arrive as JSON from vLLM's
// --kv-transfer-config, or as strings from its dotted CLI form
// (--kv-transfer-config.kv_connector_extra_config.kvshim.chunk_size=512):
// both are accepted wherever a string is not itself a valid value.
type setting func(s *Settings, key string, v any) error

var settings = map[string]setting{
	"kvshim.server":       func(s *Settings, k string, v any) (err error) { s.Server, err = str(k, v); return },
	"kvshim.chunk_size":   func(s *Settings, k string, v any) (err error) { s.ChunkSize, err = posInt(k, v); return },
	"kvshim.timeout_ms":   func(s *Settings, k string, v any) (err error) { s.TimeoutMS, err = posInt(k, v); return },
	"kvshim.l1_size_gb":   func(s *Settings, k string, v any) (err error) { s.L1SizeGB, err = posFloat(k, v, false); return },
	"kvshim.hold_ttl_s":   func(s *Settings, k string, v any) (err error) { s.HoldTTLS, err = posFloat(k, v, false); return },
	"kvshim.layerwise":    func(s *Settings, k string, v any) (err error) { s.Layerwise, err = boolean(k, v); return },
	"kvshim.sync_load":    func(s *Settings, k string, v any) (err error) { s.SyncLoad, err = boolean(k, v); return },
	"kvshim.metrics_port": func(s *Settings, k string, v any) (err error) { s.MetricsPort, err = port(k, v); return },
	"kvshim.l1_prefault_gb": func(s *Settings, k string, v any) error {
		x, err := posFloat(k, v, true)
		s.L1PrefaultGB = &x
		return err
	},
	"kvshim.model":     func(s *Settings, k string, v any) error { return strPtr(&s.Model, k, v) },
	"kvshim.trace_dir": func(s *Settings, k string, v any) error { return strPtr(&s.TraceDir, k, v) },
	"kvshim.verify": func(s *Settings, k string, v any) (err error) {
		s.Verify, err = choice(k, v, "l2", "always", "off")
		return
	},
	"kvshim.kv_cache_layout": nil, // checked against vLLM's KVCacheLayout names (ParseSettings)
	"kvshim.l2_adapters":     func(s *Settings, k string, v any) (err error) { s.L2Adapters, err = adapters(k, v); return },
}

// SettingKeys are the kvshim.* keys, sorted.
func SettingKeys() []string {
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// ParseSettings reads kv_connector_extra_config. vLLM's dotted CLI form
// arrives nested, {"kvshim": {"l1_size_gb": 4}}: the same setting as
// "kvshim.l1_size_gb". An unknown kvshim.* key or a bad value is ErrConfig
// naming the key; null is the default. layouts are vLLM's KVCacheLayout
// names, the values kvshim.kv_cache_layout may take (nil: any).
func ParseSettings(extra []byte, layouts []string) (Settings, error) {
	s := DefaultSettings()
	var m map[string]any
	if len(bytes.TrimSpace(extra)) > 0 {
		dec := json.NewDecoder(bytes.NewReader(extra))
		dec.UseNumber()
		if err := dec.Decode(&m); err != nil {
			return s, fmt.Errorf("kv_connector_extra_config: want a JSON object: %w: %w", err, ErrConfig)
		}
	}
	flat := map[string]any{}
	for k, v := range m {
		if k != "kvshim" {
			flat[k] = v
		}
	}
	if n, ok := m["kvshim"]; ok {
		nested, ok := n.(map[string]any)
		if !ok {
			return s, fmt.Errorf("kvshim: want an object of kvshim settings, got %s: %w", show(n), ErrConfig)
		}
		for k, v := range nested {
			key := "kvshim." + k
			if w, dup := flat[key]; dup && !same(w, v) {
				return s, fmt.Errorf("%s is given twice, as %s and %s: %w", key, show(w), show(v), ErrConfig)
			}
			flat[key] = v
		}
	}
	var unknown []string
	for k := range flat {
		if _, ok := settings[k]; strings.HasPrefix(k, "kvshim.") && !ok {
			unknown = append(unknown, strconv.Quote(k))
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return s, fmt.Errorf("unknown kv_connector_extra_config key(s) [%s]; valid keys: %s: %w",
			strings.Join(unknown, ", "), strings.Join(SettingKeys(), ", "), ErrConfig)
	}
	for _, k := range SettingKeys() {
		v, ok := flat[k]
		if !ok || v == nil {
			continue
		}
		if k == "kvshim.kv_cache_layout" {
			if layouts == nil {
				layouts = []string{fmt.Sprint(v)}
			}
			x, err := choice(k, v, layouts...)
			if err != nil {
				return s, err
			}
			s.KVCacheLayout = &x
		} else if err := settings[k](&s, k, v); err != nil {
			return s, err
		}
	}
	return s, nil
}

func show(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// same reports whether two values of one key are the same setting (4 and
// 4.0 are).
func same(a, b any) bool {
	if x, ok := a.(json.Number); ok {
		if y, ok := b.(json.Number); ok {
			fx, ex := x.Float64()
			fy, ey := y.Float64()
			return ex == nil && ey == nil && fx == fy
		}
	}
	return show(a) == show(b)
}

func number(key string, v any) (float64, error) {
	var s string
	switch x := v.(type) {
	case json.Number:
		s = x.String()
	case string:
		s = strings.TrimSpace(x)
	default:
		return 0, fmt.Errorf("%s: want a number, got %s: %w", key, show(v), ErrConfig)
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("%s: want a number, got %s: %w", key, show(v), ErrConfig)
	}
	return f, nil
}

func posFloat(key string, v any, zero bool) (float64, error) {
	f, err := number(key, v)
	if err != nil {
		return 0, err
	}
	if f < 0 || f == 0 && !zero {
		return 0, fmt.Errorf("%s: must be %s, got %s: %w", key, map[bool]string{false: "> 0", true: ">= 0"}[zero], show(v), ErrConfig)
	}
	return f, nil
}

func posInt(key string, v any) (int, error) {
	f, err := posFloat(key, v, false)
	if err != nil {
		return 0, err
	}
	if f != math.Trunc(f) || f > math.MaxInt32 {
		return 0, fmt.Errorf("%s: want a whole number up to %d, got %s: %w", key, math.MaxInt32, show(v), ErrConfig)
	}
	return int(f), nil
}

func port(key string, v any) (int, error) {
	f, err := number(key, v)
	if err != nil || f != math.Trunc(f) || f < 0 || f > 65535 {
		return 0, fmt.Errorf("%s: want a TCP port in 0..65535 (0: off), got %s: %w", key, show(v), ErrConfig)
	}
	return int(f), nil
}

func boolean(key string, v any) (bool, error) {
	switch x := v.(type) {
	case bool:
		return x, nil
	case string:
		switch strings.ToLower(x) {
		case "true", "1", "on":
			return true, nil
		case "false", "0", "off":
			return false, nil
		}
	}
	return false, fmt.Errorf("%s: want true or false, got %s: %w", key, show(v), ErrConfig)
}

func str(key string, v any) (string, error) {
	s, ok := v.(string)
	if !ok || s == "" {
		return "", fmt.Errorf("%s: want a non-empty string, got %s: %w", key, show(v), ErrConfig)
	}
	return s, nil
}

func strPtr(dst **string, key string, v any) error {
	s, err := str(key, v)
	*dst = &s
	return err
}

func choice(key string, v any, valid ...string) (string, error) {
	if s, ok := v.(string); ok && slices.Contains(valid, s) {
		return s, nil
	}
	return "", fmt.Errorf("%s: %s is not one of [%s]: %w", key, show(v), strings.Join(valid, ", "), ErrConfig)
}

// adapters reads kvshim.l2_adapters: a list of adapters (each an object,
// or the JSON text of one, as `kvshim serve --l2-adapter` takes it), one
// adapter object, or the JSON text of either (the dotted CLI form).
func adapters(key string, v any) ([]json.RawMessage, error) {
	if s, ok := v.(string); ok {
		dec := json.NewDecoder(strings.NewReader(s))
		dec.UseNumber()
		if err := dec.Decode(&v); err != nil {
			return nil, fmt.Errorf("%s: not a JSON list of adapters: %w: %w", key, err, ErrConfig)
		}
	}
	if _, ok := v.(map[string]any); ok {
		v = []any{v}
	}
	list, ok := v.([]any)
	out := make([]json.RawMessage, 0, len(list))
	for _, a := range list {
		switch a.(type) {
		case map[string]any, string:
			out = append(out, json.RawMessage(show(a)))
		default:
			ok = false
		}
	}
	if !ok {
		return nil, fmt.Errorf(`%s: want a list of adapters such as [{"type": "fs", "base_path": "/mnt/kv"}], got %s: %w`, key, show(v), ErrConfig)
	}
	return out, nil
}

// VLLMIn is kvshim_vllm_config's input: what the Python connector copies
// from vLLM, as plain data. With Extra alone, only the settings are
// answered (a check of kv_connector_extra_config).
type VLLMIn struct {
	Extra json.RawMessage `json:"extra"` // kv_connector_extra_config
	// KVCacheLayouts are vLLM's KVCacheLayout names (kvshim.kv_cache_layout's values).
	KVCacheLayouts []string `json:"kv_cache_layouts"`
	// Role is the connector's KVConnectorRole: "scheduler" or "worker".
	Role     string         `json:"role"`
	VLLM     *shim.VLLMSpec `json:"vllm"`      // without chunk_size and kvshim_model: Settings give them
	EngineID string         `json:"engine_id"` // kv_transfer_config.engine_id
	KVRole   string         `json:"kv_role"`   // kv_transfer_config.kv_role
	Rank     int            `json:"rank"`      // parallel_config.rank (worker)
}

// VLLMOut is kvshim_vllm_config's answer.
type VLLMOut struct {
	Settings Settings `json:"settings"`
	// Open is the role's kvshim_open config (absent without VLLMIn.VLLM).
	Open *Config `json:"open,omitempty"`
	// Layerwise: kvshim.layerwise in effect (off with KV-cache groups:
	// their failed loads are reported by request, which vLLM reads only
	// for asynchronous loads).
	Layerwise bool `json:"layerwise"`
	// SyncLoad: a hit is loaded in the step that computes it, before its
	// forward pass (kvshim.sync_load, or layer by layer with Layerwise);
	// off with KV-cache groups, as Layerwise.
	SyncLoad bool `json:"sync_load"`
	// ByRequest: the namespace names KV-cache groups; a failed load is
	// reported by request (failed_recving), not by block.
	ByRequest bool `json:"by_request"`
	// Warnings are for vLLM's log; Summary is the start-up line's detail.
	Warnings []string `json:"warnings"`
	Summary  string   `json:"summary"`
}

// ResolveVLLM reads kv_connector_extra_config and, given vLLM's spec, the
// role's kvshim_open config: the same server, engine and namespace in
// every role, and each role's own settings.
func ResolveVLLM(in VLLMIn) (*VLLMOut, error) {
	s, err := ParseSettings(in.Extra, in.KVCacheLayouts)
	if err != nil {
		return nil, err
	}
	out := &VLLMOut{Settings: s, Warnings: []string{}}
	if in.VLLM == nil {
		return out, nil
	}
	spec := *in.VLLM
	spec.ChunkSize = s.ChunkSize
	if s.Model != nil {
		spec.ModelOverride = *s.Model
	}
	l, err := shim.ResolveVLLM(spec)
	if err != nil {
		return nil, err
	}
	c := &Config{Role: in.Role, Server: s.Server, EngineID: in.EngineID, TimeoutMS: s.TimeoutMS,
		Namespace: Namespace{Model: l.Model, DType: l.DType, Layout: l.Layout, WorldSize: l.WorldSize, TPSize: l.TPSize,
			ChunkSize: l.ChunkSize, KVGroup: l.KVGroup, MLA: l.MLA, DCPSize: l.DCPSize}}
	if s.TraceDir != nil {
		c.TraceDir = *s.TraceDir
	}
	out.ByRequest, out.Layerwise, out.SyncLoad = l.Groups, s.Layerwise && !l.Groups, (s.Layerwise || s.SyncLoad) && !l.Groups
	if l.Groups && (s.Layerwise || s.SyncLoad) {
		key := "kvshim.sync_load"
		if s.Layerwise {
			key = "kvshim.layerwise"
		}
		out.Warnings = append(out.Warnings, key+": off for this model (several KV-cache groups, or one that frees blocks: "+
			"failed loads are reported by request, which needs asynchronous loads)")
	}
	layout := l.Layout[:min(len(l.Layout), 120)]
	switch in.Role {
	case "scheduler":
		c.BlockSize = l.SchedBlockSize // DCP ranks each hold a slice of the scheduler's block
		c.L1SizeGB, c.L1PrefaultGB, c.HoldTTLS, c.MetricsPort = s.L1SizeGB, s.L1PrefaultGB, s.HoldTTLS, s.MetricsPort
		c.KVRole = in.KVRole
		for _, a := range s.L2Adapters {
			var txt string
			if json.Unmarshal(a, &txt) != nil {
				txt = string(a) // an object: its JSON text
			}
			c.L2Adapters = append(c.L2Adapters, txt)
		}
		out.Summary = fmt.Sprintf("role=scheduler server=%s chunk_size=%d verify=%s l1_size_gb=%g l2_adapters=%d kv_cache_layout=%s",
			s.Server, s.ChunkSize, s.Verify, s.L1SizeGB, len(s.L2Adapters), layout)
	case "worker":
		if in.Rank < 0 {
			return nil, fmt.Errorf("rank %d is out of range: %w", in.Rank, ErrConfig)
		}
		c.Rank, c.Verify = in.Rank, s.Verify
		out.Summary = fmt.Sprintf("role=worker server=%s chunk_size=%d verify=%s rank=%d", s.Server, s.ChunkSize, s.Verify, in.Rank)
	default:
		return nil, fmt.Errorf(`role %q: want "scheduler" or "worker": %w`, in.Role, ErrConfig)
	}
	// What kvshim_open checks, checked here (the engine_id an embedded
	// server's socket is named by, every key): an answer is an open config
	// the library accepts (FuzzResolveVLLM).
	if _, err := c.resolve(); err != nil {
		return nil, err
	}
	out.Open = c
	return out, nil
}
