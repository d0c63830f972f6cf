package shim

import (
	"errors"
	"fmt"

	"github.com/kvshim/kvshim/ipc"
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
	// ErrBadExtras: a cache salt, LoRA identity or multimodal input that
	// cannot be hashed (too long, empty mm hash, negative range, ...).
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

// Extras is everything besides token ids that makes two requests' KV differ.
// The zero value means "none" (an empty salt and an empty LoRA are the same
// as no salt and no LoRA).
type Extras struct {
	// CacheSalt is the request's cache_salt; it is mixed into the chain's
	// root, so every chunk hash of a salted request differs.
	CacheSalt string
	// LoRA is the adapter's identity (vLLM's lora_name; use a name that is
	// stable across restarts and machines, not the per-process int id).
	// Mixed into the root like the salt.
	LoRA string
	// MM lists the request's multimodal inputs in any order; each is mixed
	// into exactly the chunks its placeholder range overlaps.
	MM []MMInput
}

// Validate reports whether ex can be hashed.
func (ex *Extras) Validate() error {
	if len(ex.CacheSalt) > MaxFieldLen {
		return fmt.Errorf("%w: cache salt is %d bytes, max %d", ErrBadExtras, len(ex.CacheSalt), MaxFieldLen)
	}
	if len(ex.LoRA) > MaxFieldLen {
		return fmt.Errorf("%w: LoRA identity is %d bytes, max %d", ErrBadExtras, len(ex.LoRA), MaxFieldLen)
	}
	for i, m := range ex.MM {
		switch {
		case len(m.Hash) == 0:
			return fmt.Errorf("%w: mm input %d has an empty hash", ErrBadExtras, i)
		case len(m.Hash) > MaxFieldLen:
			return fmt.Errorf("%w: mm input %d hash is %d bytes, max %d", ErrBadExtras, i, len(m.Hash), MaxFieldLen)
		case m.Offset < 0 || m.Offset >= maxTokenPos:
			return fmt.Errorf("%w: mm input %d offset %d out of range", ErrBadExtras, i, m.Offset)
		case m.Length <= 0 || m.Length >= maxTokenPos:
			return fmt.Errorf("%w: mm input %d length %d out of range", ErrBadExtras, i, m.Length)
		}
	}
	return nil
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
// salt and LoRA identity (ex.MM does not enter the root).
func RootHash(ns ipc.Namespace, ex Extras) (ipc.Hash, error) {
	if err := ex.Validate(); err != nil {
		return ipc.Hash{}, err
	}
	h := getHasher()
	defer putHasher(h)
	return h.root(ns, &ex), nil
}

// ChunkHashes returns the chained hashes of the full chunks of tokens (the
// partial tail is dropped): len = NumFullChunks(len(tokens), chunkSize).
// Hashes are deterministic across processes, restarts and machines, and the
// hashes of a prefix are a prefix of the hashes of the whole.
func ChunkHashes(ns ipc.Namespace, tokens []uint32, chunkSize int, ex Extras) ([]ipc.Hash, error) {
	if err := checkChunkSize(chunkSize); err != nil {
		return nil, err
	}
	return AppendChunkHashes(make([]ipc.Hash, 0, len(tokens)/chunkSize), ns, tokens, chunkSize, ex)
}

// AppendChunkHashes appends the hashes ChunkHashes would return to dst and
// returns the extended slice; with enough capacity in dst it allocates
// nothing. On error dst is returned unchanged.
func AppendChunkHashes(dst []ipc.Hash, ns ipc.Namespace, tokens []uint32, chunkSize int, ex Extras) ([]ipc.Hash, error) {
	if err := checkChunkSize(chunkSize); err != nil {
		return dst, err
	}
	if err := ex.Validate(); err != nil {
		return dst, err
	}
	h := getHasher()
	defer putHasher(h)
	root := h.root(ns, &ex)
	return h.chain(dst, root, 0, tokens, chunkSize, ex.MM), nil
}

// ExtendChunkHashes extends prev, the hashes of an earlier, shorter state of
// the same request (same ns, chunkSize and extras; tokens only grew), to all
// full chunks of tokens, hashing only chunks len(prev) and later. It returns
// append(prev, new hashes...), so like append it may reuse prev's array.
// The result equals ChunkHashes(ns, tokens, chunkSize, ex) when prev is a
// prefix of it; prev itself is trusted, not re-verified.
func ExtendChunkHashes(ns ipc.Namespace, prev []ipc.Hash, tokens []uint32, chunkSize int, ex Extras) ([]ipc.Hash, error) {
	if err := checkChunkSize(chunkSize); err != nil {
		return prev, err
	}
	n := len(tokens) / chunkSize
	if len(prev) > n {
		return prev, fmt.Errorf("%w: %d hashes but %d tokens hold %d full chunks of %d",
			ErrBadPrefix, len(prev), len(tokens), n, chunkSize)
	}
	if err := ex.Validate(); err != nil {
		return prev, err
	}
	if len(prev) == n {
		return prev, nil
	}
	h := getHasher()
	defer putHasher(h)
	var last ipc.Hash
	if len(prev) == 0 {
		last = h.root(ns, &ex)
	} else {
		last = prev[len(prev)-1]
	}
	return h.chain(prev, last, len(prev), tokens, chunkSize, ex.MM), nil
}
