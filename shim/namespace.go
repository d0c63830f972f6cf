package shim

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvshim/kvshim/kv"
)

// ErrBadNamespaceSpec: a NamespaceSpec field is missing or out of range.
var ErrBadNamespaceSpec = errors.New("shim: bad namespace spec")

// namespaceTag and namespaceVersion head the canonical encoding (v1). Any
// change to the encoding below bumps the version and the golden vectors.
const (
	namespaceTag     = "kvshim.namespace"
	namespaceVersion = 1

	maxWorldSize = 1 << 16
	maxKVGroup   = 1 << 16
)

// NamespaceSpec is everything that makes the KV bytes of two deployments
// incompatible. Equal specs give equal namespaces on every machine; any
// differing field gives a different namespace, so mismatched deployments
// miss instead of reading each other's bytes. Strings are hashed as given:
// callers pass canonical values.
type NamespaceSpec struct {
	// Model identifies the weights: name plus revision (or resolved path
	// plus commit), not only the served alias. Required.
	Model string
	// DType is the KV cache dtype as vLLM names it after resolving "auto"
	// ("bfloat16", "fp8_e4m3", ...). Required.
	DType string
	// LayoutFingerprint describes one rank's KV bytes: attention backend,
	// per-rank block shape and stride order, block size, the layers this
	// rank holds. Required. For MLA it must not depend on the TP size (the
	// latent KV is not split across TP ranks), otherwise the MLA sharing
	// below is defeated.
	LayoutFingerprint string
	// ObjectFormat is the stored object's format version (header and body
	// order). Required, ≥ 1.
	ObjectFormat uint32
	// WorldSize is vLLM's world size (TP × PP), ≥ 1.
	WorldSize int
	// TPSize is the tensor-parallel size; 0 means WorldSize (no PP). It must
	// divide WorldSize.
	TPSize int
	// ChunkSize is the chunk size in tokens, 1..MaxChunkSize.
	ChunkSize int
	// KVGroup is the KV-cache group id (0 for a single-group model).
	KVGroup int
	// MLA: the model uses multi-head latent attention, whose KV cache is
	// identical on every TP rank.
	MLA bool
	// DCPSize is vLLM's decode context parallel size (0 or 1: none). The
	// TP ranks of a stage form groups of DCPSize consecutive ranks; within
	// a group each rank holds a slice of every block's tokens (vLLM's
	// scheduler blocks are DCPSize times the ranks' blocks), so a chunk is
	// ChunkSize/DCPSize tokens on each rank. It must divide TPSize and
	// ChunkSize.
	DCPSize int
}

// Validate reports the first missing or out-of-range field.
func (s NamespaceSpec) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrBadNamespaceSpec}, a...)...)
	}
	tp := s.tpSize()
	switch {
	case s.Model == "":
		return bad("model is empty")
	case s.DType == "":
		return bad("KV dtype is empty")
	case s.LayoutFingerprint == "":
		return bad("layout fingerprint is empty")
	case len(s.Model) > MaxFieldLen || len(s.DType) > MaxFieldLen || len(s.LayoutFingerprint) > MaxFieldLen:
		return bad("model, dtype or layout fingerprint longer than %d bytes", MaxFieldLen)
	case s.ObjectFormat == 0:
		return bad("object format version is 0 (unset)")
	case s.WorldSize < 1 || s.WorldSize > maxWorldSize:
		return bad("world size %d (want 1..%d)", s.WorldSize, maxWorldSize)
	case tp < 1 || s.WorldSize%tp != 0:
		return bad("TP size %d does not divide world size %d", s.TPSize, s.WorldSize)
	case s.ChunkSize < 1 || s.ChunkSize > MaxChunkSize:
		return bad("chunk size %d (want 1..%d)", s.ChunkSize, MaxChunkSize)
	case s.KVGroup < 0 || s.KVGroup >= maxKVGroup:
		return bad("KV group %d (want 0..%d)", s.KVGroup, maxKVGroup-1)
	case s.DCPSize < 0 || tp%s.dcp() != 0 || s.ChunkSize%s.dcp() != 0:
		return bad("DCP size %d does not divide TP size %d and chunk size %d", s.DCPSize, tp, s.ChunkSize)
	}
	return nil
}

func (s NamespaceSpec) dcp() int {
	if s.DCPSize < 1 {
		return 1
	}
	return s.DCPSize
}

