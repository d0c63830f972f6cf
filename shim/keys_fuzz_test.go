package shim

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

// FuzzChunkHashes: arbitrary tokens, chunk sizes, extras and cut points never
// panic, errors are the sentinels, and valid inputs hash like the reference,
// keep the prefix property and extend like a full recompute.
//
//	go test ./shim -run '^$' -fuzz FuzzChunkHashes -fuzztime 30s
func FuzzChunkHashes(f *testing.F) {
	f.Add([]byte("0123456789abcdef0123456789abcdef"), int16(4), uint16(17), "", false, "", "", []byte("img"), int32(3), int32(9))
	f.Add(make([]byte, 4096), int16(256), uint16(700), "salt", true, "lora", "/p", []byte{}, int32(0), int32(0))
	f.Add([]byte{1, 2, 3}, int16(0), uint16(0), "", true, "", "", []byte("x"), int32(-1), int32(5))
	f.Add(make([]byte, 400), int16(1), uint16(99), "a", false, "", "", []byte("m"), int32(50), int32(1<<30))
	f.Fuzz(func(t *testing.T, data []byte, chunk int16, cut uint16, salt string, hasLoRA bool, loraName, loraPath string, mmHash []byte, mmOff, mmLen int32) {
		tokens := make([]uint32, len(data)/4)
		for i := range tokens {
			tokens[i] = binary.LittleEndian.Uint32(data[4*i:])
		}
		ex := Extras{CacheSalt: salt}
		if hasLoRA {
			ex.LoRA = &LoRA{Name: loraName, Path: loraPath}
		}
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
		// The same from the tokens after any point the prefix covers.
		from := min(int(cut)/2, len(pre)*cs)
		tail, err := ExtendChunkHashesTail(testNS, slices.Clone(pre), tokens[from:], from, cs, ex)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(got, tail, cmpopts.EquateEmpty()); d != "" {
			t.Fatalf("extend from %d chunks given tokens from %d differs:\n%s", len(pre), from, d)
		}
	})
}

// ---- The key encoding is injective ----
//
// appendRootMsg and appendMMSection are the bytes the hash is fed for
// everything besides the tokens (keys_hash.go). These tests check that two
// different inputs never encode to the same bytes: per pair (the fuzz target
// and the table), exhaustively over small spaces of strings built from the
// characters that broke the old "name:path" key (':', NUL, bytes that look
// like a length prefix, the empty string), and by decoding every encoding
// back: a left inverse exists only for an injective encoding.

// keyInputs is the canonical form of what a chunk key depends on besides the
// tokens: MM sorted (the encoding ignores the caller's order), LoRA nil for
// none. Different keyInputs must encode differently.
type keyInputs struct {
	NS   kv.Namespace
	Salt string
	LoRA *LoRA
	MM   []MMInput
}

func (k keyInputs) String() string {
	lora := "none"
	if k.LoRA != nil {
		lora = fmt.Sprintf("{name %q path %q}", k.LoRA.Name, k.LoRA.Path)
	}
	var mm strings.Builder
	for _, m := range k.MM {
		fmt.Fprintf(&mm, " (%q %d+%d)", m.Hash, m.Offset, m.Length)
	}
	return fmt.Sprintf("ns %x salt %q lora %s mm [%s ]", k.NS, k.Salt, lora, mm.String())
}

func canonical(ns kv.Namespace, ex Extras) keyInputs {
	mm := slices.Clone(ex.MM)
	slices.SortFunc(mm, compareMM)
	if len(mm) == 0 {
		mm = nil
	}
	return keyInputs{NS: ns, Salt: ex.CacheSalt, LoRA: ex.LoRA, MM: mm}
}

// encodeKeyInputs is what the hash is fed for ns and ex, besides tokens and
// the chain: the root message, and the multimodal section over a range that
// holds every input (per chunk, the section is the same function over the
// chunk's range).
func encodeKeyInputs(ns kv.Namespace, ex Extras) (root, mm []byte) {
	sorted := slices.Clone(ex.MM)
	slices.SortFunc(sorted, compareMM)
	return appendRootMsg(nil, ns, &ex), appendMMSection(nil, sorted, 0, maxTokenPos)
}

type msgReader struct {
	b   []byte
	bad bool
}

func (r *msgReader) take(n int) []byte {
	if r.bad || n < 0 || n > len(r.b) {
		r.bad = true
		return nil
	}
	x := r.b[:n:n]
	r.b = r.b[n:]
	return x
}

func (r *msgReader) u32() uint32 {
	if x := r.take(4); !r.bad {
		return binary.LittleEndian.Uint32(x)
	}
	return 0
}

