package shim

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// metaSample has every field set, -1 skips and ids that take 1..3 varint bytes.
func metaSample() *StepMeta {
	return &StepMeta{
		Loads: []LoadSpec{
			{Req: "a", Owner: kv.Tag{1, 2, 15: 3}, Lookup: 1 << 40, Start: 1, End: 3,
				Hashes: []kv.Hash{{1, 31: 2}, {3}}, Blocks: []int64{-1, 5, 6, 7}},
			{Req: "", Group: 300, Lookup: 7, Start: 4, End: 4},
		},
		Saves: []SaveSpec{
			{Req: "b", Group: 1, First: 2, Hashes: []kv.Hash{{9}}, Blocks: []int64{-1, 2}},
			{Req: "ü\x00", First: 1<<32 - 1, Hashes: []kv.Hash{{0xff}, {31: 0xff}}, Blocks: []int64{0, 63, 64, 70000}},
		},
		Finished:  []string{"c", ""},
		Preempted: []string{"d"},
	}
}

func TestStepMetaRoundTrip(t *testing.T) {
	for _, m := range []*StepMeta{metaSample(), {}, {Finished: []string{"x"}}} {
		b, err := m.Encode()
		assert.NilError(t, err)
		assert.Equal(t, b[0], byte(MetaVersion))
		got, err := DecodeStepMeta(b, 2, 70001)
		assert.NilError(t, err)
		assert.DeepEqual(t, got, m)
	}
}

// The hashes travel as raw bytes: 32 bytes a hash, no hex, no JSON.
func TestStepMetaIsBinary(t *testing.T) {
	h := kv.Hash{0xde, 0xad, 0xbe, 0xef, 31: 0x42}
	m := &StepMeta{Saves: []SaveSpec{{Req: "r", Hashes: []kv.Hash{h}, Blocks: []int64{1, 2}}}}
	b, err := m.Encode()
	assert.NilError(t, err)
	assert.Check(t, bytes.Contains(b, h[:]))
	assert.Check(t, !bytes.Contains(b, []byte("deadbeef")))
	// version, 0 loads, 1 save: "r", group 0, first 0, 1 hash, 2 blocks, 0 finished, 0 preempted
	want := append([]byte{MetaVersion, 0, 1, 1, 'r', 0, 0, 1}, h[:]...)
	want = append(want, 2, 2, 4, 0, 0)
	assert.DeepEqual(t, b, want)
}

// The JSON text form (what json.Marshal prints, hex hashes) still decodes:
// hand-written metadata in tests.
func TestStepMetaTextForm(t *testing.T) {
	m := metaSample()
	text, err := json.Marshal(m)
	assert.NilError(t, err)
	assert.Check(t, is.Contains(string(text), `"hashes":["0100000000000000000000000000000000000000000000000000000000000002"`))
	got, err := DecodeStepMeta(text, 2, 70001)
	assert.NilError(t, err)
	assert.DeepEqual(t, got, m)
}

