package l2_test

import (
	"errors"
	"strings"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/server/l2"
)

func TestKeyStringRoundTrip(t *testing.T) {
	var k l2.Key
	for i := range k.Namespace {
		k.Namespace[i] = byte(i)
	}
	for i := range k.Hash {
		k.Hash[i] = byte(0xff - i)
	}
	k.Rank = 0x01020304
	s := k.String()
	assert.Equal(t, len(s), l2.KeyStringLen)
	assert.Equal(t, s[:33], "000102030405060708090a0b0c0d0e0f@")
	assert.Equal(t, s[33:42], "01020304@")
	got, err := l2.ParseKey(s)
	assert.NilError(t, err)
	assert.Equal(t, got, k)
	assert.Equal(t, string(k.AppendString([]byte("x"))), "x"+s)
}

func TestParseKeyRejects(t *testing.T) {
	good := l2.Key{Rank: 0xabcdef, Hash: [32]byte{0xfe}}.String()
	for _, tc := range []struct{ name, s string }{
		{"empty", ""},
		{"short", good[:len(good)-1]},
		{"uppercase", strings.ToUpper(good)},
		{"separator", strings.Replace(good, "@", "#", 1)},
		{"non-hex", "g" + good[1:]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := l2.ParseKey(tc.s)
			assert.Assert(t, errors.Is(err, l2.ErrBadKey), "%v", err)
		})
	}
}

func FuzzParseKey(f *testing.F) {
	f.Add(l2.Key{Rank: 1}.String())
	f.Add("")
	f.Add(strings.Repeat("a", l2.KeyStringLen))
	f.Fuzz(func(t *testing.T, s string) {
		k, err := l2.ParseKey(s)
		if err != nil {
			return
		}
		if k.String() != s {
			t.Fatalf("round trip %q -> %q", s, k.String())
		}
	})
}

func TestBitmapPrefix(t *testing.T) {
	for _, tc := range []struct {
		n      int
		set    []int
		prefix int
		count  int
	}{
		{0, nil, 0, 0},
		{4, []int{0, 1, 3}, 2, 3},
		{70, seq(70), 70, 70},
		{130, seq(65), 65, 65},
		{64, seq(64), 64, 64},
	} {
		b := l2.NewBitmap(tc.n)
		for _, i := range tc.set {
			b.Set(i)
		}
		assert.Equal(t, b.Prefix(), tc.prefix)
		assert.Equal(t, b.Count(), tc.count)
	}
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}
