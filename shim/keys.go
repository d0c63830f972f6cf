package shim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/kvshim/kvshim/kv"
)

// Limits on hash inputs. They keep every length prefix and count in a u32 and
// turn absurd input into a clear error instead of megabytes of hashing.
const (
	// MaxFieldLen bounds every string or byte field that is hashed: cache
	// salt, LoRA identity, multimodal hash, and the namespace strings.
	MaxFieldLen = 4096
	// MaxChunkSize bounds the chunk size in tokens.
	MaxChunkSize = 1 << 20
	// maxTokenPos bounds multimodal offsets and lengths (2^40 tokens).
	maxTokenPos = 1 << 40
)

var (
	// ErrBadChunkSize: chunk size ≤ 0 or > MaxChunkSize.
	ErrBadChunkSize = errors.New("shim: bad chunk size")
	// ErrBadExtras: a cache salt, LoRA or multimodal input that cannot be
	// hashed (too long, empty mm hash, negative range, ...) or extras JSON
	// of the wrong shape. The message names the field.
	ErrBadExtras = errors.New("shim: bad hash extras")
	// ErrBadPrefix: ExtendChunkHashes got more previous hashes than the
	// tokens have full chunks.
	ErrBadPrefix = errors.New("shim: previous chunk hashes do not fit the tokens")
)

// MMInput is one multimodal input of a request: the identity of its content
// and the range of placeholder tokens it occupies in the prompt.
type MMInput struct {
	// Hash identifies the input's content (vLLM's mm_hash or the user's
	// multimodal uuid, as bytes). Non-empty, at most MaxFieldLen bytes.
	Hash []byte
	// Offset is the position of the first placeholder token (≥ 0) and
	// Length the number of placeholder tokens (≥ 1).
	Offset, Length int
}

// LoRA identifies a LoRA adapter by what determines its weights: the name it
// was registered under and the path it was loaded from. Both are hashed,
// each length-prefixed, so no (name, path) pair can pass for another:
// ("a:b", "c") and ("a", "b:c") are different adapters. Either may be empty.
//
// This is vLLM's own identity of an adapter in its prefix cache: vLLM 0.33
// (v1/core/kv_cache_utils.py, _gen_lora_extra_hash_keys) adds the extra key
// ("lora", lora_name, lora_path) to every block hash, the path "so that
// re-pointing a LoRA name at a different adapter does not reuse KV computed
// with the previous one". kvshim's keys outlive the process (L2, other
// engines, restarts), where that re-pointing is even more likely.
//
// lora_int_id is left out, as vLLM leaves it out: it is the adapter's slot
// in one process's LoRA manager, not part of its weights. The same adapter
// gets another id after a restart or on another engine, so hashing it would
// turn valid hits into misses and buy no safety. The other LoRARequest
// fields are not keyed either (base_model_name is informational; the base
// model is in the namespace). Not detected, here as in vLLM: new weights
// written in place under the same name and path (or load_inplace): register
// changed weights under a new name or path.
type LoRA struct {
	Name string
	Path string
}

// Extras is everything besides token ids that makes two requests' KV differ.
// The zero value means "none".
type Extras struct {
	// CacheSalt is the request's cache_salt; it is mixed into the chain's
	// root, so every chunk hash of a salted request differs. An empty salt
	// is no salt (vLLM's rule too: its prefix cache ignores a falsy
	// cache_salt, and its API refuses an empty one), so the type has one
	// value for both and the encoding needs no presence flag for it.
	CacheSalt string
	// LoRA is the request's adapter, nil for the base model. Mixed into the
	// root like the salt, with a presence byte: a LoRA whose name and path
	// are both empty still differs from no LoRA.
	LoRA *LoRA
	// MM lists the request's multimodal inputs in any order; each is mixed
	// into exactly the chunks its placeholder range overlaps. The order
	// does not enter the key (inputs are sorted by offset, length, hash).
	MM []MMInput
}

// Validate reports whether ex can be hashed.
func (ex *Extras) Validate() error {
	if len(ex.CacheSalt) > MaxFieldLen {
		return fmt.Errorf("%w: cache_salt is %d bytes, max %d", ErrBadExtras, len(ex.CacheSalt), MaxFieldLen)
	}
	if l := ex.LoRA; l != nil {
		if len(l.Name) > MaxFieldLen {
			return fmt.Errorf("%w: lora.name is %d bytes, max %d", ErrBadExtras, len(l.Name), MaxFieldLen)
		}
		if len(l.Path) > MaxFieldLen {
			return fmt.Errorf("%w: lora.path is %d bytes, max %d", ErrBadExtras, len(l.Path), MaxFieldLen)
		}
	}
	for i, m := range ex.MM {
		switch {
		case len(m.Hash) == 0:
			return fmt.Errorf("%w: mm[%d].hash is empty", ErrBadExtras, i)
		case len(m.Hash) > MaxFieldLen:
			return fmt.Errorf("%w: mm[%d].hash is %d bytes, max %d", ErrBadExtras, i, len(m.Hash), MaxFieldLen)
		case m.Offset < 0 || m.Offset >= maxTokenPos:
			return fmt.Errorf("%w: mm[%d].offset %d out of range", ErrBadExtras, i, m.Offset)
		case m.Length <= 0 || m.Length >= maxTokenPos:
			return fmt.Errorf("%w: mm[%d].length %d out of range", ErrBadExtras, i, m.Length)
		}
	}
	return nil
}

