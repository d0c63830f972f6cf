package objfmt

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"

	"github.com/kvshim/kvshim/kv"
)

func testKey() kv.Key {
	k := kv.Key{Rank: 3}
	for i := range k.Namespace {
		k.Namespace[i] = byte(0xA0 + i)
	}
	for i := range k.Hash {
		k.Hash[i] = byte(i * 7)
	}
	return k
}

// sealed returns a valid object of payload bytes under key.
func sealed(t testing.TB, payload int, key kv.Key) []byte {
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
		{"version", le.Uint16(obj[4:]), uint16(3)},
		{"header size", le.Uint16(obj[6:]), uint16(128)},
		{"payload size", le.Uint64(obj[8:]), uint64(256)},
		{"chunk tokens", le.Uint32(obj[16:]), uint32(16)},
		{"reserved 1", le.Uint32(obj[20:]), uint32(0)},
		{"fingerprint", [2]byte{obj[24], obj[55]}, [2]byte{0xF0, 0x0F}},
		{"namespace", string(obj[56:72]), string(key.Namespace[:])},
		{"rank", le.Uint32(obj[72:]), uint32(3)},
		{"hash", string(obj[76:108]), string(key.Hash[:])},
		{"reserved 2", string(obj[108:116]), string(make([]byte, 8))},
		{"header crc", le.Uint32(obj[116:]), Checksum(obj[:116])},
		{"payload crc", le.Uint32(obj[120:]), Checksum(obj[128:])},
		{"payload crc state", string(obj[124:128]), "CRC1"},
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
	for name, want := range map[string]kv.Key{"namespace": otherNS, "rank": otherRank, "hash": otherHash} {
		_, err := Verify(obj, want)
		if !errors.Is(err, ErrKeyMismatch) || !errors.Is(err, ErrCorrupt) {
			t.Errorf("other %s: %v, want a key mismatch that is corruption", name, err)
		}
	}
	// Corruption that is not a key mismatch.
	v1 := make([]byte, 64+300) // a version 1 object: 64-byte header, CRC at 60
	copy(v1, "KVSO")
	binary.LittleEndian.PutUint16(v1[4:], 1)
	binary.LittleEndian.PutUint16(v1[6:], 64)
	binary.LittleEndian.PutUint32(v1[60:], Checksum(v1[:60]))
	v2 := clone(obj) // a version 2 object: payload CRC at 20, header CRC at 124 over 0..123
	binary.LittleEndian.PutUint16(v2[4:], 2)
	binary.LittleEndian.PutUint32(v2[20:], Checksum(v2[HeaderSize:]))
	clear(v2[108:124])
	binary.LittleEndian.PutUint32(v2[124:], Checksum(v2[:124]))
	for name, b := range map[string][]byte{
		"payload bit":  func(b []byte) []byte { b[HeaderSize+17] ^= 1; return b }(clone(obj)),
		"header bit":   func(b []byte) []byte { b[9] ^= 1; return b }(clone(obj)),
		"key bit":      func(b []byte) []byte { b[80] ^= 1; return b }(clone(obj)),
		"crc bit":      func(b []byte) []byte { b[117] ^= 1; return b }(clone(obj)),
		"slot crc bit": func(b []byte) []byte { b[121] ^= 1; return b }(clone(obj)),
		"slot state":   func(b []byte) []byte { b[126] ^= 1; return b }(clone(obj)),
		"slot empty":   func(b []byte) []byte { clear(b[120:128]); return b }(clone(obj)),
		"magic":        func(b []byte) []byte { b[0] = 'X'; return b }(clone(obj)),
		"short":        clone(obj)[:HeaderSize-1],
		"tiny":         clone(obj)[:3],
		"truncated":    clone(obj)[:len(obj)-1],
		"extended":     append(clone(obj), 0),
		"version 1":    v1,
		"version 2":    v2,
		"version 4":    resign(clone(obj), func(b []byte) { b[4] = 4 }),
		"header size":  resign(clone(obj), func(b []byte) { b[6] = 64 }),
		"reserved 1":   resign(clone(obj), func(b []byte) { b[21] = 1 }),
		"reserved 2":   resign(clone(obj), func(b []byte) { b[110] = 1 }),
		"payload size": resign(clone(obj), func(b []byte) { b[8]++ }),
	} {
		_, err := Verify(b, key)
		if !errors.Is(err, ErrCorrupt) || errors.Is(err, ErrKeyMismatch) {
			t.Errorf("%s: %v, want corruption that is not a key mismatch", name, err)
		}
	}
	for v, b := range map[int][]byte{1: v1, 2: v2} {
		if _, err := Verify(b, key); err == nil || !bytes.Contains([]byte(err.Error()), fmt.Appendf(nil, "format version %d, want 3", v)) {
			t.Errorf("version %d: %v", v, err)
		}
	}
	if err := Seal(make([]byte, HeaderSize-1), Header{}); err == nil {
		t.Error("Seal of a buffer shorter than the header succeeded")
	}
}

