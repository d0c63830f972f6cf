package layout

import (
	"encoding/binary"
	"errors"
	"hash/crc32"
	"testing"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
)

func mustNew(t *testing.T, chunk int, descs ...TensorDesc) *Layout {
	t.Helper()
	l, err := New(descs, chunk)
	assert.NilError(t, err)
	return l
}

func TestFingerprint(t *testing.T) {
	nhd := mustNew(t, 4, faNHD("l0", 0x1000), faNHD("l1", 0x9000))
	// Pointers and block counts do not matter.
	moved := mustNew(t, 4, faNHD("l0", 0x55000), faNHD("l1", 0x77000))
	assert.Equal(t, nhd.Fingerprint(), moved.Fingerprint())
	more := faNHD("l0", 0x1000)
	more.Shape = []int64{2, 64, tBS, tH, tD}
	more.Strides = []int64{64 * tRun, tRun, 8, 2, 2}
	more.Strides[3], more.Strides[2] = tDT*tD, tH*tD*tDT
	more1 := more
	more1.Layer, more1.DataPtr = "l1", 0x100000
	assert.Equal(t, nhd.Fingerprint(), mustNew(t, 4, more, more1).Fingerprint())
	// Chunk size is carried by the header and namespace, not the layout.
	assert.Equal(t, nhd.Fingerprint(), mustNew(t, 8, faNHD("l0", 0x1000), faNHD("l1", 0x9000)).Fingerprint())

	differ := map[string]*Layout{
		"hnd":         mustNew(t, 4, faHND("l0", 0x1000), faHND("l1", 0x9000)),
		"layer order": mustNew(t, 4, faNHD("l1", 0x1000), faNHD("l0", 0x9000)),
		"one layer":   mustNew(t, 4, faNHD("l0", 0x1000)),
		"flashinfer":  mustNew(t, 4, fiNHD("l0", 0x1000), fiNHD("l1", 0x9000)),
		"cross":       mustNew(t, 4, crossNHD(0x1000)),
		"cross hnd":   mustNew(t, 4, crossHND(0x1000)),
	}
	seen := map[[32]byte]string{nhd.Fingerprint(): "nhd"}
	for name, l := range differ {
		if other, dup := seen[l.Fingerprint()]; dup {
			t.Errorf("%s and %s share a fingerprint", name, other)
		}
		seen[l.Fingerprint()] = name
	}
	g := faNHD("l0", 0x1000)
	g.Group = 3
	assert.Assert(t, mustNew(t, 4, g).Fingerprint() != differ["one layer"].Fingerprint())
	d := faNHD("l0", 0x1000)
	d.DTypeSize = 1
	d.Strides = []int64{128, 32, 16, 8, 1}
	d.Shape = []int64{2, tNB, tBS, tH, 2 * tD}
	assert.Assert(t, mustNew(t, 4, d).Fingerprint() != differ["one layer"].Fingerprint())

	// Pinned: a change here changes every deployment's namespace. Bump
	// FormatVersion instead of editing this value by accident. (Format
	// version 2, the header that names its key, changed it; so did version
	// 3, the payload CRC slot outside the header CRC.)
	assert.Equal(t, nhd.FingerprintHex(), goldenFingerprint)
}

const goldenFingerprint = "192d085d4046e1ef3d044e413026af23ca57f25fd07f2e379b1b2b3490ae402b"

func TestObjectRoundTrip(t *testing.T) {
	l := mustNew(t, 4, faNHD("l0", 0x1000), faNHD("l1", 0x9000))
	size, err := l.ObjectSize(4)
	assert.NilError(t, err)
	assert.Equal(t, size, uint64(HeaderSize+256))
	assert.Equal(t, HeaderSize%64, 0) // payloads stay aligned
	o := make([]byte, size)
	for i := range o[HeaderSize:] {
		o[HeaderSize+i] = byte(i * 7)
	}
	key := kv.Key{Namespace: [16]byte{0xA1, 2}, Rank: 1, Hash: [32]byte{9, 8, 7}}
	assert.NilError(t, l.SealObject(o, key))
	assert.NilError(t, l.VerifyObject(o, key))
	h, err := DecodeHeader(o)
	assert.NilError(t, err)
	assert.Equal(t, h.PayloadSize, uint64(256))
	assert.Equal(t, h.ChunkTokens, uint32(4))
	assert.Equal(t, h.Fingerprint, l.Fingerprint())
	assert.Equal(t, h.Key, key)

	other := mustNew(t, 4, faHND("l0", 0x1000), faHND("l1", 0x9000))
	corrupt := map[string]func(b []byte) (*Layout, []byte){
		"payload bit":    func(b []byte) (*Layout, []byte) { b[HeaderSize+100] ^= 1; return l, b },
		"header bit":     func(b []byte) (*Layout, []byte) { b[9] ^= 1; return l, b },
		"key bit":        func(b []byte) (*Layout, []byte) { b[80] ^= 1; return l, b },
		"magic":          func(b []byte) (*Layout, []byte) { b[0] = 'X'; return l, b },
		"short":          func(b []byte) (*Layout, []byte) { return l, b[:40] },
		"header only":    func(b []byte) (*Layout, []byte) { return l, b[:HeaderSize] },
		"truncated":      func(b []byte) (*Layout, []byte) { return l, b[:len(b)-1] },
		"other layout":   func(b []byte) (*Layout, []byte) { return other, b },
		"other chunk":    func(b []byte) (*Layout, []byte) { return mustNew(t, 8, faNHD("l0", 0x1000), faNHD("l1", 0x9000)), b },
		"version resign": func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[4] = 9 }); return l, b },
		"version 1":      func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[4] = 1 }); return l, b },
		"size resign":    func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[8]++ }); return l, b },
		"hsize resign":   func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[6] = 64 }); return l, b },
		"tokens resign":  func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[16] = 8 }); return l, b },
		"fp resign":      func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[30] ^= 1 }); return l, b },
		"slot state":     func(b []byte) (*Layout, []byte) { b[125] ^= 1; return l, b },
		"slot crc":       func(b []byte) (*Layout, []byte) { b[121] ^= 1; return l, b },
	}
	for name, f := range corrupt {
		t.Run(name, func(t *testing.T) {
			b := append([]byte(nil), o...)
			lay, b := f(b)
			err := lay.VerifyObject(b, key)
			assert.ErrorIs(t, err, ErrCorrupt)
			assert.Assert(t, !errors.Is(err, ErrKeyMismatch), "%v", err)
			if name == "payload bit" || name == "slot crc" {
				assert.NilError(t, lay.CheckHeader(b, key)) // header-only check misses it
			} else {
				assert.ErrorIs(t, lay.CheckHeader(b, key), ErrCorrupt)
			}
		})
	}
	assert.NilError(t, l.CheckHeader(o, key))
	assert.ErrorIs(t, l.SealObject(o[:10], key), ErrGeometry)
	_, err = l.ObjectSize(3)
	assert.Check(t, is.ErrorContains(err, "chunk_tokens"))
}

