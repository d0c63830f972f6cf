package objfmt

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"sync/atomic"
	"unsafe"

	"github.com/kvshim/kvshim/kv"
)

// Format constants.
const (
	// HeaderSize is the header's size in bytes (a multiple of 64).
	HeaderSize = 128
	// Version is the object format version this package writes and reads.
	Version = 3
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
	offReserved1   = 20
	offFingerprint = 24
	offNamespace   = 56
	offRank        = 72
	offHash        = 76
	offReserved2   = 108
	offHeaderCRC   = 116
	// offSlot is the payload CRC slot: the payload CRC-32C (u32) then its
	// state (u32), outside the header CRC, written with one 8-byte store.
	offSlot = 120
)

// slotPresent is the slot state of a payload CRC that is set: the bytes
// "CRC1". A slot with state 0 (and CRC 0) has none; any other state is
// corrupt.
const slotPresent = 0x31435243

var (
	// ErrCorrupt reports an object whose header or payload does not verify.
	ErrCorrupt = errors.New("corrupt object")
	// ErrKeyMismatch reports an intact object whose header names another
	// key (namespace, rank or chunk hash) than the one it was read under.
	// It wraps ErrCorrupt.
	ErrKeyMismatch = fmt.Errorf("%w: header names another key", ErrCorrupt)
	// ErrNoPayloadCRC reports an object whose header is intact but whose
	// payload CRC slot is empty, read where a payload CRC is required
	// (Verify, CheckPayload). It wraps ErrCorrupt.
	ErrNoPayloadCRC = fmt.Errorf("%w: no payload checksum", ErrCorrupt)
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Header is a decoded object header (format Version).
type Header struct {
	PayloadSize uint64
	ChunkTokens uint32
	Fingerprint [32]byte
	Key         kv.Key
	// PayloadCRC is the CRC-32C of the payload when HasPayloadCRC: the
	// payload CRC slot, which the header CRC does not cover.
	PayloadCRC    uint32
	HasPayloadCRC bool
}

// Checksum is the CRC-32C (Castagnoli) of b, as stored in headers.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// Encode writes h into dst[:HeaderSize] (version, header size, reserved
// zero), seals it with the header CRC and writes the payload CRC slot
// (h.PayloadCRC when h.HasPayloadCRC, else empty). dst must hold
// HeaderSize bytes that nothing else reads or writes meanwhile.
func (h *Header) Encode(dst []byte) {
	_ = dst[HeaderSize-1]
	le := binary.LittleEndian
	copy(dst[offMagic:], Magic)
	le.PutUint16(dst[offVersion:], Version)
	le.PutUint16(dst[offHeaderSize:], HeaderSize)
	le.PutUint64(dst[offPayloadSize:], h.PayloadSize)
	le.PutUint32(dst[offChunkTokens:], h.ChunkTokens)
	clear(dst[offReserved1:offFingerprint])
	copy(dst[offFingerprint:offNamespace], h.Fingerprint[:])
	copy(dst[offNamespace:offRank], h.Key.Namespace[:])
	le.PutUint32(dst[offRank:], h.Key.Rank)
	copy(dst[offHash:offReserved2], h.Key.Hash[:])
	clear(dst[offReserved2:offHeaderCRC])
	le.PutUint32(dst[offHeaderCRC:], Checksum(dst[:offHeaderCRC]))
	copy(dst[offSlot:HeaderSize], slotBytes(h.PayloadCRC, h.HasPayloadCRC))
}

// slotBytes is the slot's byte image.
func slotBytes(crc uint32, present bool) []byte {
	b := make([]byte, 8)
	if present {
		binary.LittleEndian.PutUint32(b, crc)
		binary.LittleEndian.PutUint32(b[4:], slotPresent)
	}
	return b
}

// slotWord is the slot as an 8-byte word, when obj's slot is 8-byte
// aligned (objects in L1 are: 64-byte aligned; Go allocations of a header
// or more are too).
func slotWord(obj []byte) (*uint64, bool) {
	p := unsafe.Pointer(&obj[offSlot])
	if uintptr(p)%8 != 0 {
		return nil, false
	}
	return (*uint64)(p), true
}

// readSlot reads the slot of obj (at least HeaderSize bytes) in one 8-byte
// atomic load when it is aligned, so a reader never sees half of a
// concurrent SetPayloadCRC.
func readSlot(obj []byte) (crc, state uint32) {
	var b [8]byte
	if p, ok := slotWord(obj); ok {
		binary.NativeEndian.PutUint64(b[:], atomic.LoadUint64(p))
	} else {
		copy(b[:], obj[offSlot:HeaderSize])
	}
	return binary.LittleEndian.Uint32(b[:]), binary.LittleEndian.Uint32(b[4:])
}

// Decode parses and checks the header at the start of src: length, magic,
// format version, header size, header CRC, reserved bytes and the payload
// CRC slot's form (empty, or set). It does not look at the payload and
// does not require a payload CRC. Errors wrap ErrCorrupt.
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
	for _, r := range [][]byte{src[offReserved1:offFingerprint], src[offReserved2:offHeaderCRC]} {
		for _, b := range r {
			if b != 0 {
				return h, corrupt("reserved header bytes are not zero")
			}
		}
	}
	switch crc, state := readSlot(src); {
	case state == slotPresent:
		h.PayloadCRC, h.HasPayloadCRC = crc, true
	case state != 0 || crc != 0:
		return h, corrupt("payload checksum slot %#08x/%#08x is neither empty nor set", crc, state)
	}
	h.PayloadSize = le.Uint64(src[offPayloadSize:])
	h.ChunkTokens = le.Uint32(src[offChunkTokens:])
	copy(h.Fingerprint[:], src[offFingerprint:offNamespace])
	copy(h.Key.Namespace[:], src[offNamespace:offRank])
	h.Key.Rank = le.Uint32(src[offRank:])
	copy(h.Key.Hash[:], src[offHash:offReserved2])
	return h, nil
}

