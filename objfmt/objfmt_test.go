package objfmt

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"
)

func testKey() Key {
	k := Key{Rank: 3}
	for i := range k.Namespace {
		k.Namespace[i] = byte(0xA0 + i)
	}
	for i := range k.Hash {
		k.Hash[i] = byte(i * 7)
	}
	return k
}

// sealed returns a valid object of payload bytes under key.
func sealed(t testing.TB, payload int, key Key) []byte {
	t.Helper()
	obj := make([]byte, HeaderSize+payload)
	for i := range obj[HeaderSize:] {
		obj[HeaderSize+i] = byte(i*13 + 5)
	}
	h := Header{ChunkTokens: 16, Key: key}
	h.Fingerprint[0], h.Fingerprint[31] = 0xF0, 0x0F
	if err := Seal(obj, h); err != nil {
		t.Fatal(err)
	}
	return obj
}

func TestLayoutIsPinned(t *testing.T) {
	if HeaderSize%64 != 0 {
		t.Fatalf("header size %d is not a multiple of 64", HeaderSize)
	}
	key := testKey()
	obj := sealed(t, 256, key)
	le := binary.LittleEndian
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"magic", string(obj[0:4]), "KVSO"},
		{"version", le.Uint16(obj[4:]), uint16(2)},
		{"header size", le.Uint16(obj[6:]), uint16(128)},
		{"payload size", le.Uint64(obj[8:]), uint64(256)},
		{"chunk tokens", le.Uint32(obj[16:]), uint32(16)},
		{"payload crc", le.Uint32(obj[20:]), Checksum(obj[128:])},
		{"fingerprint", [2]byte{obj[24], obj[55]}, [2]byte{0xF0, 0x0F}},
		{"namespace", string(obj[56:72]), string(key.Namespace[:])},
		{"rank", le.Uint32(obj[72:]), uint32(3)},
		{"hash", string(obj[76:108]), string(key.Hash[:])},
		{"reserved", string(obj[108:124]), string(make([]byte, 16))},
		{"header crc", le.Uint32(obj[124:]), Checksum(obj[:124])},
	} {
		if c.got != c.want {
			t.Errorf("%s: %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestVerify(t *testing.T) {
	key := testKey()
	obj := sealed(t, 300, key)
	h, err := Verify(obj, key)
	if err != nil {
		t.Fatal(err)
	}
	if h.Key != key || h.PayloadSize != 300 || h.ChunkTokens != 16 {
		t.Fatalf("decoded %+v", h)
	}
	otherNS, otherRank, otherHash := key, key, key
	otherNS.Namespace[15] ^= 1
	otherRank.Rank = 4
	otherHash.Hash[31] ^= 0x80
	for name, want := range map[string]Key{"namespace": otherNS, "rank": otherRank, "hash": otherHash} {
		_, err := Verify(obj, want)
		if !errors.Is(err, ErrKeyMismatch) || !errors.Is(err, ErrCorrupt) {
			t.Errorf("other %s: %v, want a key mismatch that is corruption", name, err)
		}
	}
	// Corruption that is not a key mismatch.
	resign := func(b []byte, edit func([]byte)) []byte {
		edit(b)
		binary.LittleEndian.PutUint32(b[124:], Checksum(b[:124]))
		return b
	}
	v1 := make([]byte, 64+300) // a version 1 object: 64-byte header, CRC at 60
	copy(v1, "KVSO")
	binary.LittleEndian.PutUint16(v1[4:], 1)
	binary.LittleEndian.PutUint16(v1[6:], 64)
	binary.LittleEndian.PutUint32(v1[60:], Checksum(v1[:60]))
	for name, b := range map[string][]byte{
		"payload bit":  func(b []byte) []byte { b[HeaderSize+17] ^= 1; return b }(clone(obj)),
		"header bit":   func(b []byte) []byte { b[9] ^= 1; return b }(clone(obj)),
		"key bit":      func(b []byte) []byte { b[80] ^= 1; return b }(clone(obj)),
		"crc bit":      func(b []byte) []byte { b[125] ^= 1; return b }(clone(obj)),
		"magic":        func(b []byte) []byte { b[0] = 'X'; return b }(clone(obj)),
		"short":        clone(obj)[:HeaderSize-1],
		"tiny":         clone(obj)[:3],
		"truncated":    clone(obj)[:len(obj)-1],
		"extended":     append(clone(obj), 0),
		"version 1":    v1,
		"version 3":    resign(clone(obj), func(b []byte) { b[4] = 3 }),
		"header size":  resign(clone(obj), func(b []byte) { b[6] = 64 }),
		"reserved":     resign(clone(obj), func(b []byte) { b[110] = 1 }),
		"payload size": resign(clone(obj), func(b []byte) { b[8]++ }),
	} {
		_, err := Verify(b, key)
		if !errors.Is(err, ErrCorrupt) || errors.Is(err, ErrKeyMismatch) {
			t.Errorf("%s: %v, want corruption that is not a key mismatch", name, err)
		}
	}
	if _, err := Verify(v1, key); err == nil || !bytes.Contains([]byte(err.Error()), []byte("format version 1, want 2")) {
		t.Errorf("version 1: %v", err)
	}
	if err := Seal(make([]byte, HeaderSize-1), Header{}); err == nil {
		t.Error("Seal of a buffer shorter than the header succeeded")
	}
}

// Every single-bit flip in the header is caught by Decode (header CRC) or
// by the key check; none goes unnoticed.
func TestEveryHeaderBitFlipIsCaught(t *testing.T) {
	key := testKey()
	obj := sealed(t, 64, key)
	for i := range HeaderSize * 8 {
		b := clone(obj)
		b[i/8] ^= 1 << (i % 8)
		if _, err := Verify(b, key); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("bit %d flipped: %v", i, err)
		}
	}
}

func clone(b []byte) []byte { return append([]byte(nil), b...) }

// FuzzDecode: the decoder never panics, accepts only canonical headers
// (re-encoding gives the same bytes), and Verify agrees with Decode plus
// the key, size and payload checks.
func FuzzDecode(f *testing.F) {
	key := testKey()
	obj := sealed(f, 64, key)
	f.Add(obj)
	f.Add(obj[:HeaderSize])
	f.Add(obj[:40])
	f.Add([]byte("KVSO\x01\x00\x40\x00"))
	f.Add(sealed(f, 0, Key{}))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := Decode(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			if _, verr := Verify(b, key); verr == nil {
				t.Fatal("Verify accepts what Decode refuses")
			}
			return
		}
		var re [HeaderSize]byte
		h.Encode(re[:])
		if !bytes.Equal(re[:], b[:HeaderSize]) {
			t.Fatalf("accepted a non-canonical header:\n%x\nre-encodes as\n%x", b[:HeaderSize], re)
		}
		_, verr := Verify(b, h.Key)
		wantOK := h.PayloadSize == uint64(len(b)-HeaderSize) && Checksum(b[HeaderSize:]) == h.PayloadCRC
		if (verr == nil) != wantOK {
			t.Fatalf("Verify under its own key: %v, want ok=%v", verr, wantOK)
		}
		if h.Key != key {
			if _, err := Verify(b, key); !errors.Is(err, ErrKeyMismatch) {
				t.Fatalf("a header naming %v verified under %v: %v", h.Key, key, err)
			}
		}
	})
}