// RankChunkTokens is how many tokens of a chunk one rank holds: ChunkSize,
// or ChunkSize/DCPSize under decode context parallelism.
func (s NamespaceSpec) RankChunkTokens() int { return s.ChunkSize / s.dcp() }

// SharedMLA reports whether every rank holds the same KV bytes, so that
// they are stored once and read by all: MLA (the latent KV is not split
// across TP ranks) with one pipeline stage and no decode context
// parallelism. Across stages (different layers) or DCP ranks (different
// tokens) MLA's KV differs per rank and every rank stores its own objects:
// the server's MLA lookup serves the rank-0 objects to every reader
// (server/lookup.go, lookup.ranks), so it cannot serve a second stage or
// token slice.
func (s NamespaceSpec) SharedMLA() bool {
	return s.MLA && s.WorldSize == s.tpSize() && s.dcp() == 1
}

func (s NamespaceSpec) tpSize() int {
	if s.TPSize == 0 {
		return s.WorldSize
	}
	return s.TPSize
}

// kvWorld is the (world, TP) shape of the distinct KV shards. Every rank
// holds a distinct shard, (WorldSize, TPSize), except under SharedMLA,
// where all ranks hold the same KV: (1, 1). MLA at TP=2 and TP=8 (one
// stage, no DCP) therefore share one namespace and one copy.
func (s NamespaceSpec) kvWorld() (world, tp int) {
	if s.SharedMLA() {
		return 1, 1
	}
	return s.WorldSize, s.tpSize()
}

// KVWorldSize is the number of distinct KV ranks under this spec: WorldSize,
// or 1 under SharedMLA. A chunk is fully stored when all
// KV ranks 0..KVWorldSize-1 hold it. It assumes a valid spec.
func (s NamespaceSpec) KVWorldSize() int {
	w, _ := s.kvWorld()
	return w
}

// KVRank maps a vLLM global rank (pp_rank × TPSize + tp_rank) to the rank in
// its objects' keys, and reports whether this rank writes them. Every rank
// writes its own, (rank, true), except under SharedMLA: all ranks share one
// object, (0, rank == 0), and every rank reads it.
func (s NamespaceSpec) KVRank(rank int) (kvRank uint32, writer bool, err error) {
	if err := s.Validate(); err != nil {
		return 0, false, err
	}
	if rank < 0 || rank >= s.WorldSize {
		return 0, false, fmt.Errorf("%w: rank %d outside world size %d", ErrBadNamespaceSpec, rank, s.WorldSize)
	}
	if !s.SharedMLA() {
		return uint32(rank), true, nil
	}
	return 0, rank == 0, nil
}

// Namespace validates s and returns its fingerprint: the first 16 bytes of
// SHA-256 over
//
//	"kvshim.namespace" ‖ u32 version ‖ lp(model) ‖ lp(dtype) ‖ lp(layout) ‖
//	u32 object format ‖ u32 kv world ‖ u32 kv tp ‖ u32 chunk size ‖
//	u32 kv group ‖ u8 mla [‖ u32 dcp size, only when > 1]
//
// (little-endian; lp(x) = u32 length ‖ x; kv world/tp as in KVWorldSize).
func (s NamespaceSpec) Namespace() (kv.Namespace, error) {
	if err := s.Validate(); err != nil {
		return kv.Namespace{}, err
	}
	world, tp := s.kvWorld()
	b := make([]byte, 0, 64+len(s.Model)+len(s.DType)+len(s.LayoutFingerprint))
	b = append(b, namespaceTag...)
	b = binary.LittleEndian.AppendUint32(b, namespaceVersion)
	b = appendField(b, s.Model)
	b = appendField(b, s.DType)
	b = appendField(b, s.LayoutFingerprint)
	b = binary.LittleEndian.AppendUint32(b, s.ObjectFormat)
	b = binary.LittleEndian.AppendUint32(b, uint32(world))
	b = binary.LittleEndian.AppendUint32(b, uint32(tp))
	b = binary.LittleEndian.AppendUint32(b, uint32(s.ChunkSize))
	b = binary.LittleEndian.AppendUint32(b, uint32(s.KVGroup))
	mla := byte(0)
	if s.MLA {
		mla = 1
	}
	b = append(b, mla)
	if s.dcp() > 1 {
		// Each rank holds a token slice of every block: other bytes than
		// the same TP shape without DCP.
		b = binary.LittleEndian.AppendUint32(b, uint32(s.dcp()))
	}
	sum := sha256.Sum256(b)
	var ns kv.Namespace
	copy(ns[:], sum[:])
	return ns, nil
}
