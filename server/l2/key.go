package l2

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// NamespaceSize and HashSize are the fixed sizes of a Key's parts.
const (
	NamespaceSize = 16
	HashSize      = 32
)

// KeyStringLen is the length of Key.String(): 32 hex + '@' + 8 hex + '@' + 64 hex.
const KeyStringLen = 2*NamespaceSize + 1 + 8 + 1 + 2*HashSize

// Key names one L2 object: a namespace fingerprint (model, dtype, layout,
// format version, world size, chunk size, group), the KV rank and the chained
// chunk hash.
type Key struct {
	Namespace [NamespaceSize]byte
	Rank      uint32
	Hash      [HashSize]byte
}

// String is the stable backend encoding "<ns hex>@<rank %08x>@<hash hex>",
// lowercase, KeyStringLen bytes. It never changes: it names files and
// remote objects.
func (k Key) String() string {
	var b [KeyStringLen]byte
	k.appendTo(b[:0])
	return string(b[:])
}

// AppendString appends String() to dst without an intermediate allocation.
func (k Key) AppendString(dst []byte) []byte { return k.appendTo(dst) }

func (k Key) appendTo(dst []byte) []byte {
	dst = hex.AppendEncode(dst, k.Namespace[:])
	dst = append(dst, '@')
	var r [4]byte
	binary.BigEndian.PutUint32(r[:], k.Rank)
	dst = hex.AppendEncode(dst, r[:])
	dst = append(dst, '@')
	return hex.AppendEncode(dst, k.Hash[:])
}

// ParseKey is the inverse of Key.String; it accepts lowercase hex only, so
// every Key has exactly one encoding.
func ParseKey(s string) (Key, error) {
	var k Key
	if len(s) != KeyStringLen {
		return k, fmt.Errorf("%w: length %d, want %d", ErrBadKey, len(s), KeyStringLen)
	}
	const rankOff = 2*NamespaceSize + 1
	const hashOff = rankOff + 8 + 1
	if s[rankOff-1] != '@' || s[hashOff-1] != '@' {
		return k, fmt.Errorf("%w: separators", ErrBadKey)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '@' && !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return k, fmt.Errorf("%w: byte %d %q is not lowercase hex", ErrBadKey, i, c)
		}
	}
	var r [4]byte
	if _, err := hex.Decode(k.Namespace[:], []byte(s[:rankOff-1])); err != nil {
		return k, fmt.Errorf("%w: namespace: %v", ErrBadKey, err)
	}
	if _, err := hex.Decode(r[:], []byte(s[rankOff:hashOff-1])); err != nil {
		return k, fmt.Errorf("%w: rank: %v", ErrBadKey, err)
	}
	if _, err := hex.Decode(k.Hash[:], []byte(s[hashOff:])); err != nil {
		return k, fmt.Errorf("%w: hash: %v", ErrBadKey, err)
	}
	k.Rank = binary.BigEndian.Uint32(r[:])
	return k, nil
}
