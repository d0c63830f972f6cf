package ipc

import (
	"slices"

	"github.com/kvshim/kvshim/kv"
)

// Bodies of every request and response in msg.go. Layouts (little-endian):
//
//	AllocReq         tag[16] ns[16] rank u32 | n u32 | n×hash[32] | n×size u64
//	AllocResp        n u32 | n×status i32 | n×loc
//	CommitReq        tag[16] ns[16] rank u32 | n u32 | n×hash[32]   (COMMIT, ABORT)
//	CommitResp       n u32 | n×status i32
//	LookupReq        id u64 ns[16] world u32 mla u8 pad[3] | n u32 | n×hash[32]
//	LookupResultReq  id u64
//	LookupResultResp status i32 chunks u32 generation u64 | n u32 | n×source run (controls.go)
//	FreeReq          id u64 start u32 end u32
//	RetrieveReq      owner[16] id u64 rank u32 start u32 end u32
//	RetrieveResp     n u32 | n×status i32 | n×loc
//	ReleaseReq       owner[16] id u64 rank u32
//	StatsResp        n u32 | n×(len u16 name f64)
//	ClearResp        objects u64 bytes u64
//	loc              segment u32 offset u64 size u64   (20 bytes)
//
// LOOKUP, FREE, RELEASE answer with an empty body; STATS, CLEAR and PING
// requests have an empty body. Counts are ≤ MaxKeys; decoders reject
// trailing bytes.

const locLen = 20

func appendLoc(b []byte, l Loc) []byte {
	b = putU32(b, l.Segment)
	b = putU64(b, l.Offset)
	return putU64(b, l.Size)
}

func appendHashes(b []byte, hs []kv.Hash) []byte {
	b = slices.Grow(b, 4+len(hs)*kv.HashSize)
	b = putU32(b, uint32(len(hs)))
	for i := range hs {
		b = append(b, hs[i][:]...)
	}
	return b
}

func (d *dec) hashes() []kv.Hash {
	n := d.count(kv.HashSize)
	if d.err != nil {
		return nil
	}
	return d.hashArray(n)
}

// hashArray reads n hashes (n already checked against the remaining bytes).
func (d *dec) hashArray(n int) []kv.Hash {
	raw := d.take(n * kv.HashSize)
	if raw == nil {
		return nil
	}
	hs := make([]kv.Hash, n)
	for i := range hs {
		copy(hs[i][:], raw[i*kv.HashSize:])
	}
	return hs
}

func appendStatusLocs(what string, b []byte, st []Status, locs []Loc) ([]byte, error) {
	if err := checkCount(what, len(st)); err != nil {
		return b, err
	}
	if len(locs) != len(st) {
		return b, encErr(what, "%d statuses but %d locs", len(st), len(locs))
	}
	b = slices.Grow(b, 4+len(st)*(4+locLen))
	b = putU32(b, uint32(len(st)))
	for _, s := range st {
		b = putU32(b, uint32(s))
	}
	for _, l := range locs {
		b = appendLoc(b, l)
	}
	return b, nil
}

func (d *dec) statusLocs() ([]Status, []Loc) {
	n := d.count(4 + locLen)
	if d.err != nil {
		return nil, nil
	}
	raw := d.take(n * (4 + locLen)) // one bounds check for the whole array
	if raw == nil {
		return nil, nil
	}
	st := make([]Status, n)
	for i := range st {
		st[i] = Status(le.Uint32(raw[4*i:]))
	}
	raw = raw[4*n:]
	locs := make([]Loc, n)
	for i := range locs {
		e := raw[i*locLen : (i+1)*locLen]
		locs[i] = Loc{Segment: le.Uint32(e), Offset: le.Uint64(e[4:]), Size: le.Uint64(e[12:])}
	}
	return st, locs
}

// AppendAllocReq encodes r.
func AppendAllocReq(b []byte, r *AllocReq) ([]byte, error) {
	if err := checkCount("alloc", len(r.Hashes)); err != nil {
		return b, err
	}
	if len(r.Sizes) != len(r.Hashes) {
		return b, encErr("alloc", "%d hashes but %d sizes", len(r.Hashes), len(r.Sizes))
	}
	b = slices.Grow(b, 40+len(r.Hashes)*(kv.HashSize+8))
	b = append(b, r.Tag[:]...)
	b = append(b, r.Namespace[:]...)
	b = putU32(b, r.Rank)
	b = appendHashes(b, r.Hashes)
	for _, s := range r.Sizes {
		b = putU64(b, s)
	}
	return b, nil
}

