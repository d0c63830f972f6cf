package ipc

import "github.com/kvshim/kvshim/kv"

// The operator controls (vLLM's reset_prefix_cache) and what a lookup's
// answer says about where its chunks came from (vLLM's hit sources).
// Layouts (little-endian):
//
//	ResetReq   bump u8 pad[7] at_least u64 | n u32 | n×ns[16]
//	ResetResp  generation u64 objects u64 bytes u64
//	source run tier u8 chunks u32   (5 bytes; in LookupResultResp)

// Tier names the tier that served a chunk of a lookup's answer.
type Tier uint8

const (
	TierUnknown Tier = 0 // not said (an older server, a chunk FREEd while pending)
	TierL1      Tier = 1 // resident in the server's host memory when looked up
	TierDisk    Tier = 2 // filled from a local-disk L2 (fs)
	TierRemote  Tier = 3 // filled from a networked L2 (redis, mooncake_store, s3, plugins)
	numTiers         = 4
)

// SourceRun is a run of consecutive chunks of an answer served by one tier.
type SourceRun struct {
	Tier   Tier
	Chunks uint32
}

// ResetReq asks the server to make every chunk of Namespaces miss from
// now on (OpReset): with Bump the namespaces' generation moves past every
// one used before (and past AtLeast); without it the generation is only
// raised to AtLeast (a client that reset before this server started tells
// it so). The server answers with the generation now in force.
type ResetReq struct {
	Bump       bool
	AtLeast    uint64
	Namespaces []kv.Namespace
}

// ResetResp is the generation now in force (the largest over the request's
// namespaces) and the unheld L1 objects the reset dropped.
type ResetResp struct {
	Generation uint64
	Objects    uint64
	Bytes      uint64
}

// AppendResetReq encodes r.
func AppendResetReq(b []byte, r *ResetReq) ([]byte, error) {
	var bump uint8
	if r.Bump {
		bump = 1
	}
	b = append(b, bump, 0, 0, 0, 0, 0, 0, 0)
	b = putU64(b, r.AtLeast)
	b = putU32(b, uint32(len(r.Namespaces)))
	for i := range r.Namespaces {
		b = append(b, r.Namespaces[i][:]...)
	}
	return b, nil
}

// DecodeResetReq decodes a ResetReq.
func DecodeResetReq(b []byte) (*ResetReq, error) {
	d := newDec("reset request", b)
	r := &ResetReq{}
	switch bump := d.u8(); bump {
	case 0, 1:
		r.Bump = bump == 1
	default:
		d.fail("bump flag %d", bump)
	}
	if pad := d.take(7); pad != nil {
		for _, x := range pad {
			if x != 0 {
				d.fail("non-zero padding")
				break
			}
		}
	}
	r.AtLeast = d.u64()
	if n := d.count(kv.NamespaceSize); n > 0 {
		r.Namespaces = make([]kv.Namespace, n)
		for i := range r.Namespaces {
			d.fixed(r.Namespaces[i][:])
		}
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendResetResp encodes r.
func AppendResetResp(b []byte, r *ResetResp) ([]byte, error) {
	b = putU64(b, r.Generation)
	b = putU64(b, r.Objects)
	return putU64(b, r.Bytes), nil
}

// DecodeResetResp decodes a ResetResp.
func DecodeResetResp(b []byte) (*ResetResp, error) {
	d := newDec("reset response", b)
	r := &ResetResp{Generation: d.u64(), Objects: d.u64(), Bytes: d.u64()}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

const sourceRunLen = 5

func appendSources(b []byte, runs []SourceRun) []byte {
	b = putU32(b, uint32(len(runs)))
	for _, r := range runs {
		b = append(b, uint8(r.Tier))
		b = putU32(b, r.Chunks)
	}
	return b
}

func (d *dec) sources() []SourceRun {
	n := d.count(sourceRunLen)
	if n == 0 {
		return nil
	}
	runs := make([]SourceRun, n)
	for i := range runs {
		t := Tier(d.u8())
		if t >= numTiers {
			d.fail("tier %d", t)
		}
		runs[i] = SourceRun{Tier: t, Chunks: d.u32()}
	}
	return runs
}

// AddSource appends one chunk served by t to runs (merging it into the
// last run when the tier is the same).
func AddSource(runs []SourceRun, t Tier) []SourceRun {
	if n := len(runs); n > 0 && runs[n-1].Tier == t {
		runs[n-1].Chunks++
		return runs
	}
	return append(runs, SourceRun{Tier: t, Chunks: 1})
}
