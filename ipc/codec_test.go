package ipc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/google/uuid"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func randBytes(r *rand.Rand, b []byte) {
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func randHashes(r *rand.Rand, n int) []kv.Hash {
	hs := make([]kv.Hash, n)
	for i := range hs {
		randBytes(r, hs[i][:])
	}
	return hs
}

func randStatusLocs(r *rand.Rand, n int) ([]Status, []Loc) {
	st, locs := make([]Status, n), make([]Loc, n)
	for i := range st {
		st[i] = Status(r.Int32() - 1<<30)
		locs[i] = Loc{Segment: r.Uint32(), Offset: r.Uint64(), Size: r.Uint64()}
	}
	return st, locs
}

// codecCase is one message type: a generator and its round trip.
type codecCase struct {
	name string
	gen  func(r *rand.Rand, n int) any
	enc  func(any) ([]byte, error)
	dec  func([]byte) (any, error)
}

func cc[T any](name string, gen func(*rand.Rand, int) *T, enc func([]byte, *T) ([]byte, error), dec func([]byte) (*T, error)) codecCase {
	return codecCase{name,
		func(r *rand.Rand, n int) any { return gen(r, n) },
		func(v any) ([]byte, error) { return enc(nil, v.(*T)) },
		func(b []byte) (any, error) { return dec(b) },
	}
}