// CheckKey reports, wrapping ErrKeyMismatch, whether the header names
// another key than want, and which part differs.
func (h *Header) CheckKey(want kv.Key) error {
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

// CheckPayload verifies the payload of obj (header + payload) against the
// header's payload CRC, which must be set (ErrNoPayloadCRC). It reads the
// whole payload (CRC-32C: GB/s per core).
func (h *Header) CheckPayload(obj []byte) error {
	if err := h.CheckSize(len(obj)); err != nil {
		return err
	}
	if !h.HasPayloadCRC {
		return ErrNoPayloadCRC
	}
	if got := Checksum(obj[HeaderSize:]); got != h.PayloadCRC {
		return corrupt("payload checksum %#08x, want %#08x", got, h.PayloadCRC)
	}
	return nil
}

// Seal fills obj's header for the payload already in obj[HeaderSize:]:
// h's fingerprint, chunk tokens and key, with the payload size and the
// payload CRC computed here (a pass over the payload). obj must be at
// least HeaderSize bytes.
func Seal(obj []byte, h Header) error {
	if len(obj) < HeaderSize {
		return fmt.Errorf("objfmt: object of %d bytes has no room for its %d-byte header", len(obj), HeaderSize)
	}
	h.PayloadCRC, h.HasPayloadCRC = Checksum(obj[HeaderSize:]), true
	return sealAs(obj, h)
}

// SealHeader is Seal without the payload pass: the payload CRC slot is left
// empty, for SetPayloadCRC to fill later (the L2 store). It writes
// HeaderSize bytes and reads none.
func SealHeader(obj []byte, h Header) error {
	if len(obj) < HeaderSize {
		return fmt.Errorf("objfmt: object of %d bytes has no room for its %d-byte header", len(obj), HeaderSize)
	}
	h.PayloadCRC, h.HasPayloadCRC = 0, false
	return sealAs(obj, h)
}

func sealAs(obj []byte, h Header) error {
	h.PayloadSize = uint64(len(obj) - HeaderSize)
	h.Encode(obj)
	return nil
}

// Verify decodes obj's header and checks it names want, that its payload
// size matches len(obj), and the payload CRC, which must be set: the check
// for bytes that arrive from a disk or a network. It returns the header
// (valid only when err is nil). Errors wrap ErrCorrupt; a wrong key wraps
// ErrKeyMismatch, an empty payload CRC slot ErrNoPayloadCRC.
func Verify(obj []byte, want kv.Key) (Header, error) {
	h, err := VerifyHeader(obj, want)
	if err != nil {
		return h, err
	}
	return h, h.CheckPayload(obj)
}

// VerifyHeader is Verify without the payload: header, key and size. It
// reads HeaderSize bytes.
func VerifyHeader(obj []byte, want kv.Key) (Header, error) {
	h, err := Decode(obj)
	if err != nil {
		return h, err
	}
	if err := h.CheckKey(want); err != nil {
		return h, err
	}
	return h, h.CheckSize(len(obj))
}

// SetPayloadCRC gives a sealed object (header + payload, header verified
// under want) its payload CRC: when the slot is empty it computes the CRC
// of the payload and stores it with one atomic 8-byte store, so a reader
// that loads the slot concurrently sees it empty or set, never half of it;
// when the slot is set already it trusts it (whoever set it computed it
// from these bytes; readers that need the payload checked verify it).
// set reports whether this call wrote the slot. The payload must not change
// meanwhile, and only one goroutine may set a given object's slot. obj's
// slot must be 8-byte aligned (ErrUnaligned).
func SetPayloadCRC(obj []byte, want kv.Key) (h Header, set bool, err error) {
	if h, err = VerifyHeader(obj, want); err != nil || h.HasPayloadCRC {
		return h, false, err
	}
	p, ok := slotWord(obj)
	if !ok {
		return h, false, ErrUnaligned
	}
	h.PayloadCRC, h.HasPayloadCRC = Checksum(obj[HeaderSize:]), true
	atomic.StoreUint64(p, binary.NativeEndian.Uint64(slotBytes(h.PayloadCRC, true)))
	return h, true, nil
}

// ErrUnaligned: SetPayloadCRC on an object whose slot is not 8-byte aligned.
var ErrUnaligned = errors.New("objfmt: payload checksum slot is not 8-byte aligned")

func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, args...))
}
