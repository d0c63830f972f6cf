package shim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/kvshim/kvshim/layout"
)

// How each of vLLM's KV tensors lies in memory, decided from the tensor's
// raw facts and the KV-cache groups (kvshim_vllm_tensors): the KV-cache
// group of each layer, which layers that share one tensor are registered,
// the backend read from the shape, kernel-block splits and Mamba state
// views. python/kvshim/vllm/worker.py only copies each tensor's shape,
// strides, pointers and device and hands the answer to
// kvshim_worker_register. Each field is checked: a bad one is
// layout.ErrGeometry naming it, the error kvshim_worker_register gives for
// the same facts (both KVSHIM_EINVAL; Python's InvalidArgumentError, a
// ValueError as the connector's own checks were).

// VLLMTensor is one entry of register_kv_caches' dict as the connector
// copies it from torch.
type VLLMTensor struct {
	Layer        string  `json:"layer"`         // the dict's key
	Device       string  `json:"device"`        // str(t.device): cpu, cuda, cuda:N
	DataPtr      uint64  `json:"data_ptr"`      // t.data_ptr()
	DTypeSize    int     `json:"dtype_size"`    // t.element_size()
	Shape        []int64 `json:"shape"`         // list(t.shape)
	Strides      []int64 `json:"strides"`       // list(t.stride()): in elements, as torch has them
	StoragePtr   uint64  `json:"storage_ptr"`   // t.untyped_storage().data_ptr()
	StorageBytes uint64  `json:"storage_bytes"` // t.untyped_storage().nbytes()
}

// VLLMTensorsIn is what kvshim_vllm_tensors takes: the scheduler's block
// size (cache_config.block_size), kv_cache_config's groups (classes,
// layers and block_size are read; the other fields of VLLMGroup are
// accepted, so config.py's groups serve as they are) and the tensors in
// the dict's order.
type VLLMTensorsIn struct {
	BlockSize int          `json:"block_size"`
	Groups    []VLLMGroup  `json:"groups"`
	Tensors   []VLLMTensor `json:"tensors"`
}

func tensorsField(field, format string, a ...any) error {
	return fmt.Errorf("%w: %s: %s", layout.ErrGeometry, field, fmt.Sprintf(format, a...))
}

// ParseVLLMTensors decodes kvshim_vllm_tensors' JSON strictly (unknown
// fields refused, each group and tensor named by its index) and decides
// the descriptors (VLLMTensors).
func ParseVLLMTensors(doc []byte) ([]layout.TensorDesc, error) {
	var top struct {
		BlockSize int               `json:"block_size"`
		Groups    []json.RawMessage `json:"groups"`
		Tensors   []json.RawMessage `json:"tensors"`
	}
	if err := strictJSON(doc, &top); err != nil {
		return nil, fmt.Errorf("%w: vLLM tensors: %w", layout.ErrGeometry, err)
	}
	in := VLLMTensorsIn{BlockSize: top.BlockSize, Groups: make([]VLLMGroup, len(top.Groups)),
		Tensors: make([]VLLMTensor, len(top.Tensors))}
	for i, raw := range top.Groups {
		if err := strictJSON(raw, &in.Groups[i]); err != nil {
			return nil, tensorsField(fmt.Sprintf("groups[%d]", i), "%v", err)
		}
	}
	for i, raw := range top.Tensors {
		if err := strictJSON(raw, &in.Tensors[i]); err != nil {
			return nil, tensorsField(fmt.Sprintf("tensors[%d]", i), "%v", err)
		}
	}
	return VLLMTensors(in)
}

// strictJSON decodes one JSON value into v: unknown fields and anything
// after the value refused. (A null value leaves v as it is, as
// encoding/json does.)
func strictJSON(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("data after the JSON value")
	}
	return nil
}

// vllmLayer is what the groups say of one layer.
type vllmLayer struct {
	group     int
	blockSize int  // the group's block_size (0: the scheduler's)
	state     bool // a Mamba/SSM state group
}