var codecCases = []codecCase{
	cc("AllocReq", func(r *rand.Rand, n int) *AllocReq {
		m := &AllocReq{Rank: r.Uint32(), Hashes: randHashes(r, n), Sizes: make([]uint64, n)}
		randBytes(r, m.Tag[:])
		randBytes(r, m.Namespace[:])
		for i := range m.Sizes {
			m.Sizes[i] = r.Uint64()
		}
		return m
	}, AppendAllocReq, DecodeAllocReq),
	cc("AllocResp", func(r *rand.Rand, n int) *AllocResp {
		st, l := randStatusLocs(r, n)
		return &AllocResp{Status: st, Locs: l}
	}, AppendAllocResp, DecodeAllocResp),
	cc("CommitReq", func(r *rand.Rand, n int) *CommitReq {
		m := &CommitReq{Rank: r.Uint32(), Hashes: randHashes(r, n)}
		randBytes(r, m.Tag[:])
		randBytes(r, m.Namespace[:])
		return m
	}, AppendCommitReq, DecodeCommitReq),
	cc("CommitResp", func(r *rand.Rand, n int) *CommitResp {
		st, _ := randStatusLocs(r, n)
		return &CommitResp{Status: st}
	}, AppendCommitResp, DecodeCommitResp),
	cc("LookupReq", func(r *rand.Rand, n int) *LookupReq {
		m := &LookupReq{LookupID: r.Uint64(), WorldSize: r.Uint32(), MLA: r.IntN(2) == 1, AnswerFinal: r.IntN(2) == 1, Hashes: randHashes(r, n)}
		randBytes(r, m.Namespace[:])
		return m
	}, AppendLookupReq, DecodeLookupReq),
	cc("LookupResultReq", func(r *rand.Rand, n int) *LookupResultReq {
		return &LookupResultReq{LookupID: r.Uint64()}
	}, AppendLookupResultReq, DecodeLookupResultReq),
	cc("LookupResultResp", func(r *rand.Rand, n int) *LookupResultResp {
		m := &LookupResultResp{Status: Status(r.Int32()), Chunks: r.Uint32(), Generation: r.Uint64()}
		for range n % 5 {
			m.Sources = append(m.Sources, SourceRun{Tier: Tier(r.IntN(numTiers)), Chunks: r.Uint32()})
		}
		return m
	}, AppendLookupResultResp, DecodeLookupResultResp),
	cc("FreeReq", func(r *rand.Rand, n int) *FreeReq {
		return &FreeReq{LookupID: r.Uint64(), Start: r.Uint32(), End: r.Uint32()}
	}, AppendFreeReq, DecodeFreeReq),
	cc("RetrieveReq", func(r *rand.Rand, n int) *RetrieveReq {
		m := &RetrieveReq{LookupID: r.Uint64(), Rank: r.Uint32(), Start: r.Uint32(), End: r.Uint32()}
		randBytes(r, m.Owner[:])
		return m
	}, AppendRetrieveReq, DecodeRetrieveReq),
	cc("RetrieveResp", func(r *rand.Rand, n int) *RetrieveResp {
		st, l := randStatusLocs(r, n)
		return &RetrieveResp{Status: st, Locs: l}
	}, AppendRetrieveResp, DecodeRetrieveResp),
	cc("ReleaseReq", func(r *rand.Rand, n int) *ReleaseReq {
		m := &ReleaseReq{LookupID: r.Uint64(), Rank: r.Uint32()}
		randBytes(r, m.Owner[:])
		return m
	}, AppendReleaseReq, DecodeReleaseReq),
	cc("StatsResp", func(r *rand.Rand, n int) *StatsResp {
		m := &StatsResp{Stats: make([]Stat, n%40)}
		for i := range m.Stats {
			name := make([]byte, r.IntN(MaxStatName+1))
			randBytes(r, name)
			m.Stats[i] = Stat{Name: string(name), Value: r.NormFloat64()}
		}
		return m
	}, AppendStatsResp, DecodeStatsResp),
	cc("ClearResp", func(r *rand.Rand, n int) *ClearResp {
		return &ClearResp{Objects: r.Uint64(), Bytes: r.Uint64()}
	}, AppendClearResp, DecodeClearResp),
	cc("ResetReq", func(r *rand.Rand, n int) *ResetReq {
		m := &ResetReq{Bump: r.IntN(2) == 1, AtLeast: r.Uint64()}
		for range n % 9 {
			var ns kv.Namespace
			randBytes(r, ns[:])
			m.Namespaces = append(m.Namespaces, ns)
		}
		return m
	}, AppendResetReq, DecodeResetReq),
	cc("ResetResp", func(r *rand.Rand, n int) *ResetResp {
		return &ResetResp{Generation: r.Uint64(), Objects: r.Uint64(), Bytes: r.Uint64()}
	}, AppendResetResp, DecodeResetResp),
	cc("Hello", func(r *rand.Rand, n int) *Hello {
		h := &Hello{Version: ProtocolVersion, Role: Role(1 + r.IntN(3)), PID: r.Uint32()}
		randBytes(r, h.Instance[:])
		return h
	}, func(b []byte, h *Hello) ([]byte, error) { return AppendHello(b, *h), nil },
		func(b []byte) (*Hello, error) { h, err := DecodeHello(b); return &h, err }),
	cc("FrameHeader", func(r *rand.Rand, n int) *FrameHeader {
		return &FrameHeader{Flags: uint8(r.IntN(2)), Op: Op(r.Uint32()), Status: Status(r.Int32()), ReqID: r.Uint64()}
	}, func(b []byte, h *FrameHeader) ([]byte, error) { return AppendFrameHeader(b, *h), nil },
		func(b []byte) (*FrameHeader, error) {
			h, rest, err := DecodeFrame(b)
			if err == nil && len(rest) != 0 {
				err = ErrMalformed
			}
			return &h, err
		}),
}

