package shim

import (
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
)

// plainChain hashes tokens' full chunks from root the way a caller of
// MatchHashes does: SHA-256 over PlainChunkMessage's parts.
func plainChain(root kv.Hash, tokens []uint32, chunkSize int) []kv.Hash {
	pre, mid, suf := PlainChunkMessage(chunkSize)
	var out []kv.Hash
	prev := root
	for c := 0; (c+1)*chunkSize <= len(tokens); c++ {
		h := sha256.New()
		h.Write(pre)
		h.Write(prev[:])
		h.Write(mid)
		for _, t := range tokens[c*chunkSize : (c+1)*chunkSize] {
			h.Write([]byte{byte(t), byte(t >> 8), byte(t >> 16), byte(t >> 24)})
		}
		h.Write(suf)
		copy(prev[:], h.Sum(nil))
		out = append(out, prev)
	}
	return out
}

func TestPlainChunkMessageIsChains(t *testing.T) {
	for _, cs := range []int{1, 16, 256, 1000} {
		tokens := testTokens(3*cs+1, uint32(cs))
		root, err := RootHash(testNS, Extras{CacheSalt: "salt"})
		assert.NilError(t, err)
		want, err := ChunkHashes(testNS, tokens, cs, Extras{CacheSalt: "salt"})
		assert.NilError(t, err)
		assert.DeepEqual(t, plainChain(root, tokens, cs), want)
	}
}

// A caller that keys a prompt itself (KeyRoot, then its own chain, then
// MatchHashes) gets Match's answers; wrong counts and keys of a generation a
// reset ended are refused, and a request already keyed ignores the keys.
func TestMatchHashesIsMatch(t *testing.T) {
	r := newRig(t, 1)
	tokens := tokensOf(5, 2)
	_, saved := saveChunks(t, r, "save", tokens, 3)
	assert.Equal(t, saved, 3)
	prompt := withTail(tokens)

	hashed := func(req string, gen uint64, hashes []kv.Hash) (int, error) {
		var n int
		var err error
		testkit.Eventually(t, 5*time.Second, "the lookup of "+req+" to be answered", func() bool {
			var pending bool
			n, pending, err = r.sched.MatchHashes(req, len(prompt), hashes, gen, Extras{}, 0)
			return err != nil || !pending
		})
		return n, err
	}
	root, gen, err := r.sched.KeyRoot(Extras{})
	assert.NilError(t, err)
	keys := plainChain(root, prompt, tChunk)
	assert.Equal(t, len(keys), 3)
	n, err := hashed("h1", gen, keys)
	assert.NilError(t, err)
	assert.Equal(t, n, r.match(t, "m1", prompt, Extras{}, 0))
	assert.Equal(t, n, 3*tChunk)
	r.sched.Finished("h1")
	r.sched.Finished("m1")

	_, err = hashed("short", gen, keys[:2])
	assert.Assert(t, errors.Is(err, ErrBadPrefix), "%v", err)
	assert.Assert(t, !r.sched.Keyed("short"))
	_, _, err = r.sched.MatchHashes("bad", len(prompt), keys, gen, Extras{CacheSalt: string(make([]byte, MaxFieldLen+1))}, 0)
	assert.Assert(t, errors.Is(err, ErrBadExtras), "%v", err)

	// A reset between KeyRoot and MatchHashes: the keys are stale.
	_, gen, err = r.sched.KeyRoot(Extras{})
	assert.NilError(t, err)
	_, err = r.sched.Reset()
	assert.NilError(t, err)
	_, err = hashed("h2", gen, keys)
	assert.Assert(t, errors.Is(err, ErrStaleRoot), "%v", err)
	assert.Assert(t, !r.sched.Keyed("h2"))
	root2, gen2, err := r.sched.KeyRoot(Extras{})
	assert.NilError(t, err)
	assert.Assert(t, gen2 > gen && root2 != root)
	n, err = hashed("h2", gen2, plainChain(root2, prompt, tChunk))
	assert.NilError(t, err)
	assert.Equal(t, n, 0) // the reset made the saved chunks miss
	// Keyed: asked again, the keys given are not read.
	n, err = hashed("h2", 0, nil)
	assert.NilError(t, err)
	assert.Equal(t, n, 0)
}