// SealHeader writes the header SealObject writes, with the payload CRC
// slot empty and without reading the payload: CheckHeader accepts it,
// VerifyObject refuses it (no payload CRC) until the slot is set.
func TestSealHeader(t *testing.T) {
	l := mustNew(t, 4, faNHD("l0", 0x1000), faNHD("l1", 0x9000))
	size, err := l.ObjectSize(4)
	assert.NilError(t, err)
	full := make([]byte, size)
	for i := range full[HeaderSize:] {
		full[HeaderSize+i] = byte(i*5 + 1)
	}
	bare := append([]byte(nil), full...)
	key := kv.Key{Namespace: [16]byte{0xA1, 2}, Rank: 1, Hash: [32]byte{9, 8, 7}}
	assert.NilError(t, l.SealObject(full, key))
	assert.NilError(t, l.SealHeader(bare, key))
	assert.DeepEqual(t, bare[:120], full[:120])
	assert.DeepEqual(t, bare[120:HeaderSize], make([]byte, 8))
	assert.NilError(t, l.CheckHeader(bare, key))
	err = l.VerifyObject(bare, key)
	assert.ErrorIs(t, err, ErrCorrupt)
	assert.ErrorIs(t, err, objfmt.ErrNoPayloadCRC)
	_, set, err := objfmt.SetPayloadCRC(bare, key)
	assert.NilError(t, err)
	assert.Assert(t, set)
	assert.DeepEqual(t, bare, full)
	assert.NilError(t, l.VerifyObject(bare, key))
	assert.ErrorIs(t, l.SealHeader(bare[:10], key), ErrGeometry)
	assert.ErrorIs(t, l.SealHeader(append(bare, 0), key), ErrGeometry)
}

// An intact object read under another key (namespace, rank or chunk hash)
// is a key mismatch, which is also corruption, for both checks.
func TestObjectKeyMismatch(t *testing.T) {
	l := mustNew(t, 4, faNHD("l0", 0x1000), faNHD("l1", 0x9000))
	size, err := l.ObjectSize(4)
	assert.NilError(t, err)
	o := make([]byte, size)
	key := kv.Key{Namespace: [16]byte{0xA1}, Rank: 2, Hash: [32]byte{1, 2, 3}}
	assert.NilError(t, l.SealObject(o, key))
	otherNS, otherRank, otherHash := key, key, key
	otherNS.Namespace[15] = 1
	otherRank.Rank = 0
	otherHash.Hash[31] = 1
	for name, want := range map[string]kv.Key{"namespace": otherNS, "rank": otherRank, "hash": otherHash} {
		t.Run(name, func(t *testing.T) {
			for _, err := range []error{l.VerifyObject(o, want), l.CheckHeader(o, want)} {
				assert.ErrorIs(t, err, ErrKeyMismatch)
				assert.ErrorIs(t, err, ErrCorrupt)
				assert.ErrorContains(t, err, name)
			}
		})
	}
	// Resealing under the right key makes it verify: the key is all that differed.
	assert.NilError(t, l.SealObject(o, otherHash))
	assert.NilError(t, l.VerifyObject(o, otherHash))
	assert.ErrorIs(t, l.VerifyObject(o, key), ErrKeyMismatch)
}

// resign edits header bytes and recomputes the header CRC, so only the
// semantic checks can catch the change.
func resign(b []byte, edit func([]byte)) {
	edit(b)
	binary.LittleEndian.PutUint32(b[116:], crcOf(b[:116]))
}

func crcOf(b []byte) uint32 { return crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)) }
