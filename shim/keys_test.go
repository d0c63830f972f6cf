package shim

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// refChunkHashes is a deliberately naive second implementation of the key
// encoding (root v2, chunk v1; see keys_hash.go) with fresh buffers and a full
// mm scan per chunk, that the fast path is checked against.
func refChunkHashes(ns kv.Namespace, tokens []uint32, chunkSize int, ex Extras) []kv.Hash {
	lp := func(b *bytes.Buffer, s []byte) {
		binary.Write(b, binary.LittleEndian, uint32(len(s)))
		b.Write(s)
	}
	var root bytes.Buffer
	root.WriteString("kvshim.root.v2")
	root.Write(ns[:])
	lp(&root, []byte(ex.CacheSalt))
	if ex.LoRA == nil {
		root.WriteByte(0)
	} else {
		root.WriteByte(1)
		lp(&root, []byte(ex.LoRA.Name))
		lp(&root, []byte(ex.LoRA.Path))
	}
	prev := kv.Hash(sha256.Sum256(root.Bytes()))

	mm := slices.Clone(ex.MM)
	slices.SortFunc(mm, compareMM)
	var out []kv.Hash
	for i := 0; (i+1)*chunkSize <= len(tokens); i++ {
		start, end := i*chunkSize, (i+1)*chunkSize
		var b bytes.Buffer
		b.WriteString("kvshim.chunk.v1")
		b.Write(prev[:])
		binary.Write(&b, binary.LittleEndian, uint32(chunkSize))
		binary.Write(&b, binary.LittleEndian, tokens[start:end])
		var sel []MMInput
		for _, m := range mm {
			if m.Offset < end && m.Offset+m.Length > start {
				sel = append(sel, m)
			}
		}
		binary.Write(&b, binary.LittleEndian, uint32(len(sel)))
		for _, m := range sel {
			lp(&b, m.Hash)
			binary.Write(&b, binary.LittleEndian, uint64(m.Offset))
			binary.Write(&b, binary.LittleEndian, uint64(m.Length))
		}
		prev = sha256.Sum256(b.Bytes())
		out = append(out, prev)
	}
	return out
}

// testTokens is a deterministic token sequence (Knuth multiplicative hash).
func testTokens(n int, seed uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(i)*2654435761 + seed
	}
	return t
}

var testNS = kv.Namespace{0: 0x6b, 1: 0x76, 15: 0x01}

func mustHashes(t testing.TB, tokens []uint32, chunkSize int, ex Extras) []kv.Hash {
	t.Helper()
	h, err := ChunkHashes(testNS, tokens, chunkSize, ex)
	assert.NilError(t, err)
	return h
}

func TestChunkHashesMatchReference(t *testing.T) {
	img := func(s string, off, n int) MMInput { return MMInput{Hash: []byte(s), Offset: off, Length: n} }
	tests := []struct {
		name      string
		n, chunk  int
		ex        Extras
		wantCount int
	}{
		{name: "empty", n: 0, chunk: 256, wantCount: 0},
		{name: "tail only", n: 255, chunk: 256, wantCount: 0},
		{name: "one chunk", n: 256, chunk: 256, wantCount: 1},
		{name: "tail dropped", n: 1000, chunk: 256, wantCount: 3},
		{name: "chunk 1", n: 7, chunk: 1, wantCount: 7},
		{name: "salt and lora", n: 768, chunk: 256, ex: Extras{CacheSalt: "s", LoRA: &LoRA{Name: "l", Path: "/p"}}, wantCount: 3},
		{name: "empty lora", n: 768, chunk: 256, ex: Extras{LoRA: &LoRA{}}, wantCount: 3},
		{name: "mm unsorted, nested, spanning", n: 2048, chunk: 128, wantCount: 16, ex: Extras{MM: []MMInput{
			img("b", 900, 600), img("a", 100, 50), img("c", 950, 10), img("d", 127, 2), img("e", 5000, 9),
		}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tokens := testTokens(tc.n, 7)
			want := refChunkHashes(testNS, tokens, tc.chunk, tc.ex)
			got := mustHashes(t, tokens, tc.chunk, tc.ex)
			assert.Check(t, is.Len(got, tc.wantCount))
			assert.DeepEqual(t, got, want, cmpopts.EquateEmpty())

			// The portable (big-endian host) path encodes the same bytes.
			nativeLE = false
			defer func() { nativeLE = true }()
			assert.DeepEqual(t, mustHashes(t, tokens, tc.chunk, tc.ex), want, cmpopts.EquateEmpty())
		})
	}
}

