package l2

import "math/bits"

// Status is the outcome of one key of a batch.
type Status uint8

const (
	// StatusFailed: the operation failed for this key (Result.Err says why).
	// It is the zero value so that an unset result never reads as success.
	StatusFailed Status = iota
	// StatusOK: written (or already present: objects are immutable), present
	// (and held), loaded into the caller's buffer, or deleted.
	StatusOK
	// StatusMiss: the object is absent (or was corrupt and has been discarded).
	StatusMiss
)

func (s Status) String() string {
	switch s {
	case StatusOK:
		return "ok"
	case StatusMiss:
		return "miss"
	default:
		return "failed"
	}
}

// Result is one key's outcome. Bytes is the payload size moved (store, load)
// or found (lookup, where the backend knows it).
type Result struct {
	Status Status
	Bytes  int
	Err    error
}

// OK reports whether Status is StatusOK.
func (r Result) OK() bool { return r.Status == StatusOK }

// Bitmap is a fixed-length per-key bitmap (bit i = key i succeeded).
type Bitmap struct {
	n     int
	words []uint64
}

// NewBitmap returns an all-zero bitmap of n bits.
func NewBitmap(n int) Bitmap { return Bitmap{n: n, words: make([]uint64, (n+63)/64)} }

// Len is the number of bits.
func (b Bitmap) Len() int { return b.n }

// Set sets bit i.
func (b Bitmap) Set(i int) { b.words[i/64] |= 1 << (uint(i) % 64) }

// Test reports bit i.
func (b Bitmap) Test(i int) bool { return b.words[i/64]&(1<<(uint(i)%64)) != 0 }

// Count is the number of set bits.
func (b Bitmap) Count() int {
	c := 0
	for _, w := range b.words {
		c += bits.OnesCount64(w)
	}
	return c
}

// Prefix is the number of leading set bits: the contiguous prefix usable
// without recomputation.
func (b Bitmap) Prefix() int {
	for wi, w := range b.words {
		if w != ^uint64(0) {
			p := wi*64 + bits.TrailingZeros64(^w)
			return min(p, b.n)
		}
	}
	return b.n
}

// BitmapOf returns the StatusOK bits of results.
func BitmapOf(results []Result) Bitmap {
	b := NewBitmap(len(results))
	for i, r := range results {
		if r.Status == StatusOK {
			b.Set(i)
		}
	}
	return b
}
