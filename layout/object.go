package layout

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash/crc32"
	"math/bits"
)

// Object format. A chunk object is a 64-byte header followed by the payload:
//
//	off  size  field
//	  0     4  magic "KVSO"
//	  4     2  format version (FormatVersion)
//	  6     2  header size (64)
//	  8     8  payload size in bytes
//	 16     4  chunk tokens
//	 20     4  payload CRC-32C (Castagnoli)
//	 24    32  layout fingerprint (SHA-256)
//	 56     4  reserved, zero
//	 60     4  header CRC-32C over bytes 0..59
const (
	HeaderSize    = 64
	FormatVersion = 1
	magic         = "KVSO"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Header is the decoded object header.
type Header struct {
	Version     uint16
	PayloadSize uint64
	ChunkTokens uint32
	PayloadCRC  uint32
	Fingerprint [32]byte
}

// Encode writes h into dst[:HeaderSize] and seals it with the header CRC.
func (h *Header) Encode(dst []byte) {
	_ = dst[HeaderSize-1]
	copy(dst[0:4], magic)
	binary.LittleEndian.PutUint16(dst[4:], h.Version)
	binary.LittleEndian.PutUint16(dst[6:], HeaderSize)
	binary.LittleEndian.PutUint64(dst[8:], h.PayloadSize)
	binary.LittleEndian.PutUint32(dst[16:], h.ChunkTokens)
	binary.LittleEndian.PutUint32(dst[20:], h.PayloadCRC)
	copy(dst[24:56], h.Fingerprint[:])
	binary.LittleEndian.PutUint32(dst[56:], 0)
	binary.LittleEndian.PutUint32(dst[60:], crc32.Checksum(dst[:60], castagnoli))
}

// DecodeHeader parses and checks a header (magic, version, size, header
// CRC). Errors wrap ErrCorrupt.
func DecodeHeader(src []byte) (Header, error) {
	var h Header
	if len(src) < HeaderSize {
		return h, corruptErr("object of %d bytes is shorter than its header", len(src))
	}
	if string(src[0:4]) != magic {
		return h, corruptErr("bad magic %q", src[0:4])
	}
	if got, want := binary.LittleEndian.Uint32(src[60:]), crc32.Checksum(src[:60], castagnoli); got != want {
		return h, corruptErr("header checksum %#08x, want %#08x", got, want)
	}
	h.Version = binary.LittleEndian.Uint16(src[4:])
	if h.Version != FormatVersion {
		return h, corruptErr("format version %d, want %d", h.Version, FormatVersion)
	}
	if hs := binary.LittleEndian.Uint16(src[6:]); hs != HeaderSize {
		return h, corruptErr("header size %d, want %d", hs, HeaderSize)
	}
	h.PayloadSize = binary.LittleEndian.Uint64(src[8:])
	h.ChunkTokens = binary.LittleEndian.Uint32(src[16:])
	h.PayloadCRC = binary.LittleEndian.Uint32(src[20:])
	copy(h.Fingerprint[:], src[24:56])
	return h, nil
}

// PayloadSize is the payload bytes of a chunk of chunkTokens tokens.
func (l *Layout) PayloadSize(chunkTokens int) (uint64, error) {
	if chunkTokens <= 0 || int64(chunkTokens)%l.blockSize != 0 {
		return 0, geomErr(l.tensors[0].name, "chunk_tokens", "%d is not a positive multiple of block size %d", chunkTokens, l.blockSize)
	}
	hi, lo := bits.Mul64(uint64(int64(chunkTokens)/l.blockSize), l.blockBytes)
	if hi != 0 {
		return 0, geomErr(l.tensors[0].name, "chunk_tokens", "%d overflows", chunkTokens)
	}
	return lo, nil
}

// ObjectSize is the header plus payload bytes of a chunk of chunkTokens.
func (l *Layout) ObjectSize(chunkTokens int) (uint64, error) {
	p, err := l.PayloadSize(chunkTokens)
	if err != nil {
		return 0, err
	}
	return p + HeaderSize, nil
}

// Fingerprint is a stable digest of everything that changes the bytes of an
// object: object format version, backend, dtype size, block size, group, and
// per tensor (in order) its name, dims with sizes, the physical order of its
// strides and its run structure. Pointers and block counts are excluded, so
// two processes with the same model and layout agree.
func (l *Layout) Fingerprint() [32]byte { return l.fp }

// FingerprintHex is Fingerprint as 64 hex digits (for namespaces and logs).
func (l *Layout) FingerprintHex() string { return hex.EncodeToString(l.fp[:]) }

// SealObject fills obj's header for a payload already in obj[HeaderSize:]:
// payload CRC, size, chunk tokens, fingerprint. obj must be exactly
// ObjectSize(ChunkTokens()) bytes.
func (l *Layout) SealObject(obj []byte) error {
	want, _ := l.ObjectSize(l.chunkTokens)
	if uint64(len(obj)) != want {
		return geomErr(l.tensors[0].name, "object", "%d bytes, want %d", len(obj), want)
	}
	h := Header{Version: FormatVersion, PayloadSize: want - HeaderSize, ChunkTokens: uint32(l.chunkTokens),
		PayloadCRC: crc32.Checksum(obj[HeaderSize:], castagnoli), Fingerprint: l.fp}
	h.Encode(obj)
	return nil
}

// VerifyObject checks obj's header against this layout (CheckHeader) and
// the payload's checksum. Any mismatch wraps ErrCorrupt. The checksum reads
// the whole payload on the CPU (CRC-32C, several GB/s per core).
func (l *Layout) VerifyObject(obj []byte) error {
	h, err := l.checkHeader(obj)
	if err != nil {
		return err
	}
	if got := crc32.Checksum(obj[HeaderSize:], castagnoli); got != h.PayloadCRC {
		return corruptErr("payload checksum %#08x, want %#08x", got, h.PayloadCRC)
	}
	return nil
}

// CheckHeader checks obj's header only: magic, version, header checksum,
// fingerprint, chunk tokens and size against this layout. It reads 64
// bytes, so it suits a restore path whose payloads were verified when they
// entered L1. Mismatches wrap ErrCorrupt.
func (l *Layout) CheckHeader(obj []byte) error {
	_, err := l.checkHeader(obj)
	return err
}

func (l *Layout) checkHeader(obj []byte) (Header, error) {
	h, err := DecodeHeader(obj)
	if err != nil {
		return h, err
	}
	want, _ := l.PayloadSize(l.chunkTokens)
	switch {
	case h.Fingerprint != l.fp:
		return h, corruptErr("layout fingerprint %x, want %x", h.Fingerprint[:6], l.fp[:6])
	case h.ChunkTokens != uint32(l.chunkTokens):
		return h, corruptErr("chunk of %d tokens, want %d", h.ChunkTokens, l.chunkTokens)
	case h.PayloadSize != want || uint64(len(obj)) != want+HeaderSize:
		return h, corruptErr("payload size %d (object %d bytes), want %d", h.PayloadSize, len(obj), want)
	}
	return h, nil
}

// signature is the canonical byte string of one tensor for the fingerprint.
func signature(d *TensorDesc, names []Dim, inner, outer []dimInfo) []byte {
	var b []byte
	str := func(s string) { b = binary.AppendUvarint(b, uint64(len(s))); b = append(b, s...) }
	num := func(v uint64) { b = binary.AppendUvarint(b, v) }
	str(d.Layer)
	// Logical dims (names and sizes, blocks count excluded).
	num(uint64(len(names)))
	for i, n := range names {
		str(string(n))
		if n == DimBlocks {
			num(0)
		} else {
			num(uint64(d.Shape[i]))
		}
	}
	// Physical order inside a block: dense inner dims, then the outer dims
	// that split a block into runs, each by ascending stride. Where the
	// blocks dim falls does not change object bytes, so it is left out.
	for _, part := range [][]dimInfo{inner, outer} {
		num(uint64(len(part)))
		for _, di := range part {
			str(string(di.name))
			num(uint64(di.size))
		}
	}
	return b
}

func fingerprint(l *Layout) [32]byte {
	h := sha256.New()
	var b []byte
	b = append(b, "kvshim-layout\x00"...)
	b = binary.AppendUvarint(b, FormatVersion)
	b = binary.AppendUvarint(b, uint64(len(l.backend)))
	b = append(b, l.backend...)
	b = binary.AppendUvarint(b, uint64(l.dtypeSize))
	b = binary.AppendUvarint(b, uint64(l.blockSize))
	b = binary.AppendVarint(b, int64(l.group))
	b = binary.AppendUvarint(b, uint64(len(l.tensors)))
	h.Write(b)
	for _, t := range l.tensors {
		var n [binary.MaxVarintLen64]byte
		h.Write(n[:binary.PutUvarint(n[:], uint64(len(t.sig)))])
		h.Write(t.sig)
	}
	var out [32]byte
	h.Sum(out[:0])
	return out
}