// DecodeExtras decodes a request's extras as the connector sends them
// (kvshim_sched_match's extras_json):
//
//	{"cache_salt": string,
//	 "lora": {"name": string, "path": string} | null,
//	 "mm": [{"hash": string, "offset": int, "length": int}, ...]}
//
// Every member is optional (absent or null: none); a LoRA object needs both
// its members, an mm input all three. A structure, never a joined string, so
// that no separator inside a name or path can make two adapters one. Unknown
// members, a wrong JSON type or trailing bytes are refused with ErrBadExtras
// naming the field (such as lora.name or mm[1].offset); the result is
// validated as Validate does.
func DecodeExtras(b []byte) (Extras, error) {
	var ex Extras
	var top map[string]json.RawMessage
	if err := decodeMember(b, &top, "extras", "an object"); err != nil {
		return ex, err
	}
	if top == nil {
		return ex, fmt.Errorf("%w: extras: want an object, got null", ErrBadExtras)
	}
	for _, k := range slices.Sorted(maps.Keys(top)) {
		v := top[k]
		var err error
		switch k {
		case "cache_salt":
			err = decodeMember(v, &ex.CacheSalt, "cache_salt", "a string")
		case "lora":
			ex.LoRA, err = decodeLoRA(v)
		case "mm":
			ex.MM, err = decodeMM(v)
		default:
			err = fmt.Errorf("%w: extras: unknown field %q", ErrBadExtras, k)
		}
		if err != nil {
			return Extras{}, err
		}
	}
	if err := ex.Validate(); err != nil {
		return Extras{}, err
	}
	return ex, nil
}

func decodeLoRA(raw json.RawMessage) (*LoRA, error) {
	if isJSONNull(raw) {
		return nil, nil
	}
	var obj map[string]json.RawMessage
	if err := decodeMember(raw, &obj, "lora", "an object {name, path}"); err != nil {
		return nil, err
	}
	l := &LoRA{}
	if err := decodeMembers(obj, "lora", map[string]any{"name": &l.Name, "path": &l.Path}); err != nil {
		return nil, err
	}
	return l, nil
}

func decodeMM(raw json.RawMessage) ([]MMInput, error) {
	var items []json.RawMessage
	if err := decodeMember(raw, &items, "mm", "an array"); err != nil {
		return nil, err
	}
	var mm []MMInput
	for i, it := range items {
		field := fmt.Sprintf("mm[%d]", i)
		var obj map[string]json.RawMessage
		if err := decodeMember(it, &obj, field, "an object {hash, offset, length}"); err != nil {
			return nil, err
		}
		if obj == nil {
			return nil, fmt.Errorf("%w: %s: want an object {hash, offset, length}, got null", ErrBadExtras, field)
		}
		var hash string
		var m MMInput
		if err := decodeMembers(obj, field, map[string]any{"hash": &hash, "offset": &m.Offset, "length": &m.Length}); err != nil {
			return nil, err
		}
		m.Hash = []byte(hash)
		mm = append(mm, m)
	}
	return mm, nil
}

// decodeMembers decodes the members of obj (the object at field) into dst,
// each required and non-null; any other member is refused.
func decodeMembers(obj map[string]json.RawMessage, field string, dst map[string]any) error {
	for _, k := range slices.Sorted(maps.Keys(obj)) {
		if _, ok := dst[k]; !ok {
			return fmt.Errorf("%w: %s: unknown field %q", ErrBadExtras, field, k)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(dst)) {
		v, ok := obj[k]
		if !ok || isJSONNull(v) {
			return fmt.Errorf("%w: %s.%s is missing", ErrBadExtras, field, k)
		}
		want := "a string"
		if _, isInt := dst[k].(*int); isInt {
			want = "an integer"
		}
		if err := decodeMember(v, dst[k], field+"."+k, want); err != nil {
			return err
		}
	}
	return nil
}

// decodeMember unmarshals raw into v, turning any failure into ErrBadExtras
// naming field and the JSON type found.
func decodeMember(raw []byte, v any, field, want string) error {
	if err := json.Unmarshal(raw, v); err != nil {
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			return fmt.Errorf("%w: %s: not JSON: %v", ErrBadExtras, field, err)
		}
		return fmt.Errorf("%w: %s: want %s, got %s", ErrBadExtras, field, want, jsonKind(raw))
	}
	return nil
}

