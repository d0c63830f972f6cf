package kv_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
)

func TestKeyStringRoundTrip(t *testing.T) {
	var k kv.Key
	for i := range k.Namespace {
		k.Namespace[i] = byte(i)
	}
	for i := range k.Hash {
		k.Hash[i] = byte(0xff - i)
	}
	k.Rank = 0x01020304
	s := k.String()
	assert.Equal(t, len(s), kv.KeyStringLen)
	assert.Equal(t, s[:33], "000102030405060708090a0b0c0d0e0f@")
	assert.Equal(t, s[33:42], "01020304@")
	got, err := kv.ParseKey(s)
	assert.NilError(t, err)
	assert.Equal(t, got, k)
	assert.Equal(t, string(k.AppendString([]byte("x"))), "x"+s)
}

func TestParseKeyRejects(t *testing.T) {
	good := kv.Key{Rank: 0xabcdef, Hash: [32]byte{0xfe}}.String()
	for _, tc := range []struct{ name, s string }{
		{"empty", ""},
		{"short", good[:len(good)-1]},
		{"uppercase", strings.ToUpper(good)},
		{"separator", strings.Replace(good, "@", "#", 1)},
		{"non-hex", "g" + good[1:]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := kv.ParseKey(tc.s)
			assert.Assert(t, errors.Is(err, kv.ErrBadKey), "%v", err)
		})
	}
}

func FuzzParseKey(f *testing.F) {
	f.Add(kv.Key{Rank: 1}.String())
	f.Add("")
	f.Add(strings.Repeat("a", kv.KeyStringLen))
	f.Fuzz(func(t *testing.T, s string) {
		k, err := kv.ParseKey(s)
		if err != nil {
			return
		}
		if k.String() != s {
			t.Fatalf("round trip %q -> %q", s, k.String())
		}
	})
}

// TestHashText: the hex text form round-trips and refuses a wrong length
// (the step metadata's JSON form and logs use it).
func TestHashText(t *testing.T) {
	h := kv.Hash{0xab, 31: 0x01}
	b, err := json.Marshal([]kv.Hash{h})
	assert.NilError(t, err)
	assert.Equal(t, string(b), `["ab`+strings.Repeat("00", 30)+`01"]`)
	var back []kv.Hash
	assert.NilError(t, json.Unmarshal(b, &back))
	assert.DeepEqual(t, back, []kv.Hash{h})
	var tag kv.Tag
	assert.ErrorContains(t, tag.UnmarshalText([]byte("abc")), "tag: want 32 hex digits, got 3")
}

func TestDirectionString(t *testing.T) {
	assert.Equal(t, kv.Save.String(), "save")
	assert.Equal(t, kv.Load.String(), "load")
	assert.Equal(t, kv.Direction(9).String(), "direction(?)")
}
