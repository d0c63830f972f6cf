package layout

import (
	"encoding/binary"
	"hash/crc32"
	"testing"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
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
	// FormatVersion instead of editing this value by accident.
	assert.Equal(t, nhd.FingerprintHex(), goldenFingerprint)
}

const goldenFingerprint = "2045f8595d504800fe6525273c5c9f116b1f36bdab80000b3563921b060f5380"

func TestObjectRoundTrip(t *testing.T) {
	l := mustNew(t, 4, faNHD("l0", 0x1000), faNHD("l1", 0x9000))
	size, err := l.ObjectSize(4)
	assert.NilError(t, err)
	assert.Equal(t, size, uint64(HeaderSize+256))
	o := make([]byte, size)
	for i := range o[HeaderSize:] {
		o[HeaderSize+i] = byte(i * 7)
	}
	assert.NilError(t, l.SealObject(o))
	assert.NilError(t, l.VerifyObject(o))
	h, err := DecodeHeader(o)
	assert.NilError(t, err)
	assert.Equal(t, h.PayloadSize, uint64(256))
	assert.Equal(t, h.ChunkTokens, uint32(4))
	assert.Equal(t, h.Fingerprint, l.Fingerprint())

	other := mustNew(t, 4, faHND("l0", 0x1000), faHND("l1", 0x9000))
	corrupt := map[string]func(b []byte) (*Layout, []byte){
		"payload bit":    func(b []byte) (*Layout, []byte) { b[HeaderSize+100] ^= 1; return l, b },
		"header bit":     func(b []byte) (*Layout, []byte) { b[9] ^= 1; return l, b },
		"magic":          func(b []byte) (*Layout, []byte) { b[0] = 'X'; return l, b },
		"short":          func(b []byte) (*Layout, []byte) { return l, b[:40] },
		"truncated":      func(b []byte) (*Layout, []byte) { return l, b[:len(b)-1] },
		"other layout":   func(b []byte) (*Layout, []byte) { return other, b },
		"other chunk":    func(b []byte) (*Layout, []byte) { return mustNew(t, 8, faNHD("l0", 0x1000), faNHD("l1", 0x9000)), b },
		"version resign": func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[4] = 9 }); return l, b },
		"size resign":    func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[8]++ }); return l, b },
		"hsize resign":   func(b []byte) (*Layout, []byte) { resign(b, func(h []byte) { h[6] = 32 }); return l, b },
	}
	for name, f := range corrupt {
		t.Run(name, func(t *testing.T) {
			b := append([]byte(nil), o...)
			lay, b := f(b)
			assert.ErrorIs(t, lay.VerifyObject(b), ErrCorrupt)
			if name == "payload bit" {
				assert.NilError(t, lay.CheckHeader(b)) // header-only check misses it
			} else {
				assert.ErrorIs(t, lay.CheckHeader(b), ErrCorrupt)
			}
		})
	}
	assert.NilError(t, l.CheckHeader(o))
	assert.ErrorIs(t, l.SealObject(o[:10]), ErrGeometry)
	_, err = l.ObjectSize(3)
	assert.Check(t, is.ErrorContains(err, "chunk_tokens"))
}

// resign edits header bytes and recomputes the header CRC, so only the
// semantic checks can catch the change.
func resign(b []byte, edit func([]byte)) {
	edit(b)
	var h Header
	h.Version = binary.LittleEndian.Uint16(b[4:])
	h.PayloadSize = binary.LittleEndian.Uint64(b[8:])
	h.ChunkTokens = binary.LittleEndian.Uint32(b[16:])
	h.PayloadCRC = binary.LittleEndian.Uint32(b[20:])
	copy(h.Fingerprint[:], b[24:56])
	hs := b[6]
	h.Encode(b)
	b[6] = hs
	binary.LittleEndian.PutUint32(b[60:], crcOf(b[:60]))
}

func crcOf(b []byte) uint32 { return crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)) }