// VLLMTensors decides the descriptors kvshim_worker_register takes for
// vLLM's KV tensors, as worker.py's register_kv_caches did before it moved
// here (same order, same choices).
func VLLMTensors(in VLLMTensorsIn) ([]layout.TensorDesc, error) {
	if in.BlockSize < 1 {
		return nil, tensorsField("block_size", "%d (want > 0)", in.BlockSize)
	}
	of := map[string]vllmLayer{}
	for i, g := range in.Groups {
		if len(g.Classes) == 0 {
			return nil, tensorsField(fmt.Sprintf("groups[%d].classes", i), "empty")
		}
		if g.BlockSize < 0 {
			return nil, tensorsField(fmt.Sprintf("groups[%d].block_size", i), "%d (want >= 0)", g.BlockSize)
		}
		for j, name := range g.Layers {
			// vLLM puts each layer in one group; a layer in two would
			// have its blocks indexed by two block tables.
			if w, ok := of[name]; ok && w.group != i {
				return nil, tensorsField(fmt.Sprintf("groups[%d].layers[%d]", i, j), "layer %q is in group %d too", name, w.group)
			}
			of[name] = vllmLayer{group: i, blockSize: g.BlockSize, state: g.is("MambaSpec")}
		}
	}
	in.Tensors = slices.Clone(in.Tensors) // devices rewritten below, not the caller's
	layers := make(map[string]bool, len(in.Tensors))
	for i := range in.Tensors {
		if err := checkVLLMTensor(i, &in.Tensors[i], layers); err != nil {
			return nil, err
		}
	}
	// Layers of a group first: with several KV-cache groups, the i-th
	// layers of all groups view one tensor (vLLM's hybrid allocator), and
	// each group copies its blocks through its own layers. A layer in no
	// group reads another's KV (KV sharing): copied once, with it. Within
	// each part the dict's order (Python's stable sort did the same).
	order := make([]int, 0, len(in.Tensors))
	for pass := range 2 {
		for i, t := range in.Tensors {
			if _, grouped := of[t.Layer]; grouped == (pass == 0) {
				order = append(order, i)
			}
		}
	}
	type seenKey struct {
		group int // -1: in no group
		ptr   uint64
	}
	seen, seenPtr := map[seenKey]bool{}, map[uint64]bool{}
	out := make([]layout.TensorDesc, 0, len(in.Tensors))
	for _, i := range order {
		t := &in.Tensors[i]
		w, grouped := of[t.Layer]
		g := -1
		if grouped {
			g = w.group
		}
		// Layers that share one KV tensor (KV sharing) are copied once:
		// per group, and a layer in no group not at all when a registered
		// layer has its tensor.
		if seen[seenKey{g, t.DataPtr}] || !grouped && seenPtr[t.DataPtr] {
			continue
		}
		seen[seenKey{g, t.DataPtr}], seenPtr[t.DataPtr] = true, true
		blockSize := in.BlockSize
		if grouped && w.blockSize > 0 {
			blockSize = w.blockSize
		}
		var (
			d   layout.TensorDesc
			err error
		)
		switch {
		case grouped && w.state:
			d, err = stateDesc(i, t, blockSize)
		case len(t.Shape) == 4 && t.Shape[2] != int64(blockSize):
			d, err = kernelSplitDesc(i, t, blockSize)
		default:
			d, err = tensorDesc(i, t, t.Shape, t.Strides)
		}
		if err != nil {
			return nil, err
		}
		d.Group = max(g, 0)
		out = append(out, d)
	}
	return out, nil
}

// checkVLLMTensor checks t's fields (layers: the names seen so far) and
// writes its device as kvshim_worker_register reads it.
func checkVLLMTensor(i int, t *VLLMTensor, layers map[string]bool) error {
	field := func(name string) string { return fmt.Sprintf("tensors[%d].%s", i, name) }
	switch {
	case t.Layer == "":
		return tensorsField(field("layer"), "empty")
	case layers[t.Layer]:
		return tensorsField(field("layer"), "%q twice", t.Layer)
	case t.DTypeSize < 1:
		return tensorsField(field("dtype_size"), "%d (want > 0)", t.DTypeSize)
	case len(t.Strides) != len(t.Shape):
		return tensorsField(field("strides"), "%d strides for %d dims", len(t.Strides), len(t.Shape))
	}
	layers[t.Layer] = true
	dev := t.Device
	if dev == "cuda" { // str() of a torch device with no index; the connector wrote cuda:0 (index or 0)
		dev = "cuda:0"
	}
	if _, err := layout.ParseDevice(dev); err != nil {
		return tensorsField(field("device"), "%q is not cpu, cuda or cuda:N", t.Device)
	}
	t.Device = dev
	for j, n := range t.Shape {
		if n < 0 {
			return tensorsField(field("shape"), "dim %d has size %d", j, n)
		}
	}
	for j, s := range t.Strides {
		if _, ok := mulInt64(s, int64(t.DTypeSize)); !ok {
			return tensorsField(field("strides"), "stride %d of dim %d overflows in bytes", s, j)
		}
	}
	return nil
}

// mulInt64 is a*b, and false when it overflows int64.
func mulInt64(a, b int64) (int64, bool) {
	c := a * b
	if a != 0 && (c/a != b || a == -1 && b == math.MinInt64) {
		return 0, false
	}
	return c, true
}

// pyList writes a shape as Python prints a list of ints.
func pyList(xs []int64) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.FormatInt(x, 10)
	}
	return "[" + strings.Join(s, ", ") + "]"
}

