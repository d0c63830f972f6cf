package shim

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// FuzzChunkHashes: arbitrary tokens, chunk sizes, extras and cut points never
// panic, errors are the sentinels, and valid inputs hash like the reference,
// keep the prefix property and extend like a full recompute.
//
//	go test ./shim -run '^$' -fuzz FuzzChunkHashes -fuzztime 30s
func FuzzChunkHashes(f *testing.F) {
	f.Add([]byte("0123456789abcdef0123456789abcdef"), int16(4), uint16(17), "", "", []byte("img"), int32(3), int32(9))
	f.Add(make([]byte, 4096), int16(256), uint16(700), "salt", "lora", []byte{}, int32(0), int32(0))
	f.Add([]byte{1, 2, 3}, int16(0), uint16(0), "", "", []byte("x"), int32(-1), int32(5))
	f.Add(make([]byte, 400), int16(1), uint16(99), "a", "", []byte("m"), int32(50), int32(1<<30))
	f.Fuzz(func(t *testing.T, data []byte, chunk int16, cut uint16, salt, lora string, mmHash []byte, mmOff, mmLen int32) {
		tokens := make([]uint32, len(data)/4)
		for i := range tokens {
			tokens[i] = binary.LittleEndian.Uint32(data[4*i:])
		}
		ex := Extras{CacheSalt: salt, LoRA: lora}
		if len(mmHash) > 0 || mmOff != 0 || mmLen != 0 {
			ex.MM = []MMInput{
				{Hash: mmHash, Offset: int(mmOff), Length: int(mmLen)},
				{Hash: []byte("second"), Offset: int(mmOff) / 2, Length: 3},
			}
		}
		cs := int(chunk)
		got, err := ChunkHashes(testNS, tokens, cs, ex)
		if err != nil {
			if !errors.Is(err, ErrBadChunkSize) && !errors.Is(err, ErrBadExtras) {
				t.Fatalf("unexpected error: %v", err)
			}
			return
		}
		if len(got) != NumFullChunks(len(tokens), cs) {
			t.Fatalf("%d hashes for %d tokens / %d", len(got), len(tokens), cs)
		}
		if d := cmp.Diff(refChunkHashes(testNS, tokens, cs, ex), got, cmpopts.EquateEmpty()); d != "" {
			t.Fatalf("differs from the reference (-want +got):\n%s", d)
		}
		n := min(int(cut), len(tokens))
		pre, err := ChunkHashes(testNS, tokens[:n], cs, ex)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(got[:len(pre)], pre, cmpopts.EquateEmpty()); d != "" || len(pre) != n/cs {
			t.Fatalf("prefix property broken at %d tokens:\n%s", n, d)
		}
		ext, err := ExtendChunkHashes(testNS, pre, tokens, cs, ex)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(got, ext, cmpopts.EquateEmpty()); d != "" {
			t.Fatalf("extend from %d chunks differs:\n%s", len(pre), d)
		}
	})
}
