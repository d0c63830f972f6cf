package s3

import (
	"bytes"
	"testing"

	"github.com/kvshim/kvshim/kv"
)

// FuzzCheckTrailer: only the exact trailer of a key is accepted, and it
// gives back the length and CRC it was made with.
func FuzzCheckTrailer(f *testing.F) {
	var k kv.Key
	k.Namespace[0], k.Rank, k.Hash[31] = 1, 2, 3
	f.Add(trailer(k, 0xdeadbeef, 4096))
	f.Add(make([]byte, trailerSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) < trailerSize {
			return
		}
		b = b[:trailerSize]
		n, crc, err := checkTrailer(k, b)
		if err != nil {
			return
		}
		if !bytes.Equal(trailer(k, crc, n), b) {
			t.Fatalf("accepted a trailer that is not k's: %x", b)
		}
	})
}
