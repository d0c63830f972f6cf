package layout

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math/bits"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
)

// Object format: a chunk object is an objfmt header (HeaderSize bytes:
// magic, format version, sizes, layout fingerprint, the object's key, a
// header CRC and the payload CRC slot; the byte table, and where payload
// CRCs are set and checked, are in package objfmt) followed by the payload
// in this layout's natural per-block order.
const (
	HeaderSize    = objfmt.HeaderSize
	FormatVersion = objfmt.Version
)

// Header is the decoded object header.
type Header = objfmt.Header

// ErrKeyMismatch reports an intact object whose header names another key
// (namespace, rank or chunk hash) than the one it was read under: bytes
// stored or copied under the wrong name. Errors that wrap it also match
// ErrCorrupt.
var ErrKeyMismatch = objfmt.ErrKeyMismatch

// DecodeHeader parses and checks a header (magic, version, size, header
// CRC). Errors wrap ErrCorrupt.
func DecodeHeader(src []byte) (Header, error) {
	h, err := objfmt.Decode(src)
	return h, wrapCorrupt(err)
}

// wrapCorrupt makes an objfmt error match this package's ErrCorrupt too
// (and still objfmt's sentinels, ErrKeyMismatch included).
func wrapCorrupt(err error) error {
	if err == nil {
		return nil
	}
	return corruptError{err}
}

type corruptError struct{ err error }

func (e corruptError) Error() string   { return "layout: " + e.err.Error() }
func (e corruptError) Unwrap() []error { return []error{ErrCorrupt, e.err} }

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
// size, chunk tokens, fingerprint, the object's key and the payload CRC
// (a pass over the payload: CRC-32C, GB/s per core). obj must be exactly
// ObjectSize(ChunkTokens()) bytes.
func (l *Layout) SealObject(obj []byte, key kv.Key) error {
	if err := l.checkObjectSize(obj); err != nil {
		return err
	}
	return objfmt.Seal(obj, l.header(key))
}

// SealHeader is SealObject without the payload pass: it writes the
// HeaderSize header bytes and leaves the payload CRC slot empty (the L2
// store sets it later, objfmt.SetPayloadCRC). It reads no payload byte.
func (l *Layout) SealHeader(obj []byte, key kv.Key) error {
	if err := l.checkObjectSize(obj); err != nil {
		return err
	}
	return objfmt.SealHeader(obj, l.header(key))
}

func (l *Layout) header(key kv.Key) Header {
	return Header{ChunkTokens: uint32(l.chunkTokens), Fingerprint: l.fp, Key: key}
}

func (l *Layout) checkObjectSize(obj []byte) error {
	if want, _ := l.ObjectSize(l.chunkTokens); uint64(len(obj)) != want {
		return geomErr(l.tensors[0].name, "object", "%d bytes, want %d", len(obj), want)
	}
	return nil
}

// VerifyObject checks obj's header against this layout and key
// (CheckHeader) and the payload's checksum, which must be set (an object
// sealed by SealHeader whose CRC was never set fails, wrapping
// objfmt.ErrNoPayloadCRC). Any mismatch wraps ErrCorrupt; a header that
// names another key wraps ErrKeyMismatch too. The checksum reads the whole
// payload on the CPU.
func (l *Layout) VerifyObject(obj []byte, key kv.Key) error {
	h, err := l.checkHeader(obj, key)
	if err != nil {
		return err
	}
	return wrapCorrupt(h.CheckPayload(obj))
}

// CheckHeader checks obj's header only: magic, version, header checksum,
// the form of the payload CRC slot (empty or set; the CRC itself is not
// checked), the key it names against key (ErrKeyMismatch), fingerprint,
// chunk tokens and size against this layout. It reads HeaderSize bytes, so
// it suits a restore path whose payloads were verified when they entered
// L1 (objfmt: the default policy). Mismatches wrap ErrCorrupt.
func (l *Layout) CheckHeader(obj []byte, key kv.Key) error {
	_, err := l.checkHeader(obj, key)
	return err
}

func (l *Layout) checkHeader(obj []byte, key kv.Key) (Header, error) {
	h, err := DecodeHeader(obj)
	if err != nil {
		return h, err
	}
	if err := h.CheckKey(key); err != nil {
		return h, wrapCorrupt(err)
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
