package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// vLLM's objects as plain data, and what kvshim makes of them: the
// namespace (what makes KV bytes compatible), the KV-cache groups and the
// refusals, decided here for every role and every caller
// (kvshim_vllm_namespace; python/kvshim/vllm/config.py only copies vLLM's
// fields). Each field is checked: a bad one is ErrBadNamespaceSpec naming it.

// VLLMSpec is a vLLM engine's configuration as the connector copies it.
type VLLMSpec struct {
	Model          string  `json:"model"`           // model_config.model
	Revision       string  `json:"revision"`        // model_config.revision ("": main)
	ModelOverride  string  `json:"kvshim_model"`    // kvshim.model ("": model@revision)
	ChunkSize      int     `json:"chunk_size"`      // kvshim.chunk_size
	CacheDType     string  `json:"cache_dtype"`     // cache_config.cache_dtype
	BlockSize      int     `json:"block_size"`      // cache_config.block_size
	CacheLayout    *string `json:"kv_cache_layout"` // the resolved KVCacheLayout (null: none)
	MambaCacheMode string  `json:"mamba_cache_mode"`
	// PrefixMatchUnit is cache_config.prefix_match_unit (null: none).
	PrefixMatchUnit *int `json:"prefix_match_unit"`
	Speculative     bool `json:"speculative"` // a speculative_config is set
	MLA             bool `json:"mla"`
	WorldSize       int  `json:"world_size"`
	TPSize          int  `json:"tp_size"`
	DCPSize         int  `json:"dcp_size"` // decode context parallel (0: 1)
	PCPSize         int  `json:"pcp_size"` // prefill context parallel (0: 1)
	// PPStages is each pipeline stage's [first, end) layers
	// (vllm.distributed.utils.get_pp_indices); empty or one: no pipeline.
	PPStages    []LayerRange `json:"pp_stages"`
	TotalLayers int          `json:"total_layers"` // with PPStages
	Groups      []VLLMGroup  `json:"groups"`       // kv_cache_config's (empty: none)
}

// VLLMGroup is one KVCacheGroupSpec: its spec's class (and the classes it
// derives from: Python's __mro__ names) and fields.
type VLLMGroup struct {
	Classes           []string `json:"classes"`
	Layers            []string `json:"layers"`
	BlockSize         int      `json:"block_size"`
	DType             string   `json:"dtype"`
	KVHeads           *int     `json:"kv_heads"`
	HeadSize          *int     `json:"head_size"`
	SlidingWindow     int      `json:"sliding_window"`
	ExtraRetained     int      `json:"extra_retained_tokens"`
	AttentionChunk    int      `json:"attention_chunk_size"`
	Shapes            [][]int  `json:"shapes"`
	DTypes            []string `json:"dtypes"`
	MambaType         string   `json:"mamba_type"`
	MambaCacheMode    string   `json:"mamba_cache_mode"`
	SpeculativeBlocks int      `json:"num_speculative_blocks"`
	TokensPerState    int      `json:"tokens_per_state"`
	DCPSharded        *bool    `json:"dcp_sharded"`
}

func (g VLLMGroup) is(class string) bool { return slices.Contains(g.Classes, class) }

// LayerRange is a pipeline stage's layers, [first, end): exactly two
// numbers in JSON (a [2]int would drop a third one silently).
type LayerRange [2]int

// UnmarshalJSON refuses a stage that is not two numbers.
func (r *LayerRange) UnmarshalJSON(b []byte) error {
	var v []int
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	if len(v) != 2 {
		return fmt.Errorf("a pipeline stage is [first, end): got %d numbers", len(v))
	}
	*r = LayerRange{v[0], v[1]}
	return nil
}

// VLLMLayout is what kvshim_vllm_namespace answers.
type VLLMLayout struct {
	Model     string `json:"model"`
	DType     string `json:"dtype"`
	Layout    string `json:"layout"`
	WorldSize int    `json:"world_size"`
	TPSize    int    `json:"tp_size"`
	ChunkSize int    `json:"chunk_size"`
	KVGroup   int    `json:"kv_group"`
	MLA       bool   `json:"mla"`
	DCPSize   int    `json:"dcp_size"`
	// SchedBlockSize is the scheduler's block (DCP ranks each hold a slice).
	SchedBlockSize int `json:"sched_block_size"`
	// Groups: the layout names the groups (several, or one that frees
	// blocks). Then failed loads are reported by request and layer-wise
	// loads are off.
	Groups bool `json:"groups"`
}

func badField(field, format string, a ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrBadNamespaceSpec, field, fmt.Sprintf(format, a...))
}