// Property: decode(encode(m)) == m for random messages of every type and
// batch size, and every strict prefix of an encoding is rejected.
func TestCodecRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, tc := range codecCases {
		t.Run(tc.name, func(t *testing.T) {
			for i := 0; i < 200; i++ {
				n := []int{0, 1, 64, r.IntN(300)}[i%4]
				m := tc.gen(r, n)
				b, err := tc.enc(m)
				assert.NilError(t, err)
				got, err := tc.dec(b)
				assert.NilError(t, err)
				if !reflect.DeepEqual(normalize(got), normalize(m)) {
					t.Fatalf("round trip differs:\n got %+v\nwant %+v", got, m)
				}
				if i%20 == 0 {
					for cut := 0; cut < len(b); cut += 1 + len(b)/50 {
						_, err := tc.dec(b[:cut])
						assert.Assert(t, errors.Is(err, ErrMalformed), "prefix %d of %d: %v", cut, len(b), err)
					}
					_, err := tc.dec(append(b, 0))
					assert.Assert(t, errors.Is(err, ErrMalformed), "trailing byte accepted")
				}
			}
		})
	}
}

// normalize maps nil and empty slices to the same value for DeepEqual.
func normalize(v any) any {
	rv := reflect.ValueOf(v).Elem()
	out := reflect.New(rv.Type()).Elem()
	out.Set(rv)
	for i := 0; i < out.NumField(); i++ {
		f := out.Field(i)
		if f.Kind() == reflect.Slice && f.Len() == 0 {
			f.Set(reflect.Zero(f.Type()))
		}
	}
	return out.Interface()
}

func TestCodecLimits(t *testing.T) {
	_, err := AppendAllocReq(nil, &AllocReq{Hashes: make([]kv.Hash, 2), Sizes: make([]uint64, 1)})
	assert.Assert(t, errors.Is(err, ErrMalformed))
	_, err = AppendCommitReq(nil, &CommitReq{Hashes: make([]kv.Hash, MaxKeys+1)})
	assert.Assert(t, errors.Is(err, ErrMalformed))
	// A lying count is rejected before any allocation.
	b := append(make([]byte, 36), 0xff, 0xff, 0xff, 0x7f)
	_, err = DecodeAllocReq(b)
	assert.ErrorContains(t, err, "MaxKeys")
	b = append(make([]byte, 36), 0x00, 0x00, 0x01, 0x00) // 65536 keys, no bytes
	_, err = DecodeAllocReq(b)
	assert.ErrorContains(t, err, "exceeds remaining")
	// Version mismatch names both versions.
	_, err = DecodeHello(AppendHello(nil, Hello{Version: 7, Role: RoleWorker}))
	assert.Assert(t, errors.Is(err, ErrVersion))
	assert.ErrorContains(t, err, "version 7")
	assert.ErrorContains(t, err, fmt.Sprintf("version %d", ProtocolVersion))
	_, err = DecodeHello(AppendHello(nil, Hello{Version: ProtocolVersion, Role: 9, Instance: uuid.New()}))
	assert.ErrorContains(t, err, "role")
	// Flags: known ones round-trip, unknown ones are refused.
	h, err := DecodeHello(AppendHello(nil, Hello{Version: ProtocolVersion, Role: RoleWorker, Flags: HelloDrained}))
	assert.NilError(t, err)
	assert.Equal(t, h.Flags, HelloDrained)
	_, err = DecodeHello(AppendHello(nil, Hello{Version: ProtocolVersion, Role: RoleWorker, Flags: 0x80}))
	assert.ErrorContains(t, err, "unknown flags")
	_, _, err = DecodeFrame(append([]byte{2}, make([]byte, 15)...))
	assert.ErrorContains(t, err, "codec version 2")
}

// fuzzDecoder: the decoder never panics, every failure wraps ErrMalformed
// (or ErrVersion for the hello), and whatever decodes re-encodes to the
// same bytes (canonical encoding).
func fuzzDecoder(f *testing.F, name string) {
	var tc codecCase
	for _, c := range codecCases {
		if c.name == name {
			tc = c
		}
	}
	r := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{0, 1, 3, 64} {
		b, err := tc.enc(tc.gen(r, n))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := tc.dec(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrVersion) {
				t.Fatalf("error does not wrap ErrMalformed: %v", err)
			}
			return
		}
		again, err := tc.enc(m)
		if err != nil {
			t.Fatalf("decoded message does not encode: %v", err)
		}
		if string(again) != string(b) {
			t.Fatalf("re-encoding differs")
		}
	})
}

