package main

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp/cmpopts"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/shim"
)

// The list reader that hashes as it reads (kv_py_chain) must give exactly
// shim.ChunkHashes' keys, for every chunk size (the ids straddle SHA-256
// blocks differently), both of CPython's int layouts, ids of one and two
// 30-bit digits, and lists with or without a partial last chunk. Python
// lists themselves are read by tests/test_native.py; here the ints are made
// in C, in the layouts the reader reads.
func TestChainReaderIsChunkHashes(t *testing.T) {
	if !chainReads() {
		t.Skip("no SHA extensions on this CPU (or KVSHIM_LOOKUP_HASH=go): the chain reader is not used here")
	}
	ns := kv.Namespace{1, 2, 3}
	ex := shim.Extras{CacheSalt: "s"}
	root, err := shim.RootHash(ns, ex)
	assert.NilError(t, err)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, chunk := range []int{1, 2, 3, 13, 16, 256, 1000, 4096} {
		for _, n := range []int{0, chunk - 1, chunk, 3*chunk + 1, 7 * chunk} {
			ids := make([]uint32, n)
			for i := range ids {
				ids[i] = rng.Uint32N(1<<32 - 1) // 2^32-1 is the helper's out-of-range int
				if i%5 == 0 {
					ids[i] %= 1 << 30 // one digit
				}
				if i%11 == 0 {
					ids[i] = 0
				}
			}
			want, err := shim.ChunkHashes(ns, ids, chunk, ex)
			assert.NilError(t, err)
			for _, layout := range []int{1, 2} {
				got, keys, ok := fakeIntsChainKeys(ids, layout, root, chunk)
				assert.Assert(t, ok, "chunk %d n %d layout %d", chunk, n, layout)
				assert.Equal(t, got, n)
				assert.DeepEqual(t, keys, want, cmpopts.EquateEmpty())
			}
		}
	}
}

// An int the reader cannot read in place (here, one out of [0, 2^32)) ends
// the chain path, wherever it is: the caller reads the list with
// pyListTokens then, which names the item.
func TestChainReaderDeclinesBadInts(t *testing.T) {
	if !chainReads() {
		t.Skip("no SHA extensions on this CPU (or KVSHIM_LOOKUP_HASH=go)")
	}
	// 1000 ids of chunk 256: three full chunks and a partial tail [768, 1000).
	// Chunk 0, a chunk's last and the next chunk's first id, inside chunk 2,
	// the partial tail, its last id; past the list nothing is read.
	for _, at := range []int{0, 255, 256, 700, 900, 999, 1023} {
		ids := make([]uint32, 1024)
		ids[at] = 1<<32 - 1
		_, _, ok := fakeIntsChainKeys(ids[:1000], 2, kv.Hash{}, 256)
		assert.Equal(t, ok, at >= 1000, "bad id at %d", at)
	}
}

func FuzzChainReader(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8}, uint16(1), true)
	f.Add(make([]byte, 4*600), uint16(256), false)
	f.Fuzz(func(t *testing.T, raw []byte, chunk uint16, lvtag bool) {
		if !chainReads() {
			t.Skip("no SHA extensions")
		}
		cs := int(chunk%2048) + 1
		ids := make([]uint32, len(raw)/4)
		for i := range ids {
			ids[i] = min(binary.LittleEndian.Uint32(raw[4*i:]), 1<<32-2)
		}
		want, err := shim.ChunkHashes(kv.Namespace{}, ids, cs, shim.Extras{})
		assert.NilError(t, err)
		root, err := shim.RootHash(kv.Namespace{}, shim.Extras{})
		assert.NilError(t, err)
		layout := 1
		if lvtag {
			layout = 2
		}
		n, keys, ok := fakeIntsChainKeys(ids, layout, root, cs)
		assert.Assert(t, ok)
		assert.Equal(t, n, len(ids))
		assert.DeepEqual(t, keys, want, cmpopts.EquateEmpty())
	})
}
