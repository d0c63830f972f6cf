package kv

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
)

// NamespaceSize and HashSize are the fixed sizes of a Key's parts.
const (
	NamespaceSize = 16
	HashSize      = 32
	TagSize       = 16
)

// KeyStringLen is the length of Key.String(): 32 hex + '@' + 8 hex + '@' + 64 hex.
const KeyStringLen = 2*NamespaceSize + 1 + 8 + 1 + 2*HashSize

// Hash is a chained chunk hash (SHA-256 over the namespace, the parent
// hash and the chunk's tokens; see shim's keys).
type Hash [HashSize]byte

// Namespace is a 128-bit fingerprint of everything that makes KV bytes
// incompatible (model, dtype, layout, format version, world size, chunk
// size, group).
type Namespace [NamespaceSize]byte

// Tag names a writer (one uuid per worker connector).
type Tag [TagSize]byte

// Key names one stored object: namespace, KV rank, chained chunk hash.
type Key struct {
	Namespace Namespace
	Rank      uint32
	Hash      Hash
}

// ErrBadKey marks a string that is not a Key's String form.
var ErrBadKey = errors.New("bad key")

// MarshalText is the hex form (step metadata's JSON, logs).
func (h Hash) MarshalText() ([]byte, error) { return hexText(h[:]), nil }

// UnmarshalText reads the hex form: exactly 2*HashSize digits.
func (h *Hash) UnmarshalText(b []byte) error { return unhex(h[:], b, "hash") }

// MarshalText is the hex form.
func (t Tag) MarshalText() ([]byte, error) { return hexText(t[:]), nil }

// UnmarshalText reads the hex form: exactly 2*TagSize digits.
func (t *Tag) UnmarshalText(b []byte) error { return unhex(t[:], b, "tag") }

func hexText(b []byte) []byte { return []byte(hex.EncodeToString(b)) }

func unhex(dst, src []byte, what string) error {
	if hex.DecodedLen(len(src)) != len(dst) {
		return fmt.Errorf("%s: want %d hex digits, got %d", what, 2*len(dst), len(src))
	}
	_, err := hex.Decode(dst, src)
	return err
}

// String is the stable backend encoding "<ns hex>@<rank %08x>@<hash hex>",
// lowercase, KeyStringLen bytes. It never changes: it names files and
// remote objects.
func (k Key) String() string {
	var b [KeyStringLen]byte
	return string(k.AppendString(b[:0]))
}

// AppendString appends String() to dst without an intermediate allocation.
func (k Key) AppendString(dst []byte) []byte {
	dst = hex.AppendEncode(dst, k.Namespace[:])
	dst = append(dst, '@')
	var r [4]byte
	binary.BigEndian.PutUint32(r[:], k.Rank)
	dst = hex.AppendEncode(dst, r[:])
	dst = append(dst, '@')
	return hex.AppendEncode(dst, k.Hash[:])
}

// Short is a short form for logs: namespace and hash prefixes, rank.
func (k Key) Short() string {
	return fmt.Sprintf("%s@%d@%s", hex.EncodeToString(k.Namespace[:4]), k.Rank, hex.EncodeToString(k.Hash[:8]))
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
