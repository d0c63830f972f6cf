package shim

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvshim/kvshim/ipc"
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
	}
	return nil
}

func (s NamespaceSpec) tpSize() int {
	if s.TPSize == 0 {
		return s.WorldSize
	}
	return s.TPSize
}

// kvWorld is the (world, TP) shape of the distinct KV shards. Without MLA
// every rank holds a distinct shard: (WorldSize, TPSize). With MLA the TP
// ranks of one pipeline stage hold identical KV, so only the stages are
// distinct: (WorldSize/TPSize, 1) — LMCache's world_size // tp_size. MLA at
// TP=2 and TP=8 (same PP) therefore share one namespace and one copy.
func (s NamespaceSpec) kvWorld() (world, tp int) {
	if s.MLA {
		return s.WorldSize / s.tpSize(), 1
	}
	return s.WorldSize, s.tpSize()
}

// KVWorldSize is the number of distinct KV ranks under this spec: WorldSize,
// or the number of pipeline stages for MLA. A chunk is fully stored when all
// KV ranks 0..KVWorldSize-1 hold it. It assumes a valid spec.
func (s NamespaceSpec) KVWorldSize() int {
	w, _ := s.kvWorld()
	return w
}

// KVRank maps a vLLM global rank (pp_rank × TPSize + tp_rank) to the rank in
// its objects' keys, and reports whether this rank writes them. Without MLA
// every rank writes its own: (rank, true). With MLA the TP ranks of a stage
// share one object: (rank / TPSize, tp_rank == 0); every rank reads it.
func (s NamespaceSpec) KVRank(rank int) (kvRank uint32, writer bool, err error) {
	if err := s.Validate(); err != nil {
		return 0, false, err
	}
	if rank < 0 || rank >= s.WorldSize {
		return 0, false, fmt.Errorf("%w: rank %d outside world size %d", ErrBadNamespaceSpec, rank, s.WorldSize)
	}
	if !s.MLA {
		return uint32(rank), true, nil
	}
	tp := s.tpSize()
	return uint32(rank / tp), rank%tp == 0, nil
}

// Namespace validates s and returns its fingerprint: the first 16 bytes of
// SHA-256 over
//
//	"kvshim.namespace" ‖ u32 version ‖ lp(model) ‖ lp(dtype) ‖ lp(layout) ‖
//	u32 object format ‖ u32 kv world ‖ u32 kv tp ‖ u32 chunk size ‖
//	u32 kv group ‖ u8 mla
//
// (little-endian; lp(x) = u32 length ‖ x; kv world/tp as in KVWorldSize).
func (s NamespaceSpec) Namespace() (ipc.Namespace, error) {
	if err := s.Validate(); err != nil {
		return ipc.Namespace{}, err
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
	sum := sha256.Sum256(b)
	var ns ipc.Namespace
	copy(ns[:], sum[:])
	return ns, nil
}
