package shim

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"slices"
	"sync"
	"unsafe"

	"github.com/kvshim/kvshim/kv"
)

// Wire format of chunk keys. Every byte written below is part of every stored
// key: change nothing without bumping these tags and the golden vectors in
// testdata/. appendRootMsg and appendMMSection are the encodings of the
// per-request inputs; keys_fuzz_test.go checks that they are injective.
//
// The tags differ in their first bytes after "kvshim.", so a root message can
// never be parsed as a chunk message or a namespace message. The chunk tag is
// 15 bytes so that a 256-token chunk message (15+32+4+1024+4 = 1079 bytes)
// plus SHA-256 padding fills exactly 17 blocks.
//
// Root v2 (root v1 hashed a single LoRA string, which the connector built as
// "name:path", so ("a:b", "c") and ("a", "b:c") shared keys): the LoRA is a
// (name, path) pair behind a presence byte. Chunk messages are unchanged, but
// every chain starts at a root, so every v2 key differs from every v1 key:
// data stored under v1 keys is never hit again (a miss, never wrong bytes).
const (
	rootTag  = "kvshim.root.v2"
	chunkTag = "kvshim.chunk.v1"
)

// nativeLE: token ids can be fed to SHA-256 straight from the []uint32,
// without encoding them. A variable so tests exercise the encoding path too.
var nativeLE = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// chunkHasher is the reusable state of one hashing call: one SHA-256 state and
// scratch buffers, pooled so steady-state calls allocate nothing.
type chunkHasher struct {
	h   hash.Hash
	buf []byte    // headers, multimodal sections, big-endian token encoding
	sum []byte    // Sum output, cap 32
	mm  []MMInput // sorted copy of unsorted multimodal inputs
}

var hasherPool = sync.Pool{New: func() any {
	return &chunkHasher{h: sha256.New(), buf: make([]byte, 0, 128), sum: make([]byte, 0, sha256.Size)}
}}

func getHasher() *chunkHasher { return hasherPool.Get().(*chunkHasher) }

func putHasher(h *chunkHasher) {
	clear(h.mm) // do not keep callers' mm hash bytes alive
	h.mm = h.mm[:0]
	if cap(h.buf) > 64<<10 {
		h.buf = make([]byte, 0, 128)
	}
	hasherPool.Put(h)
}

func appendField(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

func (h *chunkHasher) digest() (out kv.Hash) {
	h.sum = h.h.Sum(h.sum[:0])
	copy(out[:], h.sum)
	return out
}

// appendRootMsg appends the root message of namespace ns and ex to b:
//
//	rootTag ‖ ns ‖ lp(cache_salt) ‖ 0x00                         no LoRA
//	rootTag ‖ ns ‖ lp(cache_salt) ‖ 0x01 ‖ lp(name) ‖ lp(path)   LoRA
//
// ns is fixed-size (16 bytes) and lp(x) = u32le len(x) ‖ x, so reading left
// to right every field's end is known before the next one starts, and the
// presence byte says whether a LoRA follows: two different (ns, salt, LoRA)
// never give the same message. ex.MM does not enter the root.
func appendRootMsg(b []byte, ns kv.Namespace, ex *Extras) []byte {
	b = append(b, rootTag...)
	b = append(b, ns[:]...)
	b = appendField(b, ex.CacheSalt)
	if ex.LoRA == nil {
		return append(b, 0)
	}
	b = append(b, 1)
	b = appendField(b, ex.LoRA.Name)
	return appendField(b, ex.LoRA.Path)
}

// root = H(appendRootMsg(ns, ex)).
func (h *chunkHasher) root(ns kv.Namespace, ex *Extras) kv.Hash {
	h.buf = appendRootMsg(h.buf[:0], ns, ex)
	h.h.Reset()
	h.h.Write(h.buf)
	return h.digest()
}

// appendMMSection appends the multimodal section of the chunk of tokens
// [start, end) to b:
//
//	u32le k ‖ k × (lp(hash) ‖ u64le offset ‖ u64le length)
//
// over the inputs of mm whose [offset, offset+length) overlaps the chunk, in
// mm's order (the caller passes canonical order, see sortedMM). The count
// comes first and every input is length-prefixed or fixed-size, so the
// section encodes exactly that list; no inputs is k = 0. mm must be sorted by
// offset: the scan stops at the first input that starts at or after end.
func appendMMSection(b []byte, mm []MMInput, start, end int) []byte {
	countAt := len(b)
	b = binary.LittleEndian.AppendUint32(b, 0)
	k := uint32(0)
	for j := 0; j < len(mm) && mm[j].Offset < end; j++ {
		if mm[j].Offset+mm[j].Length <= start {
			continue
		}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(mm[j].Hash)))
		b = append(b, mm[j].Hash...)
		b = binary.LittleEndian.AppendUint64(b, uint64(mm[j].Offset))
		b = binary.LittleEndian.AppendUint64(b, uint64(mm[j].Length))
		k++
	}
	binary.LittleEndian.PutUint32(b[countAt:], k)
	return b
}