func TestChunkHashesSeparation(t *testing.T) {
	tokens := testTokens(5*256+17, 1)
	base := mustHashes(t, tokens, 256, Extras{})
	assert.Assert(t, is.Len(base, 5))

	allDiffer := func(t *testing.T, got []kv.Hash) {
		t.Helper()
		assert.Assert(t, is.Len(got, len(base)))
		for i := range got {
			assert.Check(t, got[i] != base[i], "chunk %d aliases the base", i)
		}
	}
	t.Run("salt", func(t *testing.T) {
		a := mustHashes(t, tokens, 256, Extras{CacheSalt: "tenant-a"})
		b := mustHashes(t, tokens, 256, Extras{CacheSalt: "tenant-b"})
		allDiffer(t, a)
		allDiffer(t, b)
		assert.Check(t, a[0] != b[0])
	})
	t.Run("lora", func(t *testing.T) {
		allDiffer(t, mustHashes(t, tokens, 256, Extras{LoRA: &LoRA{Name: "sql", Path: "/a/sql"}}))
		// A LoRA with an empty name and path is still a LoRA.
		allDiffer(t, mustHashes(t, tokens, 256, Extras{LoRA: &LoRA{}}))
	})
	t.Run("lora name and path do not shift", func(t *testing.T) {
		// keyed as "name:path", these two shared KV.
		a := mustHashes(t, tokens, 256, Extras{LoRA: &LoRA{Name: "a:b", Path: "c"}})
		b := mustHashes(t, tokens, 256, Extras{LoRA: &LoRA{Name: "a", Path: "b:c"}})
		c := mustHashes(t, tokens, 256, Extras{LoRA: &LoRA{Name: "a:b", Path: "c"}})
		assert.Check(t, a[0] != b[0])
		assert.DeepEqual(t, a, c)
	})
	t.Run("salt and lora do not swap", func(t *testing.T) {
		a := mustHashes(t, tokens, 256, Extras{CacheSalt: "x"})
		b := mustHashes(t, tokens, 256, Extras{LoRA: &LoRA{Name: "x"}})
		c := mustHashes(t, tokens, 256, Extras{CacheSalt: "x", LoRA: &LoRA{Name: "x"}})
		d := mustHashes(t, tokens, 256, Extras{LoRA: &LoRA{Path: "x"}})
		assert.Check(t, a[0] != b[0] && a[0] != c[0] && b[0] != c[0] && d[0] != a[0] && d[0] != b[0])
	})
	t.Run("namespace", func(t *testing.T) {
		other := testNS
		other[3] ^= 1
		got, err := ChunkHashes(other, tokens, 256, Extras{})
		assert.NilError(t, err)
		allDiffer(t, got)
	})
	t.Run("image only in chunk 2", func(t *testing.T) {
		for _, m := range []MMInput{
			{Hash: []byte("img"), Offset: 512, Length: 256},  // exactly chunk 2
			{Hash: []byte("img"), Offset: 700, Length: 68},   // tail of chunk 2
			{Hash: []byte("img"), Offset: 767, Length: 1000}, // last token of chunk 2 on
		} {
			got := mustHashes(t, tokens, 256, Extras{MM: []MMInput{m}})
			assert.DeepEqual(t, got[:2], base[:2])
			for i := 2; i < len(got); i++ {
				assert.Check(t, got[i] != base[i], "chunk %d, %+v", i, m)
			}
		}
	})
	t.Run("same placeholders, different images", func(t *testing.T) {
		a := mustHashes(t, tokens, 256, Extras{MM: []MMInput{{Hash: []byte("cat"), Offset: 300, Length: 100}}})
		b := mustHashes(t, tokens, 256, Extras{MM: []MMInput{{Hash: []byte("dog"), Offset: 300, Length: 100}}})
		assert.DeepEqual(t, a[:1], b[:1])
		assert.Check(t, a[1] != b[1])
	})
	t.Run("same image, different position", func(t *testing.T) {
		a := mustHashes(t, tokens, 256, Extras{MM: []MMInput{{Hash: []byte("cat"), Offset: 300, Length: 100}}})
		b := mustHashes(t, tokens, 256, Extras{MM: []MMInput{{Hash: []byte("cat"), Offset: 301, Length: 100}}})
		assert.Check(t, a[1] != b[1])
	})
	t.Run("mm order does not matter", func(t *testing.T) {
		x := MMInput{Hash: []byte("x"), Offset: 10, Length: 500}
		y := MMInput{Hash: []byte("y"), Offset: 20, Length: 30}
		unsorted := []MMInput{y, x}
		assert.DeepEqual(t,
			mustHashes(t, tokens, 256, Extras{MM: []MMInput{x, y}}),
			mustHashes(t, tokens, 256, Extras{MM: unsorted}))
		assert.DeepEqual(t, unsorted, []MMInput{y, x}) // the caller's slice is not reordered
	})
	t.Run("mm beyond the full chunks", func(t *testing.T) {
		got := mustHashes(t, tokens, 256, Extras{MM: []MMInput{{Hash: []byte("z"), Offset: 5 * 256, Length: 10}}})
		assert.DeepEqual(t, got, base)
	})
	t.Run("token boundary is not ambiguous", func(t *testing.T) {
		// Moving tokens between chunk boundaries must change the hashes.
		a := mustHashes(t, tokens[:512], 128, Extras{})
		b := mustHashes(t, tokens[:512], 256, Extras{})
		assert.Check(t, a[1] != b[0])
	})
}