// tensorDesc is the descriptor of t seen with shape and strides (in
// elements): the backend read from the shape.
func tensorDesc(i int, t *VLLMTensor, shape, strides []int64) (layout.TensorDesc, error) {
	var backend layout.Backend
	switch {
	case len(shape) == 4:
		// vLLM >= 0.33: (blocks, heads, block_size, K|V content), any stride order
		backend = layout.Paged
	case len(shape) == 3:
		backend = layout.MLA
	case len(shape) == 5 && shape[0] == 2:
		backend = layout.FlashAttn
	case len(shape) == 5 && shape[1] == 2:
		backend = layout.FlashInfer
	default:
		return layout.TensorDesc{}, tensorsField(fmt.Sprintf("tensors[%d].shape", i),
			"KV tensor %q: unsupported shape %s (want vLLM 0.33's (blocks, heads, block_size, content) view, FlashAttention, FlashInfer or MLA)",
			t.Layer, pyList(shape))
	}
	dev, _ := layout.ParseDevice(t.Device) // checked (checkVLLMTensor)
	esize := int64(t.DTypeSize)
	sb := make([]int64, len(strides))
	for j, s := range strides {
		sb[j] = s * esize // no overflow: checked (checkVLLMTensor, kernelSplitDesc)
	}
	return layout.TensorDesc{
		Layer: t.Layer, Backend: backend, Device: dev, DataPtr: t.DataPtr, DTypeSize: t.DTypeSize,
		Shape: append([]int64(nil), shape...), Strides: sb, StoragePtr: t.StoragePtr, StorageBytes: t.StorageBytes,
	}, nil
}

// kernelSplitDesc is the descriptor of a (blocks, heads, kernel block,
// content) view whose blocks vLLM split into kernel blocks (v1/worker/
// utils.py prepare_kernel_block_sizes and allocate_kv_cache: dim 0 counts
// kernel blocks, k of them per block, in order), in the whole blocks the
// scheduler's block ids index. When a kernel block's tokens continue
// where the previous one's end (token-major per-layer pages: LBNHC), the
// same memory is a (blocks, heads, block_size, content) view: one run of
// tokens a block. Otherwise (heads outside the tokens: LBHNC, ...) a
// kernel_blocks dimension says that a block is k kernel blocks
// (layout.DimKernelBlocks).
func kernelSplitDesc(i int, t *VLLMTensor, blockSize int) (layout.TensorDesc, error) {
	bs, kbs := int64(blockSize), t.Shape[2]
	if kbs <= 0 || bs%kbs != 0 || t.Shape[0]%(bs/kbs) != 0 {
		return layout.TensorDesc{}, tensorsField(fmt.Sprintf("tensors[%d].shape", i),
			"KV tensor %q: kernel blocks of %d tokens do not divide vLLM's %d-token blocks", t.Layer, kbs, bs)
	}
	k := bs / kbs
	s0, s1, s2, s3 := t.Strides[0], t.Strides[1], t.Strides[2], t.Strides[3]
	ks0, ok := mulInt64(k, s0)
	if ok {
		_, ok = mulInt64(ks0, int64(t.DTypeSize))
	}
	if !ok {
		return layout.TensorDesc{}, tensorsField(fmt.Sprintf("tensors[%d].strides", i),
			"KV tensor %q: a block's stride (%d kernel blocks of stride %d) overflows", t.Layer, k, s0)
	}
	if kbs2, ok := mulInt64(kbs, s2); ok && s0 == kbs2 {
		// torch's t.as_strided((blocks/k, heads, block_size, content), (k*s0, s1, s2, s3))
		return tensorDesc(i, t, []int64{t.Shape[0] / k, t.Shape[1], bs, t.Shape[3]}, []int64{ks0, s1, s2, s3})
	}
	d, err := tensorDesc(i, t, t.Shape, t.Strides)
	if err != nil {
		return d, err
	}
	esize := int64(t.DTypeSize)
	d.Shape = []int64{t.Shape[0] / k, k, t.Shape[1], kbs, t.Shape[3]}
	d.Strides = []int64{ks0 * esize, s0 * esize, s1 * esize, s2 * esize, s3 * esize}
	d.Dims = []layout.Dim{layout.DimBlocks, layout.DimKernelBlocks, layout.DimHeads, layout.DimBlockSize, layout.DimHead}
	return d, nil
}

// stateDesc is the descriptor of a Mamba/SSM layer's page view: vLLM 0.33
// views it as (blocks, num_heads, states, state bytes) int8
// (kv_cache_interface.py create_kv_cache_views and
// compute_layer_kv_cache_shape_bytes: one state a block, page_size_padded
// left outside the view). The block still stands for block_size tokens of
// the block table (layout.TensorDesc BlockTokens): kvshim copies the whole
// state.
func stateDesc(i int, t *VLLMTensor, blockSize int) (layout.TensorDesc, error) {
	if len(t.Shape) != 4 || t.Shape[2] != 1 {
		return layout.TensorDesc{}, tensorsField(fmt.Sprintf("tensors[%d].shape", i),
			"Mamba state tensor %q: shape %s, want vLLM 0.33's (blocks, heads, 1, state bytes) view", t.Layer, pyList(t.Shape))
	}
	d, err := tensorDesc(i, t, t.Shape, t.Strides)
	if err == nil {
		d.BlockTokens = int64(blockSize)
	}
	return d, err
}
