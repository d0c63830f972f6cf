package layout

import (
	"fmt"
	"strconv"
	"strings"
)

// Backend names the attention backend family that produced a KV tensor.
// The values are the strings the Python connector sends.
type Backend string

const (
	FlashAttn  Backend = "flash_attn"  // (2, blocks, block_size, heads, head)
	FlashInfer Backend = "flashinfer"  // (blocks, 2, block_size, heads, head)
	MLA        Backend = "mla"         // (blocks, block_size, head)
	CrossLayer Backend = "cross_layer" // (blocks, layers, 2, block_size, heads, head)
	// Paged is the per-layer view vLLM 0.33 hands every connector
	// (create_kv_cache_views in v1/kv_cache_interface.py): (blocks, heads,
	// block_size, content), where content is one token's K and V for one
	// head (head_size + head_size_v elements; MLA: the latent), strided in
	// the order of the resolved KVCacheLayout (LBNHC, BLHNC, ...).
	Paged Backend = "paged"
)

// Dim names one logical dimension of a KV tensor.
type Dim string

const (
	DimLayers    Dim = "layers"
	DimKV        Dim = "kv" // size 2: K and V
	DimBlocks    Dim = "blocks"
	DimBlockSize Dim = "block_size"
	DimHeads     Dim = "heads"
	DimHead      Dim = "head"
	// DimKernelBlocks counts the kernel blocks one block is split into
	// (vLLM's prepare_kernel_block_sizes: an attention backend that takes
	// smaller blocks than the scheduler's sees k kernel blocks per block,
	// in order). With it a block holds kernel_blocks × block_size tokens,
	// the block size the scheduler's block ids mean.
	DimKernelBlocks Dim = "kernel_blocks"
)

// DefaultDims returns the dimension names of the backend's logical shape,
// i.e. the order in which torch reports tensor.shape for that backend.
// Cross-layer tensors have no single logical order across vLLM versions, so
// for them the default is the physical order (blocks, layers, kv,
// block_size, heads, head); pass TensorDesc.Dims when the tensor arrives in
// another order (for example FlashAttention's (layers, kv, blocks, ...)).
func DefaultDims(b Backend, rank int) ([]Dim, bool) {
	switch {
	case b == FlashAttn && rank == 5:
		return []Dim{DimKV, DimBlocks, DimBlockSize, DimHeads, DimHead}, true
	case b == FlashInfer && rank == 5:
		return []Dim{DimBlocks, DimKV, DimBlockSize, DimHeads, DimHead}, true
	case b == MLA && rank == 3:
		return []Dim{DimBlocks, DimBlockSize, DimHead}, true
	case b == CrossLayer && rank == 6:
		return []Dim{DimBlocks, DimLayers, DimKV, DimBlockSize, DimHeads, DimHead}, true
	case b == CrossLayer && rank == 4: // MLA cross-layer
		return []Dim{DimBlocks, DimLayers, DimBlockSize, DimHead}, true
	case b == Paged && rank == 4: // head: the content dim (K and V)
		return []Dim{DimBlocks, DimHeads, DimBlockSize, DimHead}, true
	}
	return nil, false
}

// DeviceKind says where a tensor lives.
type DeviceKind uint8

const (
	CPU DeviceKind = iota + 1
	CUDA
)

// Device is a tensor's device: CPU, or CUDA with the ordinal torch reports
// (cuda:N, relative to CUDA_VISIBLE_DEVICES like the driver API's ordinal).
type Device struct {
	Kind  DeviceKind
	Index int
}

// ParseDevice parses torch's device string: "cpu", "cuda" (= cuda:0) or
// "cuda:N".
func ParseDevice(s string) (Device, error) {
	switch {
	case s == "cpu":
		return Device{Kind: CPU}, nil
	case s == "cuda":
		return Device{Kind: CUDA}, nil
	case strings.HasPrefix(s, "cuda:"):
		n, err := strconv.Atoi(s[len("cuda:"):])
		if err == nil && n >= 0 {
			return Device{Kind: CUDA, Index: n}, nil
		}
	}
	return Device{}, fmt.Errorf("%w: device %q is not cpu or cuda:N", ErrGeometry, s)
}

// MarshalText writes the torch device string.
func (d Device) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText reads a torch device string (see ParseDevice).
func (d *Device) UnmarshalText(b []byte) error {
	v, err := ParseDevice(string(b))
	if err == nil {
		*d = v
	}
	return err
}

func (d Device) String() string {
	switch d.Kind {
	case CPU:
		return "cpu"
	case CUDA:
		return fmt.Sprintf("cuda:%d", d.Index)
	}
	return fmt.Sprintf("device(%d):%d", d.Kind, d.Index)
}

// TensorDesc is what the Python connector reports for one registered KV
// tensor. Map from torch as:
//
//	Layer        layer name (register_kv_caches key; any name for cross-layer)
//	Group        KV-cache group id of the layer
//	Backend      paged | flash_attn | flashinfer | mla | cross_layer
//	Device       tensor.device (type, index)
//	DataPtr      tensor.data_ptr()   (storage offset already applied)
//	DTypeSize    tensor.element_size()
//	Shape        list(tensor.shape)
//	Strides      [s * tensor.element_size() for s in tensor.stride()]  (BYTES)
//	Dims         optional dimension names; nil = DefaultDims(Backend, rank)
//	StoragePtr   optional tensor.untyped_storage().data_ptr()
//	StorageBytes optional tensor.untyped_storage().nbytes(); 0 = unknown
//	BlockTokens  optional: the tokens one block stands for when its
//	             block_size dim (size 1) is a state, not tokens (a Mamba/SSM
//	             layer's page: one recurrent state per block)
//
// The JSON form (field names below) is what build/torch_geometry.py writes.
type TensorDesc struct {
	Layer        string  `json:"layer"`
	Group        int     `json:"group"`
	Backend      Backend `json:"backend"`
	Device       Device  `json:"device"`
	DataPtr      uint64  `json:"data_ptr"`
	DTypeSize    int     `json:"dtype_size"`
	Shape        []int64 `json:"shape"`
	Strides      []int64 `json:"stride_bytes"`
	Dims         []Dim   `json:"dims,omitempty"`
	StoragePtr   uint64  `json:"storage_ptr,omitempty"`
	StorageBytes uint64  `json:"storage_bytes,omitempty"`
	BlockTokens  int64   `json:"block_tokens,omitempty"`
}
