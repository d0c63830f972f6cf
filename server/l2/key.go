package l2

import "github.com/kvshim/kvshim/kv"

// NamespaceSize, HashSize, KeyStringLen, Key and ParseKey are kv's
// (transitional names: references move to kv.*).
const (
	NamespaceSize = kv.NamespaceSize
	HashSize      = kv.HashSize
	KeyStringLen  = kv.KeyStringLen
)

type Key = kv.Key

// ParseKey is kv.ParseKey.
func ParseKey(s string) (Key, error) { return kv.ParseKey(s) }
