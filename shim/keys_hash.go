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

	"github.com/kvshim/kvshim/ipc"
)

// Wire format v1 of chunk keys (see doc.go). Every byte written below is part
// of every stored key: change nothing without bumping these tags and the
// golden vectors in testdata/.
//
// The tags differ in their first bytes after "kvshim.", so a root message can
// never be parsed as a chunk message or a namespace message. The chunk tag is
// 15 bytes so that a 256-token chunk message (15+32+4+1024+4 = 1079 bytes)
// plus SHA-256 padding fills exactly 17 blocks.
const (
	rootTag  = "kvshim.root.v1"
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

func (h *chunkHasher) digest() (out ipc.Hash) {
	h.sum = h.h.Sum(h.sum[:0])
	copy(out[:], h.sum)
	return out
}

// root = H(rootTag ‖ ns ‖ lp(salt) ‖ lp(lora)).
func (h *chunkHasher) root(ns ipc.Namespace, ex *Extras) ipc.Hash {
	b := append(h.buf[:0], rootTag...)
	b = append(b, ns[:]...)
	b = appendField(b, ex.CacheSalt)
	b = appendField(b, ex.LoRA)
	h.buf = b
	h.h.Reset()
	h.h.Write(b)
	return h.digest()
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

// chain appends the hashes of full chunks first, first+1, ... of tokens to
// dst, starting from prev (the hash of chunk first-1, or the root). Inputs
// are validated by the caller.
//
// Chunk message: chunkTag ‖ prev ‖ u32 n ‖ n × u32le token ‖ u32 k ‖
// k × (lp(mm hash) ‖ u64le offset ‖ u64le length), where the k inputs are
// those whose [offset, offset+length) overlaps the chunk, in canonical order.
func (h *chunkHasher) chain(dst []ipc.Hash, prev ipc.Hash, first int, tokens []uint32, chunkSize int, mm []MMInput) []ipc.Hash {
	n := len(tokens) / chunkSize
	if first >= n {
		return dst
	}
	dst = slices.Grow(dst, n-first)
	mm = h.sortedMM(mm)
	lo := 0 // inputs before lo end at or before the current chunk's start
	for i := first; i < n; i++ {
		start, end := i*chunkSize, (i+1)*chunkSize
		chunk := tokens[start:end]

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
		countAt := len(b)
		b = binary.LittleEndian.AppendUint32(b, 0)
		k := uint32(0)
		for j := lo; j < len(mm) && mm[j].Offset < end; j++ {
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
		h.h.Write(b)
		h.buf = b

		prev = h.digest()
		dst = append(dst, prev)
	}
	return dst
}