func TestChunkHashesPrefixAndTail(t *testing.T) {
	ex := Extras{CacheSalt: "s", MM: []MMInput{{Hash: []byte("i"), Offset: 250, Length: 300}}}
	tokens := testTokens(4096+100, 3)
	full := mustHashes(t, tokens, 256, ex)
	assert.Assert(t, is.Len(full, 16))
	for _, n := range []int{0, 1, 255, 256, 257, 511, 512, 2000, 4096, 4196} {
		got := mustHashes(t, tokens[:n], 256, ex)
		assert.Check(t, is.Len(got, n/256))
		assert.DeepEqual(t, got, full[:n/256], cmpopts.EquateEmpty())
	}
	// A different partial tail never changes the hashes.
	other := slices.Clone(tokens)
	for i := 4096; i < len(other); i++ {
		other[i]++
	}
	assert.DeepEqual(t, mustHashes(t, other, 256, ex), full)
	// A changed token changes its chunk and every later one, never earlier.
	other = slices.Clone(tokens)
	other[1000]++
	got := mustHashes(t, other, 256, ex)
	assert.DeepEqual(t, got[:3], full[:3])
	for i := 3; i < len(got); i++ {
		assert.Check(t, got[i] != full[i], "chunk %d", i)
	}
}

func TestExtendChunkHashes(t *testing.T) {
	ex := Extras{LoRA: &LoRA{Name: "a", Path: "/a"}, MM: []MMInput{{Hash: []byte("i"), Offset: 40, Length: 100}}}
	tokens := testTokens(1000, 9)
	want := mustHashes(t, tokens, 64, ex)

	// Decode-like growth, one token at a time, from nothing.
	var hs []kv.Hash
	for n := 0; n <= len(tokens); n++ {
		var err error
		hs, err = ExtendChunkHashes(testNS, hs, tokens[:n], 64, ex)
		assert.NilError(t, err)
		assert.Assert(t, is.Len(hs, n/64))
	}
	assert.DeepEqual(t, hs, want)

	// From any prefix, in one step.
	for k := 0; k <= len(want); k++ {
		got, err := ExtendChunkHashes(testNS, slices.Clone(want[:k]), tokens, 64, ex)
		assert.NilError(t, err)
		assert.DeepEqual(t, got, want, cmpopts.EquateEmpty())
	}

	_, err := ExtendChunkHashes(testNS, want, tokens[:100], 64, ex)
	assert.ErrorIs(t, err, ErrBadPrefix)

	// Given only the tokens from a point the prefix covers: the same keys
	// (the multimodal input at 40..140 straddles chunks 0-2), never a read
	// before that point.
	for k := 0; k <= len(want); k++ {
		for _, from := range []int{0, k * 64 / 2, k * 64} {
			got, err := ExtendChunkHashesTail(testNS, slices.Clone(want[:k]), tokens[from:], from, 64, ex)
			assert.NilError(t, err)
			assert.DeepEqual(t, got, want, cmpopts.EquateEmpty())
		}
	}
	_, err = ExtendChunkHashesTail(testNS, want[:2], tokens[129:], 129, 64, ex)
	assert.ErrorIs(t, err, ErrBadPrefix) // token 128 is in no hash
	_, err = ExtendChunkHashesTail(testNS, nil, tokens, -1, 64, ex)
	assert.ErrorIs(t, err, ErrBadPrefix)
}