// Every single-bit flip in the header is caught by Verify (header CRC, key
// check, slot form or payload CRC); none goes unnoticed. The header check
// alone (VerifyHeader, what an L1 restore runs) catches every flip but
// those in a set payload CRC, which only the payload check can see; with
// the slot empty it catches every flip.
func TestEveryHeaderBitFlipIsCaught(t *testing.T) {
	key := testKey()
	obj := sealed(t, 64, key)
	bare := clone(obj)
	if err := SealHeader(bare, Header{ChunkTokens: 16, Key: key}); err != nil {
		t.Fatal(err)
	}
	for i := range HeaderSize * 8 {
		b := clone(obj)
		b[i/8] ^= 1 << (i % 8)
		if _, err := Verify(b, key); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("bit %d flipped: %v", i, err)
		}
		_, err := VerifyHeader(b, key)
		if inCRC := i/8 >= 120 && i/8 < 124; inCRC != (err == nil) {
			t.Fatalf("bit %d flipped: header check %v", i, err)
		}
		b = clone(bare)
		b[i/8] ^= 1 << (i % 8)
		if _, err := VerifyHeader(b, key); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("bit %d flipped, slot empty: %v", i, err)
		}
	}
}

// SealHeader leaves the payload CRC slot empty and reads no payload byte;
// SetPayloadCRC fills it once (a second call trusts it), after which the
// object verifies exactly as if Seal had sealed it. An empty slot fails
// every payload check with ErrNoPayloadCRC.
func TestSealHeaderThenSetPayloadCRC(t *testing.T) {
	key := testKey()
	want := sealed(t, 4096, key)
	obj := clone(want)
	if err := SealHeader(obj, Header{ChunkTokens: 16, Fingerprint: [32]byte{0: 0xF0, 31: 0x0F}, Key: key}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(obj[:120], want[:120]) || !bytes.Equal(obj[120:128], make([]byte, 8)) {
		t.Fatalf("SealHeader wrote\n%x\nwant\n%x with an empty slot", obj[:HeaderSize], want[:HeaderSize])
	}
	h, err := VerifyHeader(obj, key)
	if err != nil || h.HasPayloadCRC {
		t.Fatalf("header-only object: %+v, %v", h, err)
	}
	if _, err := Verify(obj, key); !errors.Is(err, ErrNoPayloadCRC) || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Verify without a payload CRC: %v", err)
	}
	// The header check does not need the payload: a header alone of a
	// 4096-byte object fails on size only.
	if _, err := VerifyHeader(obj[:HeaderSize], key); err == nil {
		t.Fatal("VerifyHeader accepted a truncated object")
	}
	if _, _, err := SetPayloadCRC(obj, kv.Key{}); !errors.Is(err, ErrKeyMismatch) {
		t.Fatalf("SetPayloadCRC under another key: %v", err)
	}
	h, set, err := SetPayloadCRC(obj, key)
	if err != nil || !set || !h.HasPayloadCRC || h.PayloadCRC != Checksum(obj[HeaderSize:]) {
		t.Fatalf("SetPayloadCRC: %+v %v %v", h, set, err)
	}
	if !bytes.Equal(obj, want) {
		t.Fatalf("after SetPayloadCRC\n%x\nwant\n%x", obj[:HeaderSize], want[:HeaderSize])
	}
	if _, err := Verify(obj, key); err != nil {
		t.Fatal(err)
	}
	// A set slot is kept, even a wrong one: the payload check catches it.
	obj[HeaderSize+9] ^= 1
	if _, set, err := SetPayloadCRC(obj, key); set || err != nil {
		t.Fatalf("SetPayloadCRC over a set slot: set=%v %v", set, err)
	}
	if _, err := Verify(obj, key); !errors.Is(err, ErrCorrupt) || errors.Is(err, ErrNoPayloadCRC) {
		t.Fatalf("changed payload: %v", err)
	}
	if err := SealHeader(make([]byte, HeaderSize-1), Header{}); err == nil {
		t.Fatal("SealHeader of a buffer shorter than the header succeeded")
	}
	if _, _, err := SetPayloadCRC(clone(obj)[:HeaderSize-1], key); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("SetPayloadCRC of a short buffer: %v", err)
	}
}