func compareMM(a, b MMInput) int {
	return cmp.Or(cmp.Compare(a.Offset, b.Offset), cmp.Compare(a.Length, b.Length), bytes.Compare(a.Hash, b.Hash))
}

// sortedMM returns mm in canonical order (offset, length, hash), copying only
// when the caller's order differs, so key identity never depends on it.
func (h *chunkHasher) sortedMM(mm []MMInput) []MMInput {
	if slices.IsSortedFunc(mm, compareMM) {
		return mm
	}
	h.mm = append(h.mm[:0], mm...)
	slices.SortFunc(h.mm, compareMM)
	return h.mm
}

// chain appends the hashes of full chunks first, first+1, ... of a request
// whose tokens from position base on are tokens (base ≤ first·chunkSize) to
// dst, starting from prev (the hash of chunk first-1, or the root). Inputs
// are validated by the caller.
//
// Chunk message: chunkTag ‖ prev ‖ u32le n ‖ n × u32le token ‖ the
// appendMMSection of the chunk, where n = chunkSize: prev is fixed-size and
// the token count comes before the tokens, so the message is unambiguous.
func (h *chunkHasher) chain(dst []kv.Hash, prev kv.Hash, first int, tokens []uint32, base, chunkSize int, mm []MMInput) []kv.Hash {
	n := (base + len(tokens)) / chunkSize
	if first >= n {
		return dst
	}
	dst = slices.Grow(dst, n-first)
	mm = h.sortedMM(mm)
	lo := 0 // inputs before lo end at or before the current chunk's start
	for i := first; i < n; i++ {
		start, end := i*chunkSize, (i+1)*chunkSize
		chunk := tokens[start-base : end-base]

		b := append(h.buf[:0], chunkTag...)
		b = append(b, prev[:]...)
		b = binary.LittleEndian.AppendUint32(b, uint32(chunkSize))
		h.h.Reset()
		if nativeLE {
			h.h.Write(b)
			h.h.Write(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(chunk))), 4*len(chunk)))
			b = b[:0]
		} else {
			for _, t := range chunk {
				b = binary.LittleEndian.AppendUint32(b, t)
			}
		}

		// Multimodal section. mm is sorted by offset; an input whose end is
		// ≤ start can never overlap this or a later chunk.
		for lo < len(mm) && mm[lo].Offset+mm[lo].Length <= start {
			lo++
		}
		b = appendMMSection(b, mm[lo:], start, end)
		h.h.Write(b)
		h.buf = b

		prev = h.digest()
		dst = append(dst, prev)
	}
	return dst
}

// PlainChunkMessage returns the parts of the chunk message of a chunk with no
// multimodal input, which chain hashes as pre ‖ prev ‖ mid ‖ tokens (u32le)
// ‖ suf: for a caller that hashes the chain as it reads the tokens (the
// library's reader of Python lists), then MatchHashes. The bytes are
// chain's own (TestPlainChunkMessageIsChains).
func PlainChunkMessage(chunkSize int) (pre, mid, suf []byte) {
	return []byte(chunkTag), binary.LittleEndian.AppendUint32(nil, uint32(chunkSize)), appendMMSection(nil, nil, 0, chunkSize)
}