// ResolveVLLM checks s and decides its namespace and groups.
func ResolveVLLM(s VLLMSpec) (*VLLMLayout, error) {
	switch {
	case s.Model == "" && s.ModelOverride == "":
		return nil, badField("model", "empty")
	case s.ChunkSize < 1 || s.ChunkSize > MaxChunkSize:
		return nil, badField("chunk_size", "%d (want 1..%d)", s.ChunkSize, MaxChunkSize)
	case s.BlockSize < 1:
		return nil, badField("block_size", "%d (want > 0)", s.BlockSize)
	case s.WorldSize < 1:
		return nil, badField("world_size", "%d (want > 0)", s.WorldSize)
	case s.TPSize < 1:
		return nil, badField("tp_size", "%d (want > 0)", s.TPSize)
	case s.DCPSize < 0:
		return nil, badField("dcp_size", "%d (want >= 0)", s.DCPSize)
	case s.PCPSize < 0:
		return nil, badField("pcp_size", "%d (want >= 0)", s.PCPSize)
	case len(s.PPStages) > 1 && s.TotalLayers < 1:
		return nil, badField("total_layers", "%d with %d pipeline stages", s.TotalLayers, len(s.PPStages))
	}
	for i, g := range s.Groups {
		if len(g.Classes) == 0 {
			return nil, badField(fmt.Sprintf("groups[%d].classes", i), "empty")
		}
		if g.BlockSize < 1 {
			return nil, badField(fmt.Sprintf("groups[%d].block_size", i), "%d (want > 0)", g.BlockSize)
		}
	}
	model := s.ModelOverride
	if model == "" {
		rev := s.Revision
		if rev == "" {
			rev = "main"
		}
		model = s.Model + "@" + rev
	}
	var g0 *VLLMGroup
	if len(s.Groups) > 0 {
		g0 = &s.Groups[0]
	}
	dtype, blockSize := s.CacheDType, s.BlockSize
	lay := map[string]any{"spec": "NoneType", "block_size": blockSize, "kv_heads": nil, "head_size": nil, "layers": 0}
	if g0 != nil {
		if g0.DType != "" {
			dtype = g0.DType
		}
		lay["spec"], lay["block_size"], lay["layers"] = g0.Classes[0], g0.BlockSize, len(g0.Layers)
		lay["kv_heads"], lay["head_size"] = intOrNil(g0.KVHeads), intOrNil(g0.HeadSize)
	}
	lay["cache_layout"] = nil
	if s.CacheLayout != nil {
		lay["cache_layout"] = *s.CacheLayout
	}
	groups, err := s.groups(model)
	if err != nil {
		return nil, err
	}
	if groups != nil {
		lay["groups"] = groups
	}
	if len(s.PPStages) > 1 {
		lay["layers"] = s.TotalLayers
		stages := make([]any, len(s.PPStages))
		for i, st := range s.PPStages {
			stages[i] = []any{st[0], st[1]}
		}
		lay["pp_stages"] = stages
	}
	dcp := max(s.DCPSize, 1)
	if dcp > 1 && g0 != nil && g0.DCPSharded != nil && !*g0.DCPSharded {
		dcp = 1
	}
	var b bytes.Buffer
	pyJSON(&b, lay)
	return &VLLMLayout{Model: model, DType: strings.TrimPrefix(dtype, "torch."), Layout: b.String(),
		WorldSize: s.WorldSize, TPSize: s.TPSize, ChunkSize: s.ChunkSize, MLA: s.MLA, DCPSize: dcp,
		SchedBlockSize: s.BlockSize * dcp, Groups: groups != nil}, nil
}

func intOrNil(p *int) any {
	if p == nil {
		return nil
	}
	return *p
}