// DecodeAllocReq decodes an AllocReq.
func DecodeAllocReq(b []byte) (*AllocReq, error) {
	d := newDec("alloc request", b)
	r := &AllocReq{}
	d.fixed(r.Tag[:])
	d.fixed(r.Namespace[:])
	r.Rank = d.u32()
	n := d.count(kv.HashSize + 8)
	if d.err == nil {
		r.Hashes = d.hashArray(n)
		if raw := d.take(8 * n); raw != nil {
			r.Sizes = make([]uint64, n)
			for i := range r.Sizes {
				r.Sizes[i] = le.Uint64(raw[8*i:])
			}
		}
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendAllocResp encodes r.
func AppendAllocResp(b []byte, r *AllocResp) ([]byte, error) {
	return appendStatusLocs("alloc response", b, r.Status, r.Locs)
}

// DecodeAllocResp decodes an AllocResp.
func DecodeAllocResp(b []byte) (*AllocResp, error) {
	d := newDec("alloc response", b)
	st, locs := d.statusLocs()
	if err := d.done(); err != nil {
		return nil, err
	}
	return &AllocResp{Status: st, Locs: locs}, nil
}

// AppendCommitReq encodes r (COMMIT and ABORT).
func AppendCommitReq(b []byte, r *CommitReq) ([]byte, error) {
	if err := checkCount("commit", len(r.Hashes)); err != nil {
		return b, err
	}
	b = append(b, r.Tag[:]...)
	b = append(b, r.Namespace[:]...)
	b = putU32(b, r.Rank)
	return appendHashes(b, r.Hashes), nil
}

// DecodeCommitReq decodes a CommitReq.
func DecodeCommitReq(b []byte) (*CommitReq, error) {
	d := newDec("commit request", b)
	r := &CommitReq{}
	d.fixed(r.Tag[:])
	d.fixed(r.Namespace[:])
	r.Rank = d.u32()
	r.Hashes = d.hashes()
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendCommitResp encodes r.
func AppendCommitResp(b []byte, r *CommitResp) ([]byte, error) {
	if err := checkCount("commit response", len(r.Status)); err != nil {
		return b, err
	}
	b = putU32(b, uint32(len(r.Status)))
	for _, s := range r.Status {
		b = putU32(b, uint32(s))
	}
	return b, nil
}

// DecodeCommitResp decodes a CommitResp.
func DecodeCommitResp(b []byte) (*CommitResp, error) {
	d := newDec("commit response", b)
	n := d.count(4)
	r := &CommitResp{}
	if d.err == nil {
		if raw := d.take(4 * n); raw != nil {
			r.Status = make([]Status, n)
			for i := range r.Status {
				r.Status[i] = Status(le.Uint32(raw[4*i:]))
			}
		}
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendLookupReq encodes r.
func AppendLookupReq(b []byte, r *LookupReq) ([]byte, error) {
	if err := checkCount("lookup", len(r.Hashes)); err != nil {
		return b, err
	}
	b = putU64(b, r.LookupID)
	b = append(b, r.Namespace[:]...)
	b = putU32(b, r.WorldSize)
	var mla, flags byte
	if r.MLA {
		mla = 1
	}
	if r.AnswerFinal {
		flags |= lookupAnswerFinal
	}
	b = append(b, mla, flags, 0, 0)
	return appendHashes(b, r.Hashes), nil
}

// lookupAnswerFinal is LookupReq.AnswerFinal in the byte after the MLA flag.
const lookupAnswerFinal = 1

// DecodeLookupReq decodes a LookupReq.
func DecodeLookupReq(b []byte) (*LookupReq, error) {
	d := newDec("lookup request", b)
	r := &LookupReq{LookupID: d.u64()}
	d.fixed(r.Namespace[:])
	r.WorldSize = d.u32()
	switch mla := d.u8(); mla {
	case 0, 1:
		r.MLA = mla == 1
	default:
		d.fail("mla flag %d", mla)
	}
	if pad := d.take(3); pad != nil {
		if pad[0]&^lookupAnswerFinal != 0 {
			d.fail("lookup flags %#x", pad[0])
		}
		r.AnswerFinal = pad[0]&lookupAnswerFinal != 0
		if pad[1]|pad[2] != 0 {
			d.fail("non-zero padding")
		}
	}
	r.Hashes = d.hashes()
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendLookupResultReq encodes r.
func AppendLookupResultReq(b []byte, r *LookupResultReq) ([]byte, error) {
	return putU64(b, r.LookupID), nil
}

// DecodeLookupResultReq decodes a LookupResultReq.
func DecodeLookupResultReq(b []byte) (*LookupResultReq, error) {
	d := newDec("lookup result request", b)
	r := &LookupResultReq{LookupID: d.u64()}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendLookupResultResp encodes r.
func AppendLookupResultResp(b []byte, r *LookupResultResp) ([]byte, error) {
	b = putU32(b, uint32(r.Status))
	b = putU32(b, r.Chunks)
	b = putU64(b, r.Generation)
	return appendSources(b, r.Sources), nil
}

// DecodeLookupResultResp decodes a LookupResultResp.
func DecodeLookupResultResp(b []byte) (*LookupResultResp, error) {
	d := newDec("lookup result response", b)
	r := &LookupResultResp{Status: Status(d.u32()), Chunks: d.u32(), Generation: d.u64()}
	r.Sources = d.sources()
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendFreeReq encodes r.
func AppendFreeReq(b []byte, r *FreeReq) ([]byte, error) {
	b = putU64(b, r.LookupID)
	b = putU32(b, r.Start)
	return putU32(b, r.End), nil
}

// DecodeFreeReq decodes a FreeReq.
func DecodeFreeReq(b []byte) (*FreeReq, error) {
	d := newDec("free request", b)
	r := &FreeReq{LookupID: d.u64(), Start: d.u32(), End: d.u32()}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendRetrieveReq encodes r.
func AppendRetrieveReq(b []byte, r *RetrieveReq) ([]byte, error) {
	b = append(b, r.Owner[:]...)
	b = putU64(b, r.LookupID)
	b = putU32(b, r.Rank)
	b = putU32(b, r.Start)
	return putU32(b, r.End), nil
}

// DecodeRetrieveReq decodes a RetrieveReq.
func DecodeRetrieveReq(b []byte) (*RetrieveReq, error) {
	d := newDec("retrieve request", b)
	r := &RetrieveReq{}
	d.fixed(r.Owner[:])
	r.LookupID, r.Rank, r.Start, r.End = d.u64(), d.u32(), d.u32(), d.u32()
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendRetrieveResp encodes r.
func AppendRetrieveResp(b []byte, r *RetrieveResp) ([]byte, error) {
	return appendStatusLocs("retrieve response", b, r.Status, r.Locs)
}

// DecodeRetrieveResp decodes a RetrieveResp.
func DecodeRetrieveResp(b []byte) (*RetrieveResp, error) {
	d := newDec("retrieve response", b)
	st, locs := d.statusLocs()
	if err := d.done(); err != nil {
		return nil, err
	}
	return &RetrieveResp{Status: st, Locs: locs}, nil
}

// AppendReleaseReq encodes r.
func AppendReleaseReq(b []byte, r *ReleaseReq) ([]byte, error) {
	b = append(b, r.Owner[:]...)
	b = putU64(b, r.LookupID)
	return putU32(b, r.Rank), nil
}

// DecodeReleaseReq decodes a ReleaseReq.
func DecodeReleaseReq(b []byte) (*ReleaseReq, error) {
	d := newDec("release request", b)
	r := &ReleaseReq{}
	d.fixed(r.Owner[:])
	r.LookupID, r.Rank = d.u64(), d.u32()
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendStatsResp encodes r.
func AppendStatsResp(b []byte, r *StatsResp) ([]byte, error) {
	if err := checkCount("stats", len(r.Stats)); err != nil {
		return b, err
	}
	b = putU32(b, uint32(len(r.Stats)))
	for _, s := range r.Stats {
		if len(s.Name) > MaxStatName {
			return b, encErr("stats", "name %q longer than %d", s.Name[:32], MaxStatName)
		}
		b = putU16(b, uint16(len(s.Name)))
		b = append(b, s.Name...)
		b = putF64(b, s.Value)
	}
	return b, nil
}

// DecodeStatsResp decodes a StatsResp.
func DecodeStatsResp(b []byte) (*StatsResp, error) {
	d := newDec("stats response", b)
	n := d.count(2 + 8)
	r := &StatsResp{}
	if d.err == nil {
		r.Stats = make([]Stat, n)
		for i := range r.Stats {
			l := int(d.u16())
			if l > MaxStatName {
				d.fail("stat name length %d exceeds %d", l, MaxStatName)
				break
			}
			r.Stats[i] = Stat{Name: string(d.take(l)), Value: d.f64()}
		}
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendClearResp encodes r.
func AppendClearResp(b []byte, r *ClearResp) ([]byte, error) {
	b = putU64(b, r.Objects)
	return putU64(b, r.Bytes), nil
}

// DecodeClearResp decodes a ClearResp.
func DecodeClearResp(b []byte) (*ClearResp, error) {
	d := newDec("clear response", b)
	r := &ClearResp{Objects: d.u64(), Bytes: d.u64()}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// DecodeEmpty checks that a body that must be empty is.
func DecodeEmpty(what string, b []byte) error {
	return newDec(what, b).done()
}