func (r *msgReader) u64() uint64 {
	if x := r.take(8); !r.bad {
		return binary.LittleEndian.Uint64(x)
	}
	return 0
}

func (r *msgReader) lp() []byte { return r.take(int(r.u32())) }

// decodeRootMsg parses a root message strictly: every byte consumed, the
// presence byte 0 or 1.
func decodeRootMsg(b []byte) (ns kv.Namespace, salt string, lora *LoRA, ok bool) {
	r := &msgReader{b: b}
	if string(r.take(len(rootTag))) != rootTag {
		return ns, "", nil, false
	}
	copy(ns[:], r.take(len(ns)))
	salt = string(r.lp())
	switch p := r.take(1); {
	case r.bad:
	case p[0] == 1:
		lora = &LoRA{Name: string(r.lp())}
		lora.Path = string(r.lp())
	case p[0] != 0:
		r.bad = true
	}
	return ns, salt, lora, !r.bad && len(r.b) == 0
}

// decodeMMSection parses a multimodal section strictly.
func decodeMMSection(b []byte) (mm []MMInput, ok bool) {
	r := &msgReader{b: b}
	k := r.u32()
	if int(k) > len(b)/20 { // every input takes ≥ 4+1+8+8 bytes
		return nil, false
	}
	for range k {
		h := r.lp()
		off, n := r.u64(), r.u64()
		mm = append(mm, MMInput{Hash: h, Offset: int(off), Length: int(n)})
	}
	return mm, !r.bad && len(r.b) == 0
}

// checkRoundTrip: the encodings of (ns, ex) decode back to its canonical form.
func checkRoundTrip(t *testing.T, ns kv.Namespace, ex Extras) {
	t.Helper()
	want := canonical(ns, ex)
	root, mmb := encodeKeyInputs(ns, ex)
	var got keyInputs
	var ok bool
	got.NS, got.Salt, got.LoRA, ok = decodeRootMsg(root)
	if !ok {
		t.Fatalf("root message of %v does not parse: %q", want, root)
	}
	if got.MM, ok = decodeMMSection(mmb); !ok {
		t.Fatalf("mm section of %v does not parse: %q", want, mmb)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("encoding does not decode to its input (-want +got):\n%s", d)
	}
}

// checkPair: a and b encode to the same bytes, and hash to the same chunk
// keys, exactly when they are the same inputs. Every mm input of a and b
// must overlap the full chunks of injectiveTokens.
func checkPair(t *testing.T, nsA kv.Namespace, a Extras, nsB kv.Namespace, b Extras) {
	t.Helper()
	same := cmp.Equal(canonical(nsA, a), canonical(nsB, b))
	rootA, mmA := encodeKeyInputs(nsA, a)
	rootB, mmB := encodeKeyInputs(nsB, b)
	if encSame := bytes.Equal(rootA, rootB) && bytes.Equal(mmA, mmB); encSame != same {
		t.Fatalf("inputs equal: %v, encodings equal: %v\na: %v %q %q\nb: %v %q %q",
			same, encSame, canonical(nsA, a), rootA, mmA, canonical(nsB, b), rootB, mmB)
	}
	// What is hashed is these encodings: the root is their SHA-256, and
	// equal hashes come exactly from equal inputs.
	ha, errA := ChunkHashes(nsA, injectiveTokens, injectiveChunk, a)
	hb, errB := ChunkHashes(nsB, injectiveTokens, injectiveChunk, b)
	if errA != nil || errB != nil {
		t.Fatalf("valid extras refused: %v, %v", errA, errB)
	}
	if rootHash, _ := RootHash(nsA, a); rootHash != sha256.Sum256(rootA) {
		t.Fatalf("the root is not the hash of appendRootMsg")
	}
	if hashSame := slices.Equal(ha, hb); hashSame != same {
		t.Fatalf("inputs equal: %v, chunk hashes equal: %v\na: %v\nb: %v", same, hashSame, canonical(nsA, a), canonical(nsB, b))
	}
}

const injectiveChunk = 8

// injectiveTokens: 8 full chunks of 8; generated mm inputs lie inside them.
var injectiveTokens = testTokens(8*injectiveChunk+3, 11)

// pieces are the building blocks of generated strings: the separators and
// bytes that make naive encodings ambiguous, including a fake length prefix.
var pieces = []string{"a", "b", ":", "\x00", "\x01", "\x01\x00\x00\x00", "\xff"}

// genString: up to 3 pieces, chosen by the next bytes of data.
func genString(data *[]byte) string {
	var s strings.Builder
	for range int(nextByte(data) % 4) {
		s.WriteString(pieces[int(nextByte(data))%len(pieces)])
	}
	return s.String()
}