// Readers decode an object while SetPayloadCRC sets its slot: each sees the
// slot empty or set to the right CRC, never torn (run with -race).
func TestSetPayloadCRCIsAtomicForReaders(t *testing.T) {
	key := testKey()
	want := sealed(t, 1<<16, key)
	for range 50 {
		obj := clone(want)
		if err := SealHeader(obj, Header{ChunkTokens: 16, Fingerprint: [32]byte{0: 0xF0, 31: 0x0F}, Key: key}); err != nil {
			t.Fatal(err)
		}
		done := make(chan error)
		go func() {
			_, _, err := SetPayloadCRC(obj, key)
			done <- err
		}()
		for stop := false; !stop; {
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
				stop = true
			default:
			}
			h, err := Decode(obj)
			if err != nil {
				t.Fatalf("torn read: %v", err)
			}
			if h.HasPayloadCRC && h.PayloadCRC != Checksum(want[HeaderSize:]) {
				t.Fatalf("read CRC %#x", h.PayloadCRC)
			}
		}
		if h, err := Decode(obj); err != nil || !h.HasPayloadCRC {
			t.Fatalf("after: %+v %v", h, err)
		}
	}
}

func TestParseVerifyPolicy(t *testing.T) {
	for s, want := range map[string]VerifyPolicy{"": VerifyL2, "l2": VerifyL2, "always": VerifyAlways, "off": VerifyOff} {
		p, err := ParseVerifyPolicy(s)
		if err != nil || p != want {
			t.Errorf("%q: %v %v", s, p, err)
		}
		if s != "" && p.String() != s {
			t.Errorf("%q: String %q", s, p)
		}
	}
	for _, s := range []string{"L2", "on", "none", "always "} {
		_, err := ParseVerifyPolicy(s)
		if err == nil {
			t.Errorf("%q accepted", s)
			continue
		}
		for _, name := range []string{`"l2"`, `"always"`, `"off"`} {
			if !bytes.Contains([]byte(err.Error()), []byte(name)) {
				t.Errorf("%q: %v does not name %s", s, err, name)
			}
		}
	}
}

func clone(b []byte) []byte { return append([]byte(nil), b...) }

// resign edits header bytes and recomputes the header CRC, so only the
// semantic checks can catch the change.
func resign(b []byte, edit func([]byte)) []byte {
	edit(b)
	binary.LittleEndian.PutUint32(b[116:], Checksum(b[:116]))
	return b
}

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
	f.Add(sealed(f, 0, kv.Key{}))
	bare := clone(obj)
	if err := SealHeader(bare, Header{Key: key}); err != nil {
		f.Fatal(err)
	}
	f.Add(bare)
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
		sizeOK := h.PayloadSize == uint64(len(b)-HeaderSize)
		if _, herr := VerifyHeader(b, h.Key); (herr == nil) != sizeOK {
			t.Fatalf("VerifyHeader under its own key: %v, want ok=%v", herr, sizeOK)
		}
		wantOK := sizeOK && h.HasPayloadCRC && Checksum(b[HeaderSize:]) == h.PayloadCRC
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