func TestStepMetaRejects(t *testing.T) {
	for _, tc := range []struct{ name, meta, want string }{
		{"not json", `{`, "bad step metadata"},
		{"short blocks", `{"loads":[{"req":"a","start":0,"end":2,"blocks":[1,2,3]}]}`, "3 block ids for 2 chunks"},
		{"range", `{"loads":[{"req":"a","start":3,"end":2,"blocks":[]}]}`, "chunk range [3, 2)"},
		{"block out of range", `{"saves":[{"req":"a","hashes":["` + hex64 + `"],"blocks":[1,8]}]}`, "block id 8 outside"},
		{"below skip in save", `{"saves":[{"req":"a","hashes":["` + hex64 + `"],"blocks":[-2,1]}]}`, "block id -2 outside"},
		{"short hash", `{"saves":[{"req":"a","hashes":["00"],"blocks":[1,1]}]}`, "want 64 hex digits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeStepMeta([]byte(tc.meta), 2, 8)
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

// Binary metadata that is cut, padded, forged or of another version is
// refused with ErrBadMeta, never read past its end or allocated from a
// forged count; the layout checks apply as to the text form.
func TestStepMetaRejectsBinary(t *testing.T) {
	good, err := metaSample().Encode()
	assert.NilError(t, err)
	enc := func(m *StepMeta) []byte {
		b, err := m.Encode()
		assert.NilError(t, err)
		return b
	}
	uv := func(v uint64) []byte { return binary.AppendUvarint(nil, v) }
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	for _, tc := range []struct {
		name string
		meta []byte
		want string
	}{
		{"version 0", []byte{0, 0, 0, 0, 0}, "version 0 (this library reads version 2)"},
		{"version 3", cat([]byte{3}, good[1:]), "version 3"},
		{"trailing byte", cat(good, []byte{0}), "1 bytes after the metadata"},
		{"only the version", []byte{MetaVersion}, "loads: truncated"},
		{"forged load count", cat([]byte{MetaVersion}, uv(1<<62)), "4611686018427387904 loads in 0 bytes"},
		{"forged hash count", cat([]byte{MetaVersion, 0, 1, 0, 0, 0}, uv(1<<40), make([]byte, 64)), "1099511627776 chunk hashes in 64 bytes"},
		{"forged block count", cat([]byte{MetaVersion, 0, 1, 0, 0, 0, 0}, uv(3), []byte{2, 2}), "3 block ids in 2 bytes"},
		{"forged string length", cat([]byte{MetaVersion, 0, 0, 1}, uv(9), []byte("abc")), "9 finished bytes in 3 bytes"},
		{"start past 32 bits", cat([]byte{MetaVersion, 1, 0, 0}, make([]byte, 16), uv(0), uv(1<<32)), "start 4294967296 does not fit 32 bits"},
		{"overlong varint", cat([]byte{MetaVersion}, bytes.Repeat([]byte{0x80}, 10), []byte{1}), "loads: truncated or overlong varint"},
		{"truncated block", cat([]byte{MetaVersion, 0, 1, 0, 0, 0, 0, 2, 2, 0x80}), "block id 1 of 2: truncated"},
		{"block out of range", enc(&StepMeta{Saves: []SaveSpec{{Req: "a", Hashes: []kv.Hash{{}}, Blocks: []int64{1, 8}}}}), "block id 8 outside"},
		{"below skip in save", enc(&StepMeta{Saves: []SaveSpec{{Req: "a", Hashes: []kv.Hash{{}}, Blocks: []int64{-2, 1}}}}), "block id -2 outside"},
		{"range", enc(&StepMeta{Loads: []LoadSpec{{Req: "a", Start: 3, End: 2}}}), "chunk range [3, 2)"},
		{"hashes for the range", enc(&StepMeta{Loads: []LoadSpec{{Req: "a", End: 1, Hashes: []kv.Hash{{}, {}}, Blocks: []int64{1, 2}}}}), "2 chunk hashes for chunks [0, 1)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeStepMeta(tc.meta, 2, 8)
			assert.Check(t, is.ErrorIs(err, ErrBadMeta))
			assert.ErrorContains(t, err, tc.want)
		})
	}
	// Every cut of a good encoding is refused (and none panics).
	for n := 1; n < len(good); n++ {
		_, err := DecodeStepMeta(good[:n], 2, 70001)
		assert.Check(t, is.ErrorIs(err, ErrBadMeta), "cut at %d", n)
	}
}

const hex64 = "0000000000000000000000000000000000000000000000000000000000000000"

// benchStep is a large step: 64 requests of 64 chunks (256-token chunks of
// 16-token blocks: 16 block ids a chunk), half loads, half saves.
func benchStep() *StepMeta {
	rng := rand.New(rand.NewPCG(1, 2))
	const reqs, chunks, cb = 64, 64, 16
	m := &StepMeta{}
	hashes := func() []kv.Hash {
		hs := make([]kv.Hash, chunks)
		for i := range hs {
			for j := range hs[i] {
				hs[i][j] = byte(rng.Uint32())
			}
		}
		return hs
	}
	blocks := func() []int64 {
		ids := make([]int64, chunks*cb)
		for i := range ids {
			ids[i] = rng.Int64N(200_000)
		}
		return ids
	}
	for i := range reqs / 2 {
		m.Loads = append(m.Loads, LoadSpec{Req: fmt.Sprintf("cmpl-%032x-0", i), Owner: kv.Tag{1}, Lookup: uint64(i),
			Start: 0, End: chunks, Hashes: hashes(), Blocks: blocks()})
		m.Saves = append(m.Saves, SaveSpec{Req: fmt.Sprintf("cmpl-%032x-1", i), Hashes: hashes(), Blocks: blocks()})
	}
	return m
}

// The forms measured for the metadata (go test -run '^$' -bench StepMeta
// ./shim): the binary form, the former hex JSON, and base64-in-JSON.
func BenchmarkStepMeta(b *testing.B) {
	m := benchStep()
	bin, _ := m.Encode()
	hexJSON, _ := json.Marshal(m)
	b64JSON, _ := json.Marshal(toB64(m))
	b.Run("encode/binary", func(b *testing.B) {
		for b.Loop() {
			_, _ = m.Encode()
		}
		b.ReportMetric(float64(len(bin)), "wire-bytes")
	})
	b.Run("encode/hex-json", func(b *testing.B) {
		for b.Loop() {
			_, _ = json.Marshal(m)
		}
		b.ReportMetric(float64(len(hexJSON)), "wire-bytes")
	})
	b.Run("encode/base64-json", func(b *testing.B) {
		for b.Loop() {
			_, _ = json.Marshal(toB64(m))
		}
		b.ReportMetric(float64(len(b64JSON)), "wire-bytes")
	})
	b.Run("decode/binary", func(b *testing.B) {
		for b.Loop() {
			if _, err := DecodeStepMeta(bin, 16, 200_000); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode/hex-json", func(b *testing.B) {
		for b.Loop() {
			if _, err := DecodeStepMeta(hexJSON, 16, 200_000); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode/base64-json", func(b *testing.B) {
		for b.Loop() {
			var x b64Meta
			if err := json.Unmarshal(b64JSON, &x); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// base64-in-JSON, the alternative measured against the binary form.
type (
	b64Hash [32]byte
	b64Load struct {
		Req    string    `json:"req"`
		Owner  []byte    `json:"owner"`
		Lookup uint64    `json:"lookup"`
		Start  uint32    `json:"start"`
		End    uint32    `json:"end"`
		Hashes []b64Hash `json:"hashes,omitempty"`
		Blocks []int64   `json:"blocks"`
	}
	b64Save struct {
		Req    string    `json:"req"`
		First  uint32    `json:"first"`
		Hashes []b64Hash `json:"hashes"`
		Blocks []int64   `json:"blocks"`
	}
	b64Meta struct {
		Loads     []b64Load `json:"loads,omitempty"`
		Saves     []b64Save `json:"saves,omitempty"`
		Finished  []string  `json:"finished,omitempty"`
		Preempted []string  `json:"preempted,omitempty"`
	}
)

func (h b64Hash) MarshalText() ([]byte, error) {
	return base64.StdEncoding.AppendEncode(nil, h[:]), nil
}

func (h *b64Hash) UnmarshalText(b []byte) error {
	if n, err := base64.StdEncoding.Decode(h[:], b); err != nil || n != len(h) {
		return fmt.Errorf("bad hash %q", b)
	}
	return nil
}

func toB64(m *StepMeta) *b64Meta {
	hs := func(in []kv.Hash) []b64Hash {
		out := make([]b64Hash, len(in))
		for i := range in {
			out[i] = b64Hash(in[i])
		}
		return out
	}
	x := &b64Meta{Finished: m.Finished, Preempted: m.Preempted}
	for _, l := range m.Loads {
		x.Loads = append(x.Loads, b64Load{l.Req, l.Owner[:], l.Lookup, l.Start, l.End, hs(l.Hashes), l.Blocks})
	}
	for _, s := range m.Saves {
		x.Saves = append(x.Saves, b64Save{s.Req, s.First, hs(s.Hashes), s.Blocks})
	}
	return x
}

// The golden file pins the binary form of version MetaVersion: a change to
// it must bump the version. Its "text" is the same metadata's JSON text
// form, so another reader (kvshim.vllm.read_meta, tests/vllm/test_tokens.py)
// can check itself against it. Regenerate only with a new version:
//
//	go test ./shim -run StepMetaGolden -update-golden
func TestStepMetaGolden(t *testing.T) {
	const path = "testdata/meta_v1_golden.json"
	type golden struct {
		Comment string          `json:"comment"`
		Version int             `json:"version"`
		Binary  string          `json:"binary"`
		Text    json.RawMessage `json:"text"`
	}
	m := metaSample()
	bin, err := m.Encode()
	assert.NilError(t, err)
	text, err := json.Marshal(m)
	assert.NilError(t, err)
	if *update {
		g := golden{Comment: "shim.StepMeta's binary form (hex) and its JSON text form; written by go test ./shim -run StepMetaGolden -update-golden",
			Version: MetaVersion, Binary: hex.EncodeToString(bin), Text: text}
		out, err := json.MarshalIndent(g, "", " ")
		assert.NilError(t, err)
		assert.NilError(t, os.WriteFile(path, append(out, '\n'), 0o644))
	}
	raw, err := os.ReadFile(path)
	assert.NilError(t, err)
	var g golden
	assert.NilError(t, json.Unmarshal(raw, &g))
	assert.Equal(t, g.Version, MetaVersion)
	assert.Equal(t, g.Binary, hex.EncodeToString(bin), "the binary form of version %d changed", MetaVersion)
	want, err := hex.DecodeString(g.Binary)
	assert.NilError(t, err)
	got, err := DecodeStepMeta(want, 2, 70001)
	assert.NilError(t, err)
	assert.DeepEqual(t, got, m)
	var a, b any
	assert.NilError(t, json.Unmarshal(g.Text, &a))
	assert.NilError(t, json.Unmarshal(text, &b))
	assert.DeepEqual(t, a, b)
}