func nextByte(data *[]byte) byte {
	if len(*data) == 0 {
		return 0
	}
	c := (*data)[0]
	*data = (*data)[1:]
	return c
}

// genMM: up to 4 mm inputs inside injectiveTokens' full chunks, hashes
// non-empty.
func genMM(data []byte) []MMInput {
	var mm []MMInput
	for range int(nextByte(&data) % 5) {
		h := genString(&data)
		if h == "" {
			h = ":"
		}
		off := int(nextByte(&data)) % (8 * injectiveChunk)
		n := 1 + int(nextByte(&data))%(8*injectiveChunk-off)
		mm = append(mm, MMInput{Hash: []byte(h), Offset: off, Length: n})
	}
	return mm
}

func fuzzNS(b uint8) kv.Namespace {
	ns := testNS
	ns[int(b)%len(ns)] ^= b >> 4
	return ns
}

// FuzzExtrasInjective: two arbitrary (namespace, salt, LoRA, mm list) inputs
// encode (and hash) the same exactly when they are equal, and each encoding
// decodes back to its input.
//
//	go test ./shim -run '^$' -fuzz FuzzExtrasInjective -fuzztime 60s
func FuzzExtrasInjective(f *testing.F) {
	type side struct {
		ns                uint8
		salt              string
		lora              bool
		loraName, loraPth string
		mm                []byte
	}
	add := func(a, b side) {
		f.Add(a.ns, a.salt, a.lora, a.loraName, a.loraPth, a.mm, b.ns, b.salt, b.lora, b.loraName, b.loraPth, b.mm)
	}
	add(side{lora: true, loraName: "a:b", loraPth: "c"}, side{lora: true, loraName: "a", loraPth: "b:c"})
	add(side{salt: "x"}, side{lora: true, loraName: "x"}) // salt and LoRA swap
	add(side{salt: "x"}, side{lora: true, loraPth: "x"})
	add(side{}, side{lora: true})                                         // no LoRA vs empty LoRA
	add(side{salt: "a\x00\x00\x00\x00\x00"}, side{salt: "a", lora: true}) // salt that looks like a LoRA
	add(side{lora: true, loraName: "\x01\x00\x00\x00a"}, side{lora: true, loraName: "", loraPth: "\x01\x00\x00\x00a"})
	add(side{mm: []byte{1, 1, 0, 3, 4}}, side{mm: []byte{1, 1, 0, 3, 5}})                         // same hash, other length
	add(side{mm: []byte{2, 1, 0, 3, 4, 1, 1, 5, 6}}, side{mm: []byte{2, 1, 1, 5, 6, 1, 0, 3, 4}}) // same inputs, other order
	add(side{mm: []byte{1, 2, 0, 2, 3, 4}}, side{mm: []byte{1, 1, 0, 3, 4}})
	add(side{ns: 0x13}, side{ns: 0x14})
	f.Fuzz(func(t *testing.T, nsA uint8, saltA string, loraA bool, nameA, pathA string, mmA []byte,
		nsB uint8, saltB string, loraB bool, nameB, pathB string, mmB []byte) {
		mk := func(salt string, lora bool, name, path string, mm []byte) Extras {
			ex := Extras{CacheSalt: salt, MM: genMM(mm)}
			if lora {
				ex.LoRA = &LoRA{Name: name, Path: path}
			}
			return ex
		}
		a, b := mk(saltA, loraA, nameA, pathA, mmA), mk(saltB, loraB, nameB, pathB, mmB)
		if a.Validate() != nil || b.Validate() != nil {
			return // over MaxFieldLen: refused before anything is hashed
		}
		checkPair(t, fuzzNS(nsA), a, fuzzNS(nsB), b)
		checkPair(t, fuzzNS(nsA), a, fuzzNS(nsA), a)
		checkRoundTrip(t, fuzzNS(nsA), a)
		checkRoundTrip(t, fuzzNS(nsB), b)
	})
}

// TestRootEncodingInjectiveExhaustive: every (salt, LoRA) over strings of up
// to two pieces has its own root message and its own root hash.
func TestRootEncodingInjectiveExhaustive(t *testing.T) {
	strs := []string{""}
	for _, p := range pieces {
		strs = append(strs, p)
		for _, q := range pieces {
			strs = append(strs, p+q)
		}
	}
	loras := []*LoRA{nil}
	for _, n := range strs {
		for _, p := range strs {
			loras = append(loras, &LoRA{Name: n, Path: p})
		}
	}
	msgs := make(map[string]keyInputs, len(strs)*len(loras))
	roots := make(map[kv.Hash]bool, len(strs)*len(loras))
	for _, salt := range strs {
		for _, l := range loras {
			in := keyInputs{NS: testNS, Salt: salt, LoRA: l}
			ex := Extras{CacheSalt: salt, LoRA: l}
			m := string(appendRootMsg(nil, testNS, &ex))
			if prev, dup := msgs[m]; dup {
				t.Fatalf("%v and %v encode to the same root message %q", prev, in, m)
			}
			msgs[m] = in
			root, err := RootHash(testNS, ex)
			assert.NilError(t, err)
			assert.Assert(t, !roots[root], "%v: root hash seen before", in)
			roots[root] = true
		}
	}
	t.Logf("%d distinct (salt, LoRA) inputs, %d distinct root messages", len(strs)*len(loras), len(msgs))
}