func isJSONNull(raw []byte) bool { return string(bytes.TrimSpace(raw)) == "null" }

// jsonKind names the JSON type of raw for error messages.
func jsonKind(raw []byte) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '"':
		return "a string"
	case '{':
		return "an object"
	case '[':
		return "an array"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "the number " + string(raw)
}

func checkChunkSize(chunkSize int) error {
	if chunkSize <= 0 || chunkSize > MaxChunkSize {
		return fmt.Errorf("%w: %d (want 1..%d)", ErrBadChunkSize, chunkSize, MaxChunkSize)
	}
	return nil
}

// NumFullChunks is the number of full chunks in numTokens tokens: the number
// of hashes ChunkHashes returns. It is 0 for a chunk size ≤ 0.
func NumFullChunks(numTokens, chunkSize int) int {
	if chunkSize <= 0 || numTokens <= 0 {
		return 0
	}
	return numTokens / chunkSize
}

// RootHash is hash_{-1}: the chain's seed for namespace ns and the request's
// salt and LoRA (ex.MM does not enter the root).
func RootHash(ns kv.Namespace, ex Extras) (kv.Hash, error) {
	if err := ex.Validate(); err != nil {
		return kv.Hash{}, err
	}
	h := getHasher()
	defer putHasher(h)
	return h.root(ns, &ex), nil
}

// ChunkHashes returns the chained hashes of the full chunks of tokens (the
// partial tail is dropped): len = NumFullChunks(len(tokens), chunkSize).
// Hashes are deterministic across processes, restarts and machines, and the
// hashes of a prefix are a prefix of the hashes of the whole.
func ChunkHashes(ns kv.Namespace, tokens []uint32, chunkSize int, ex Extras) ([]kv.Hash, error) {
	if err := checkChunkSize(chunkSize); err != nil {
		return nil, err
	}
	return AppendChunkHashes(make([]kv.Hash, 0, len(tokens)/chunkSize), ns, tokens, chunkSize, ex)
}

// AppendChunkHashes appends the hashes ChunkHashes would return to dst and
// returns the extended slice; with enough capacity in dst it allocates
// nothing. On error dst is returned unchanged.
func AppendChunkHashes(dst []kv.Hash, ns kv.Namespace, tokens []uint32, chunkSize int, ex Extras) ([]kv.Hash, error) {
	if err := checkChunkSize(chunkSize); err != nil {
		return dst, err
	}
	if err := ex.Validate(); err != nil {
		return dst, err
	}
	h := getHasher()
	defer putHasher(h)
	root := h.root(ns, &ex)
	return h.chain(dst, root, 0, tokens, 0, chunkSize, ex.MM), nil
}

// ExtendChunkHashes extends prev, the hashes of an earlier, shorter state of
// the same request (same ns, chunkSize and extras; tokens only grew), to all
// full chunks of tokens, hashing only chunks len(prev) and later. It returns
// append(prev, new hashes...), so like append it may reuse prev's array.
// The result equals ChunkHashes(ns, tokens, chunkSize, ex) when prev is a
// prefix of it; prev itself is trusted, not re-verified.
func ExtendChunkHashes(ns kv.Namespace, prev []kv.Hash, tokens []uint32, chunkSize int, ex Extras) ([]kv.Hash, error) {
	return ExtendChunkHashesTail(ns, prev, tokens, 0, chunkSize, ex)
}

// ExtendChunkHashesTail is ExtendChunkHashes given only the request's tokens
// from position from on (tail = tokens[from:]), so that a long request's
// prefix, already hashed in prev, need not be materialized: from must not
// be past the first token prev does not cover (len(prev)*chunkSize).
func ExtendChunkHashesTail(ns kv.Namespace, prev []kv.Hash, tail []uint32, from, chunkSize int, ex Extras) ([]kv.Hash, error) {
	if err := checkChunkSize(chunkSize); err != nil {
		return prev, err
	}
	if from < 0 || from > len(prev)*chunkSize {
		return prev, fmt.Errorf("%w: tokens from %d, but %d hashes cover only the first %d",
			ErrBadPrefix, from, len(prev), len(prev)*chunkSize)
	}
	n := (from + len(tail)) / chunkSize
	if len(prev) > n {
		return prev, fmt.Errorf("%w: %d hashes but %d tokens hold %d full chunks of %d",
			ErrBadPrefix, len(prev), from+len(tail), n, chunkSize)
	}
	if err := ex.Validate(); err != nil {
		return prev, err
	}
	if len(prev) == n {
		return prev, nil
	}
	h := getHasher()
	defer putHasher(h)
	var last kv.Hash
	if len(prev) == 0 {
		last = h.root(ns, &ex)
	} else {
		last = prev[len(prev)-1]
	}
	return h.chain(prev, last, len(prev), tail, from, chunkSize, ex.MM), nil
}