func TestChunkHashesErrors(t *testing.T) {
	long := string(make([]byte, MaxFieldLen+1))
	tests := []struct {
		name  string
		chunk int
		ex    Extras
		want  error
	}{
		{name: "zero chunk", chunk: 0, want: ErrBadChunkSize},
		{name: "negative chunk", chunk: -256, want: ErrBadChunkSize},
		{name: "huge chunk", chunk: MaxChunkSize + 1, want: ErrBadChunkSize},
		{name: "long salt", chunk: 16, ex: Extras{CacheSalt: long}, want: ErrBadExtras},
		{name: "long lora name", chunk: 16, ex: Extras{LoRA: &LoRA{Name: long}}, want: ErrBadExtras},
		{name: "long lora path", chunk: 16, ex: Extras{LoRA: &LoRA{Path: long}}, want: ErrBadExtras},
		{name: "empty mm hash", chunk: 16, ex: Extras{MM: []MMInput{{Offset: 0, Length: 1}}}, want: ErrBadExtras},
		{name: "long mm hash", chunk: 16, ex: Extras{MM: []MMInput{{Hash: []byte(long), Length: 1}}}, want: ErrBadExtras},
		{name: "negative offset", chunk: 16, ex: Extras{MM: []MMInput{{Hash: []byte("h"), Offset: -1, Length: 1}}}, want: ErrBadExtras},
		{name: "zero length", chunk: 16, ex: Extras{MM: []MMInput{{Hash: []byte("h"), Offset: 1}}}, want: ErrBadExtras},
		{name: "huge offset", chunk: 16, ex: Extras{MM: []MMInput{{Hash: []byte("h"), Offset: 1 << 62, Length: 1}}}, want: ErrBadExtras},
	}
	tokens := testTokens(64, 0)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dst := make([]kv.Hash, 1, 8)
			got, err := AppendChunkHashes(dst, testNS, tokens, tc.chunk, tc.ex)
			assert.ErrorIs(t, err, tc.want)
			assert.Check(t, is.Len(got, 1), "dst must come back unchanged")
			_, err = ChunkHashes(testNS, tokens, tc.chunk, tc.ex)
			assert.ErrorIs(t, err, tc.want)
			_, err = ExtendChunkHashes(testNS, nil, tokens, tc.chunk, tc.ex)
			assert.ErrorIs(t, err, tc.want)
		})
	}
}

func TestRootHash(t *testing.T) {
	ex := Extras{CacheSalt: "s", LoRA: &LoRA{Name: "l", Path: "p"}}
	root, err := RootHash(testNS, ex)
	assert.NilError(t, err)
	// Chunk 0 chains from the root: extending "nothing" from a root-seeded
	// chain is what ChunkHashes does.
	tokens := testTokens(32, 0)
	h := getHasher()
	defer putHasher(h)
	assert.DeepEqual(t, h.chain(nil, root, 0, tokens, 0, 16, nil), mustHashes(t, tokens, 16, ex))
	// MM never enters the root.
	root2, err := RootHash(testNS, Extras{CacheSalt: "s", LoRA: &LoRA{Name: "l", Path: "p"}, MM: []MMInput{{Hash: []byte("i"), Length: 1}}})
	assert.NilError(t, err)
	assert.Equal(t, root, root2)
}

func TestAppendChunkHashesAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items under -race")
	}
	tokens := testTokens(128<<10, 0)
	dst := make([]kv.Hash, 0, 512)
	ex := Extras{CacheSalt: "s", MM: []MMInput{{Hash: []byte("i"), Offset: 1000, Length: 600}}}
	allocs := testing.AllocsPerRun(20, func() {
		var err error
		dst, err = AppendChunkHashes(dst[:0], testNS, tokens, 256, ex)
		if err != nil {
			t.Fatal(err)
		}
	})
	assert.Check(t, is.Equal(allocs, 0.0))
	assert.Check(t, is.Len(dst, 512))
}

