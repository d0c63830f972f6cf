package objfmt

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
)

// Format constants.
const (
	// HeaderSize is the header's size in bytes (a multiple of 64).
	HeaderSize = 128
	// Version is the object format version this package writes and reads.
	Version = 2
	// Magic opens every object.
	Magic = "KVSO"
)

// Field offsets (see the package documentation).
const (
	offMagic       = 0
	offVersion     = 4
	offHeaderSize  = 6
	offPayloadSize = 8
	offChunkTokens = 16
	offPayloadCRC  = 20
	offFingerprint = 24
	offNamespace   = 56
	offRank        = 72
	offHash        = 76
	offReserved    = 108
	offHeaderCRC   = 124
)

var (
	// ErrCorrupt reports an object whose header or payload does not verify.
	ErrCorrupt = errors.New("corrupt object")
	// ErrKeyMismatch reports an intact object whose header names another
	// key (namespace, rank or chunk hash) than the one it was read under.
	// It wraps ErrCorrupt.
	ErrKeyMismatch = fmt.Errorf("%w: header names another key", ErrCorrupt)
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Key is an object's key: (namespace fingerprint, rank, chunk hash). The
// fields are raw bytes so this package needs no other kvshim package.
type Key struct {
	Namespace [16]byte
	Rank      uint32
	Hash      [32]byte
}

// String is a short form for logs: namespace and hash prefixes, rank.
func (k Key) String() string {
	return fmt.Sprintf("%s@%d@%s", hex.EncodeToString(k.Namespace[:4]), k.Rank, hex.EncodeToString(k.Hash[:8]))
}

// Header is a decoded object header (format Version).
type Header struct {
	PayloadSize uint64
	ChunkTokens uint32
	PayloadCRC  uint32
	Fingerprint [32]byte
	Key         Key
}

// Checksum is the CRC-32C (Castagnoli) of b, as stored in headers.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// Encode writes h into dst[:HeaderSize] (version, header size, reserved
// zero) and seals it with the header CRC. dst must hold HeaderSize bytes.
func (h *Header) Encode(dst []byte) {
	_ = dst[HeaderSize-1]
	le := binary.LittleEndian
	copy(dst[offMagic:], Magic)
	le.PutUint16(dst[offVersion:], Version)
	le.PutUint16(dst[offHeaderSize:], HeaderSize)
	le.PutUint64(dst[offPayloadSize:], h.PayloadSize)
	le.PutUint32(dst[offChunkTokens:], h.ChunkTokens)
	le.PutUint32(dst[offPayloadCRC:], h.PayloadCRC)
	copy(dst[offFingerprint:offNamespace], h.Fingerprint[:])
	copy(dst[offNamespace:offRank], h.Key.Namespace[:])
	le.PutUint32(dst[offRank:], h.Key.Rank)
	copy(dst[offHash:offReserved], h.Key.Hash[:])
	clear(dst[offReserved:offHeaderCRC])
	le.PutUint32(dst[offHeaderCRC:], Checksum(dst[:offHeaderCRC]))
}

// Decode parses and checks the header at the start of src: length, magic,
// format version, header size, header CRC and reserved bytes. It does not
// look at the payload. Errors wrap ErrCorrupt.
func Decode(src []byte) (Header, error) {
	var h Header
	le := binary.LittleEndian
	// Magic and version first, so an object of another format version
	// (shorter header, CRC elsewhere) is named as such.
	if len(src) < offHeaderSize {
		return h, corrupt("object of %d bytes is shorter than its header (%d)", len(src), HeaderSize)
	}
	if string(src[offMagic:offVersion]) != Magic {
		return h, corrupt("bad magic %q", src[offMagic:offVersion])
	}
	if v := le.Uint16(src[offVersion:]); v != Version {
		return h, corrupt("format version %d, want %d", v, Version)
	}
	if len(src) < HeaderSize {
		return h, corrupt("object of %d bytes is shorter than its header (%d)", len(src), HeaderSize)
	}
	if got, want := le.Uint32(src[offHeaderCRC:]), Checksum(src[:offHeaderCRC]); got != want {
		return h, corrupt("header checksum %#08x, want %#08x", got, want)
	}
	if hs := le.Uint16(src[offHeaderSize:]); hs != HeaderSize {
		return h, corrupt("header size %d, want %d", hs, HeaderSize)
	}
	for _, b := range src[offReserved:offHeaderCRC] {
		if b != 0 {
			return h, corrupt("reserved header bytes are not zero")
		}
	}
	h.PayloadSize = le.Uint64(src[offPayloadSize:])
	h.ChunkTokens = le.Uint32(src[offChunkTokens:])
	h.PayloadCRC = le.Uint32(src[offPayloadCRC:])
	copy(h.Fingerprint[:], src[offFingerprint:offNamespace])
	copy(h.Key.Namespace[:], src[offNamespace:offRank])
	h.Key.Rank = le.Uint32(src[offRank:])
	copy(h.Key.Hash[:], src[offHash:offReserved])
	return h, nil
}

// CheckKey reports, wrapping ErrKeyMismatch, whether the header names
// another key than want, and which part differs.
func (h *Header) CheckKey(want Key) error {
	switch got := h.Key; {
	case got.Namespace != want.Namespace:
		return fmt.Errorf("%w: namespace %x, want %x (rank %d, chunk hash %x)", ErrKeyMismatch,
			got.Namespace, want.Namespace, want.Rank, want.Hash)
	case got.Rank != want.Rank:
		return fmt.Errorf("%w: rank %d, want %d (chunk hash %x)", ErrKeyMismatch, got.Rank, want.Rank, want.Hash)
	case got.Hash != want.Hash:
		return fmt.Errorf("%w: chunk hash %x, want %x (rank %d)", ErrKeyMismatch, got.Hash, want.Hash, want.Rank)
	}
	return nil
}

// CheckSize reports whether the header's payload size matches an object of
// objLen bytes.
func (h *Header) CheckSize(objLen int) error {
	if objLen < HeaderSize || h.PayloadSize != uint64(objLen-HeaderSize) {
		return corrupt("payload size %d in an object of %d bytes", h.PayloadSize, objLen)
	}
	return nil
}

// CheckPayload verifies the payload CRC of obj (header + payload) against
// the header's. It reads the whole payload (CRC-32C: several GB/s per core).
func (h *Header) CheckPayload(obj []byte) error {
	if err := h.CheckSize(len(obj)); err != nil {
		return err
	}
	if got := Checksum(obj[HeaderSize:]); got != h.PayloadCRC {
		return corrupt("payload checksum %#08x, want %#08x", got, h.PayloadCRC)
	}
	return nil
}

// Seal fills obj's header for the payload already in obj[HeaderSize:]:
// h's fingerprint, chunk tokens and key, with the payload size and CRC
// computed here. obj must be at least HeaderSize bytes.
func Seal(obj []byte, h Header) error {
	if len(obj) < HeaderSize {
		return fmt.Errorf("objfmt: object of %d bytes has no room for its %d-byte header", len(obj), HeaderSize)
	}
	h.PayloadSize = uint64(len(obj) - HeaderSize)
	h.PayloadCRC = Checksum(obj[HeaderSize:])
	h.Encode(obj)
	return nil
}

// Verify decodes obj's header and checks it names want, that its payload
// size matches len(obj), and the payload CRC: the check for bytes that
// arrive from a disk or a network. It returns the header (valid only when
// err is nil). Errors wrap ErrCorrupt; a wrong key wraps ErrKeyMismatch.
func Verify(obj []byte, want Key) (Header, error) {
	h, err := Decode(obj)
	if err != nil {
		return h, err
	}
	if err := h.CheckKey(want); err != nil {
		return h, err
	}
	return h, h.CheckPayload(obj)
}

func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, args...))
}