// groups are the layout's "groups": nil for one full-attention group (the
// layout of kvshim before groups, keys unchanged); else every group, with
// what makes its bytes differ. A group kvshim cannot restore is refused.
func (s VLLMSpec) groups(model string) ([]any, error) {
	where := func(i int, g VLLMGroup) string {
		names := g.Layers[:min(3, len(g.Layers))]
		more := ""
		if len(g.Layers) > 3 {
			more = "..."
		}
		q := make([]string, len(names))
		for j, n := range names {
			q[j] = "'" + n + "'"
		}
		return fmt.Sprintf("KV-cache group %d (%s, layers [%s]%s) of model %s", i, g.Classes[0], strings.Join(q, ", "), more, model)
	}
	for i, g := range s.Groups {
		if g.is("MambaSpec") {
			if why := s.mambaRefusal(g); why != "" {
				return nil, fmt.Errorf("%w: kvshim: %s holds Mamba/SSM state, which kvshim does not save or restore here: %s; serve this model without kv_connector KVShimConnector",
					ErrBadNamespaceSpec, where(i, g), why)
			}
		}
	}
	if len(s.Groups) == 0 || len(s.Groups) == 1 && !s.Groups[0].is("MambaSpec") && !s.Groups[0].is("SlidingWindowSpec") && !s.Groups[0].is("ChunkedLocalAttentionSpec") {
		return nil, nil
	}
	out := make([]any, 0, len(s.Groups))
	sizes := map[int]bool{}
	for i, g := range s.Groups {
		var m map[string]any
		switch {
		case g.is("SlidingWindowSpec"):
			m = map[string]any{"kind": "sliding_window", "window": g.SlidingWindow + g.ExtraRetained}
		case g.is("ChunkedLocalAttentionSpec"):
			m = map[string]any{"kind": "chunked_local", "window": g.AttentionChunk}
		case g.is("FullAttentionSpec"):
			m = map[string]any{"kind": "full"}
		case g.is("MambaSpec"):
			shapes := make([]any, len(g.Shapes))
			for j, sh := range g.Shapes {
				x := make([]any, len(sh))
				for k, v := range sh {
					x[k] = v
				}
				shapes[j] = x
			}
			dts := make([]any, len(g.DTypes))
			for j, d := range g.DTypes {
				dts[j] = strings.TrimPrefix(d, "torch.")
			}
			m = map[string]any{"kind": "mamba", "shapes": shapes, "dtypes": dts, "mamba_type": g.MambaType}
		default:
			return nil, fmt.Errorf("%w: kvshim: %s: kvshim restores full, sliding-window and chunked local attention groups and Mamba state groups only",
				ErrBadNamespaceSpec, where(i, g))
		}
		m["spec"], m["block_size"], m["layers"] = g.Classes[0], g.BlockSize, len(g.Layers)
		m["kv_heads"], m["head_size"] = intOrNil(g.KVHeads), intOrNil(g.HeadSize)
		sizes[g.BlockSize] = true
		out = append(out, m)
	}
	if len(sizes) > 1 {
		var ss []string
		for _, k := range slices.Sorted(mapKeys(sizes)) {
			ss = append(ss, strconv.Itoa(k))
		}
		return nil, fmt.Errorf("%w: kvshim: the KV-cache groups of model %s have blocks of [%s] tokens; kvshim needs one block size for all groups",
			ErrBadNamespaceSpec, model, strings.Join(ss, ", "))
	}
	return out, nil
}

func mapKeys(m map[int]bool) func(func(int) bool) {
	return func(yield func(int) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// mambaRefusal says why kvshim cannot restore this Mamba group's state (""
// when it can). kvshim relies on vLLM's "align" invariant: once a request
// computed (p+1)*block_size tokens, its block p holds the state after
// exactly that many tokens or is the null block (groups.go). Every case
// below breaks it or is untested (tests/vllm/NOTES.md, "Hybrid models").
func (s VLLMSpec) mambaRefusal(g VLLMGroup) string {
	switch {
	case g.MambaCacheMode != "align" || s.MambaCacheMode != "align":
		// "none": one running state per request, overwritten in place.
		return fmt.Sprintf("mamba_cache_mode is '%s' (cache config '%s'); kvshim needs 'align' (vLLM's prefix caching on), where a block holds the state at its last token",
			g.MambaCacheMode, s.MambaCacheMode)
	case g.SpeculativeBlocks != 0:
		// The running state lives in the last 1+n blocks, moved in place.
		return fmt.Sprintf("speculative decoding keeps %d speculative state blocks", g.SpeculativeBlocks)
	case s.Speculative:
		// EAGLE's block drop moves a prefill checkpoint one block early.
		return "speculative decoding (a prefill checkpoint state may sit in the block after its position)"
	case g.TokensPerState > 0:
		return fmt.Sprintf("a block holds several states (tokens_per_state %d)", g.TokensPerState)
	case s.PrefixMatchUnit != nil && *s.PrefixMatchUnit != g.BlockSize:
		// Partial-block prefix hits copy a state that ends inside a block.
		return fmt.Sprintf("prefix_match_unit %d is finer than the %d-token block", *s.PrefixMatchUnit, g.BlockSize)
	case s.DCPSize > 1 || s.PCPSize > 1:
		return "context parallelism (vLLM itself serves no Mamba prefix hit with DCP/PCP: MambaManager.find_longest_cache_hit)"
	case g.BlockSize != s.BlockSize:
		// The scheduler's block table counts cache_config.block_size tokens.
		return fmt.Sprintf("its %d-token blocks (mamba_block_size) are not the scheduler's %d-token blocks", g.BlockSize, s.BlockSize)
	}
	return ""
}

// pyJSON writes v as Python's json.dumps(v, sort_keys=True) does (", " and
// ": " separators): the layout string is hashed into the namespace, and
// kvshim's keys stay those of the releases that wrote it in Python.
func pyJSON(b *bytes.Buffer, v any) {
	switch x := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(x))
	case int:
		b.WriteString(strconv.Itoa(x))
	case string:
		q, _ := json.Marshal(x)
		b.Write(q)
	case []any:
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(", ")
			}
			pyJSON(b, e)
		}
		b.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(", ")
			}
			pyJSON(b, k)
			b.WriteString(": ")
			pyJSON(b, x[k])
		}
		b.WriteByte('}')
	default:
		panic(fmt.Sprintf("pyJSON: %T", v))
	}
}