func TestChunkHashesConcurrent(t *testing.T) {
	tokens := testTokens(64*64, 5)
	ex := Extras{CacheSalt: "c", MM: []MMInput{{Hash: []byte("i"), Offset: 100, Length: 300}}}
	want := mustHashes(t, tokens, 64, ex)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			for range 20 {
				got, err := ChunkHashes(testNS, tokens[:64*(g+1)*8], 64, ex)
				if err == nil && !slices.Equal(got, want[:len(got)]) {
					err = fmt.Errorf("goroutine %d: hashes differ", g)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestNumFullChunks(t *testing.T) {
	for _, tc := range []struct{ n, c, want int }{
		{0, 256, 0}, {255, 256, 0}, {256, 256, 1}, {1000, 256, 3}, {10, 0, 0}, {10, -1, 0}, {-5, 4, 0},
	} {
		assert.Check(t, is.Equal(NumFullChunks(tc.n, tc.c), tc.want), "%+v", tc)
	}
}

// TestExtrasEncodingDistinct: pairs of extras that a naive key (joined
// strings, no presence flags, no length prefixes) would confuse encode, and
// hash, differently; pairs that are the same inputs encode the same.
func TestExtrasEncodingDistinct(t *testing.T) {
	lora := func(name, path string) *LoRA { return &LoRA{Name: name, Path: path} }
	img := func(h string, off, n int) MMInput { return MMInput{Hash: []byte(h), Offset: off, Length: n} }
	other := testNS
	other[15] ^= 0x80
	tests := []struct {
		name   string
		nsB    *kv.Namespace // nil: testNS
		a, b   Extras
		wantEq bool
	}{
		// LoRARequest("a:b", 3, "c") vs LoRARequest("a", 4, "b:c").
		{name: "lora name:path shift", a: Extras{LoRA: lora("a:b", "c")}, b: Extras{LoRA: lora("a", "b:c")}},
		{name: "lora name/path swap", a: Extras{LoRA: lora("a", "b")}, b: Extras{LoRA: lora("b", "a")}},
		{name: "lora all in name vs all in path", a: Extras{LoRA: lora("x", "")}, b: Extras{LoRA: lora("", "x")}},
		{name: "salt x, no lora vs lora x, no salt", a: Extras{CacheSalt: "x"}, b: Extras{LoRA: lora("x", "")}},
		{name: "salt x, no lora vs lora path x, no salt", a: Extras{CacheSalt: "x"}, b: Extras{LoRA: lora("", "x")}},
		{name: "salt x vs salt x and lora x", a: Extras{CacheSalt: "x"}, b: Extras{CacheSalt: "x", LoRA: lora("x", "")}},
		{name: "no lora vs empty lora", a: Extras{}, b: Extras{LoRA: lora("", "")}},
		{name: "salt holding a fake lora", a: Extras{CacheSalt: "s\x01\x00\x00\x00\x00\x00\x00\x00\x00"}, b: Extras{CacheSalt: "s", LoRA: lora("", "")}},
		{name: "name holding a fake length prefix", a: Extras{LoRA: lora("\x01\x00\x00\x00a", "")}, b: Extras{LoRA: lora("", "a")}},
		{name: "salt with NUL", a: Extras{CacheSalt: "a\x00"}, b: Extras{CacheSalt: "a"}},
		{name: "namespace", nsB: &other, a: Extras{CacheSalt: "x"}, b: Extras{CacheSalt: "x"}},
		{name: "mm hash vs hash+position bytes", a: Extras{MM: []MMInput{img("ab", 1, 2)}}, b: Extras{MM: []MMInput{img("a", 1, 2)}}},
		{name: "one mm input vs two", a: Extras{MM: []MMInput{img("a", 1, 2)}}, b: Extras{MM: []MMInput{img("a", 1, 2), img("a", 1, 2)}}},
		{name: "mm length", a: Extras{MM: []MMInput{img("a", 1, 2)}}, b: Extras{MM: []MMInput{img("a", 1, 3)}}},
		{name: "mm offset", a: Extras{MM: []MMInput{img("a", 1, 2)}}, b: Extras{MM: []MMInput{img("a", 2, 2)}}},
		{name: "mm swapped hashes", a: Extras{MM: []MMInput{img("a", 1, 2), img("b", 9, 2)}}, b: Extras{MM: []MMInput{img("b", 1, 2), img("a", 9, 2)}}},
		{name: "same lora", a: Extras{LoRA: lora("a:b", "c")}, b: Extras{LoRA: lora("a:b", "c")}, wantEq: true},
		{name: "mm order", a: Extras{MM: []MMInput{img("a", 1, 2), img("b", 9, 2)}}, b: Extras{MM: []MMInput{img("b", 9, 2), img("a", 1, 2)}}, wantEq: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			nsB := testNS
			if tc.nsB != nil {
				nsB = *tc.nsB
			}
			assert.Equal(t, cmp.Equal(canonical(testNS, tc.a), canonical(nsB, tc.b)), tc.wantEq, "test table")
			checkPair(t, testNS, tc.a, nsB, tc.b) // encodings and hashes differ exactly when the inputs do
		})
	}
}

func TestDecodeExtras(t *testing.T) {
	ok := []struct {
		in   string
		want Extras
	}{
		{`{}`, Extras{}},
		{`{"cache_salt": null, "lora": null, "mm": null}`, Extras{}},
		{`{"cache_salt": "s"}`, Extras{CacheSalt: "s"}},
		{`{"lora": {"name": "a:b", "path": "c"}}`, Extras{LoRA: &LoRA{Name: "a:b", Path: "c"}}},
		{`{"lora": {"name": "", "path": ""}}`, Extras{LoRA: &LoRA{}}},
		{`{"lora": {"path": "p\u0000", "name": "n"}, "cache_salt": "\u00e9"}`, Extras{CacheSalt: "é", LoRA: &LoRA{Name: "n", Path: "p\x00"}}},
		{`{"mm": [{"hash": "h", "offset": 3, "length": 4}, {"length": 1, "offset": 0, "hash": "g"}]}`,
			Extras{MM: []MMInput{{Hash: []byte("h"), Offset: 3, Length: 4}, {Hash: []byte("g"), Length: 1}}}},
		{` {"mm": []} `, Extras{}},
	}
	for _, tc := range ok {
		got, err := DecodeExtras([]byte(tc.in))
		assert.NilError(t, err, tc.in)
		assert.DeepEqual(t, got, tc.want, cmpopts.EquateEmpty())
	}

	bad := []struct{ in, want string }{
		{``, "extras: not JSON"},
		{`null`, "extras: want an object, got null"},
		{`[]`, "extras: want an object, got an array"},
		{`{} {}`, "extras: not JSON"},
		{`{"salt": "x"}`, `extras: unknown field "salt"`},
		{`{"cache_salt": 5}`, "cache_salt: want a string, got the number 5"},
		{`{"cache_salt": ["x"]}`, "cache_salt: want a string, got an array"},
		// The old connector's joined string is refused, not hashed.
		{`{"lora": "a:b:c"}`, "lora: want an object {name, path}, got a string"},
		{`{"lora": ["a", "b"]}`, "lora: want an object {name, path}, got an array"},
		{`{"lora": {"name": "a"}}`, "lora.path is missing"},
		{`{"lora": {"path": "a", "name": null}}`, "lora.name is missing"},
		{`{"lora": {"name": 1, "path": "p"}}`, "lora.name: want a string, got the number 1"},
		{`{"lora": {"name": "n", "path": false}}`, "lora.path: want a string, got a boolean"},
		{`{"lora": {"name": "n", "path": "p", "id": 3}}`, `lora: unknown field "id"`},
		{`{"mm": {}}`, "mm: want an array, got an object"},
		{`{"mm": [null]}`, "mm[0]: want an object {hash, offset, length}, got null"},
		{`{"mm": [{"hash": "h", "offset": 0, "length": 1}, "x"]}`, "mm[1]: want an object {hash, offset, length}, got a string"},
		{`{"mm": [{"hash": 7, "offset": 0, "length": 1}]}`, "mm[0].hash: want a string, got the number 7"},
		{`{"mm": [{"hash": "h", "offset": 1.5, "length": 1}]}`, "mm[0].offset: want an integer, got the number 1.5"},
		{`{"mm": [{"hash": "h", "offset": "1", "length": 1}]}`, "mm[0].offset: want an integer, got a string"},
		{`{"mm": [{"hash": "h", "offset": 0}]}`, "mm[0].length is missing"},
		{`{"mm": [{"hash": "h", "offset": 0, "length": 1, "pos": 2}]}`, `mm[0]: unknown field "pos"`},
		{`{"mm": [{"hash": "", "offset": 0, "length": 1}]}`, "mm[0].hash is empty"},
		{`{"mm": [{"hash": "h", "offset": -1, "length": 1}]}`, "mm[0].offset -1 out of range"},
		{`{"cache_salt": "` + strings.Repeat("s", MaxFieldLen+1) + `"}`, "cache_salt is 4097 bytes"},
		{`{"lora": {"name": "n", "path": "` + strings.Repeat("p", MaxFieldLen+1) + `"}}`, "lora.path is 4097 bytes"},
	}
	for _, tc := range bad {
		_, err := DecodeExtras([]byte(tc.in))
		assert.ErrorIs(t, err, ErrBadExtras, tc.in)
		assert.ErrorContains(t, err, tc.want, tc.in)
	}
}