func FuzzDecodeAllocReq(f *testing.F)         { fuzzDecoder(f, "AllocReq") }
func FuzzDecodeAllocResp(f *testing.F)        { fuzzDecoder(f, "AllocResp") }
func FuzzDecodeCommitReq(f *testing.F)        { fuzzDecoder(f, "CommitReq") }
func FuzzDecodeCommitResp(f *testing.F)       { fuzzDecoder(f, "CommitResp") }
func FuzzDecodeLookupReq(f *testing.F)        { fuzzDecoder(f, "LookupReq") }
func FuzzDecodeLookupResultReq(f *testing.F)  { fuzzDecoder(f, "LookupResultReq") }
func FuzzDecodeLookupResultResp(f *testing.F) { fuzzDecoder(f, "LookupResultResp") }
func FuzzDecodeFreeReq(f *testing.F)          { fuzzDecoder(f, "FreeReq") }
func FuzzDecodeRetrieveReq(f *testing.F)      { fuzzDecoder(f, "RetrieveReq") }
func FuzzDecodeRetrieveResp(f *testing.F)     { fuzzDecoder(f, "RetrieveResp") }
func FuzzDecodeReleaseReq(f *testing.F)       { fuzzDecoder(f, "ReleaseReq") }
func FuzzDecodeStatsResp(f *testing.F)        { fuzzDecoder(f, "StatsResp") }
func FuzzDecodeClearResp(f *testing.F)        { fuzzDecoder(f, "ClearResp") }
func FuzzDecodeHello(f *testing.F)            { fuzzDecoder(f, "Hello") }
func FuzzDecodeResetReq(f *testing.F)         { fuzzDecoder(f, "ResetReq") }
func FuzzDecodeResetResp(f *testing.F)        { fuzzDecoder(f, "ResetResp") }
func FuzzDecodeFrame(f *testing.F)            { fuzzDecoder(f, "FrameHeader") }

// Socket-level decoders (welcome, segment announcement, refusal).
func FuzzDecodeSocketMessages(f *testing.F) {
	w := welcome{Version: ProtocolVersion, Segments: 2, Session: 9, SQCap: 1 << 20, CQCap: 1 << 20}
	f.Add(w.append(nil))
	f.Add(appendSegmentMsg(nil, 3, 1<<30))
	f.Add(AppendError(putU32(nil, refuseVersion), "nope"))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, err := range []error{
			func() error { _, err := decodeWelcome(b); return err }(),
			func() error { _, _, err := decodeSegmentMsg(b); return err }(),
			func() error { _, err := DecodeError(b); return err }(),
		} {
			if err != nil && !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrVersion) {
				t.Fatalf("unwrapped error %v", err)
			}
		}
		_ = decodeRefuse(b)
	})
}

// The byte after a LOOKUP's MLA flag carries AnswerFinal (protocol 5) and
// nothing else; the two after it stay zero.
func TestDecodeLookupReqFlags(t *testing.T) {
	b, err := AppendLookupReq(nil, &LookupReq{LookupID: 7, WorldSize: 1, AnswerFinal: true, Hashes: make([]kv.Hash, 1)})
	assert.NilError(t, err)
	at := 8 + len(kv.Namespace{}) + 4 + 1
	assert.Equal(t, b[at], byte(1))
	r, err := DecodeLookupReq(b)
	assert.NilError(t, err)
	assert.Assert(t, r.AnswerFinal)
	for _, bad := range []struct {
		off int
		v   byte
	}{{at, 2}, {at, 0x81}, {at + 1, 1}, {at + 2, 1}} {
		c := append([]byte(nil), b...)
		c[bad.off] = bad.v
		_, err := DecodeLookupReq(c)
		assert.ErrorIs(t, err, ErrMalformed, "byte %d = %#x", bad.off, bad.v)
	}
}