// TestExtrasEncodingInjectiveRandom: many random pairs and values from the
// small alphabet (so that near-collisions are common), each value decoded
// back, and every value's encoding owned by one canonical input.
func TestExtrasEncodingInjectiveRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 8))
	n := 20000
	if testing.Short() || raceEnabled {
		n = 2000
	}
	gen := func() (kv.Namespace, Extras) {
		data := make([]byte, 40)
		for i := range data {
			data[i] = byte(rng.UintN(256))
		}
		ns := fuzzNS(byte(rng.UintN(4)))
		ex := Extras{CacheSalt: genString(&data), MM: genMM(data[20:])}
		if rng.UintN(2) == 0 {
			ex.LoRA = &LoRA{Name: genString(&data), Path: genString(&data)}
		}
		return ns, ex
	}
	owner := make(map[string]keyInputs)
	for range n {
		nsA, a := gen()
		nsB, b := gen()
		checkRoundTrip(t, nsA, a)
		checkPair(t, nsA, a, nsB, b)
		root, mm := encodeKeyInputs(nsA, a)
		k := string(root) + "|" + string(mm) // the root message is self-delimiting
		in := canonical(nsA, a)
		if prev, ok := owner[k]; ok && !cmp.Equal(prev, in) {
			t.Fatalf("%v and %v share the encoding %q", prev, in, k)
		}
		owner[k] = in
	}
}

// TestNamespaceInjective: namespace specs that differ in a field the
// namespace covers get different namespaces (specs over small strings with
// separators and fake length prefixes; MLA specs that share a KV world
// share a namespace on purpose).
func TestNamespaceInjective(t *testing.T) {
	strs := []string{"a", ":", "\x00", "a:", ":a", "\x01\x00\x00\x00", "a\x00"}
	type canon struct {
		Model, DType, Layout string
		Format               uint32
		World, TP, Chunk, KV int
		MLA                  bool
	}
	seen := make(map[kv.Namespace]canon)
	for _, m := range strs {
		for _, d := range strs {
			for _, l := range strs {
				for _, v := range []struct {
					world, tp, chunk, kv int
					mla                  bool
				}{{1, 0, 16, 0, false}, {2, 0, 16, 0, false}, {2, 1, 16, 0, false}, {1, 0, 32, 0, false},
					{1, 0, 16, 1, false}, {1, 0, 16, 0, true}, {4, 2, 16, 0, true}, {2, 2, 16, 0, true}} {
					spec := NamespaceSpec{Model: m, DType: d, LayoutFingerprint: l, ObjectFormat: 1,
						WorldSize: v.world, TPSize: v.tp, ChunkSize: v.chunk, KVGroup: v.kv, MLA: v.mla}
					ns, err := spec.Namespace()
					assert.NilError(t, err)
					w, tp := spec.kvWorld()
					c := canon{m, d, l, 1, w, tp, v.chunk, v.kv, v.mla}
					if prev, ok := seen[ns]; ok && prev != c {
						t.Fatalf("%+v and %+v share namespace %x", prev, c, ns)
					}
					seen[ns] = c
				}
			}
		}
	}
}

// FuzzDecodeExtras: any bytes Python could send as extras either decode to
// Extras that validate, or fail with ErrBadExtras; never a panic.
func FuzzDecodeExtras(f *testing.F) {
	for _, s := range []string{`{}`, `null`, `{"cache_salt":"s"}`, `{"lora":{"name":"a:b","path":"c"}}`,
		`{"mm":[{"hash":"h","offset":0,"length":4}]}`, `{"lora":"a:b:c"}`, `{"mm":[{"hash":"h","offset":-1,"length":1}]}`,
		`{"cache_salt":"x"} trailing`, `[`, ``} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ex, err := DecodeExtras(b)
		if err != nil {
			if !errors.Is(err, ErrBadExtras) {
				t.Fatalf("error %v does not wrap ErrBadExtras", err)
			}
			return
		}
		if err := ex.Validate(); err != nil {
			t.Fatalf("decoded extras do not validate: %v", err)
		}
	})
}
