package layout

import (
	"math/bits"
	"sort"
)

// maxRuns bounds the number of contiguous runs one block of one tensor may
// split into; more means a layout we do not want to copy piecewise.
const maxRuns = 4096

// tensor is the validated geometry of one KV tensor.
type tensor struct {
	name        string
	base        uint64   // address of element 0
	extent      uint64   // bytes from base to one past the last element
	numBlocks   int64    // size of the blocks dim
	blockSize   int64    // tokens per block
	blockStride uint64   // bytes between consecutive blocks (0 if numBlocks == 1)
	runLen      uint64   // bytes in one contiguous run
	runs        []uint64 // run offsets inside a block, ascending
	sig         []byte   // canonical description for the fingerprint
}

// blockBytes is how many bytes one block of this tensor holds.
func (t *tensor) blockBytes() uint64 { return t.runLen * uint64(len(t.runs)) }

type dimInfo struct {
	name   Dim
	size   int64
	stride int64
}

var requiredDims = map[Backend][]Dim{
	FlashAttn:  {DimKV, DimBlocks, DimBlockSize, DimHeads, DimHead},
	FlashInfer: {DimKV, DimBlocks, DimBlockSize, DimHeads, DimHead},
	MLA:        {DimBlocks, DimBlockSize, DimHead},
	CrossLayer: {DimBlocks, DimLayers, DimBlockSize, DimHead},
	Paged:      {DimBlocks, DimHeads, DimBlockSize, DimHead},
}

var knownDims = map[Dim]bool{DimLayers: true, DimKV: true, DimBlocks: true,
	DimBlockSize: true, DimHeads: true, DimHead: true, DimKernelBlocks: true}

// analyze validates one descriptor and derives its per-block runs.
func analyze(d *TensorDesc) (*tensor, error) {
	name := d.Layer
	req, ok := requiredDims[d.Backend]
	if !ok {
		return nil, geomErr(name, "backend", "unsupported backend %q", d.Backend)
	}
	switch d.DTypeSize {
	case 1, 2, 4, 8:
	default:
		return nil, geomErr(name, "dtype_size", "%d is not 1, 2, 4 or 8", d.DTypeSize)
	}
	if d.DataPtr == 0 {
		return nil, geomErr(name, "data_ptr", "null")
	}
	if d.Device.Kind != CPU && d.Device.Kind != CUDA || d.Device.Index < 0 {
		return nil, geomErr(name, "device", "unsupported device %v", d.Device)
	}
	if len(d.Shape) != len(d.Strides) {
		return nil, geomErr(name, "strides", "rank %d != shape rank %d", len(d.Strides), len(d.Shape))
	}
	names := d.Dims
	if names == nil {
		names, ok = DefaultDims(d.Backend, len(d.Shape))
		if !ok {
			return nil, geomErr(name, "shape", "rank %d unsupported for backend %s", len(d.Shape), d.Backend)
		}
	}
	if len(names) != len(d.Shape) {
		return nil, geomErr(name, "dims", "%d names for rank %d", len(names), len(d.Shape))
	}
	dt := int64(d.DTypeSize)
	dims := make([]dimInfo, len(names))
	byName := map[Dim]int{}
	for i, n := range names {
		if !knownDims[n] {
			return nil, geomErr(name, "dims", "unknown dim %q", n)
		}
		if _, dup := byName[n]; dup {
			return nil, geomErr(name, "dims", "dim %q named twice", n)
		}
		byName[n] = i
		if d.Shape[i] <= 0 {
			return nil, geomErr(name, "shape["+string(n)+"]", "non-positive size %d", d.Shape[i])
		}
		if d.Shape[i] > 1 && d.Strides[i] <= 0 {
			return nil, geomErr(name, "strides["+string(n)+"]", "non-positive stride %d", d.Strides[i])
		}
		if d.Strides[i]%dt != 0 {
			return nil, geomErr(name, "strides["+string(n)+"]", "stride %d not a multiple of dtype size %d", d.Strides[i], dt)
		}
		dims[i] = dimInfo{n, d.Shape[i], d.Strides[i]}
	}
	for _, r := range req {
		if _, ok := byName[r]; !ok {
			return nil, geomErr(name, "dims", "backend %s needs dim %q", d.Backend, r)
		}
	}
	if i, ok := byName[DimKV]; ok && dims[i].size != 2 {
		return nil, geomErr(name, "shape[kv]", "size %d, want 2", dims[i].size)
	}
	if d.Backend != CrossLayer {
		if _, ok := byName[DimLayers]; ok {
			return nil, geomErr(name, "dims", "backend %s has no layers dim", d.Backend)
		}
	}

	// Overlap: with dims (size > 1) sorted by stride, each stride must clear
	// the span of all smaller dims; then distinct indices never alias.
	sorted := make([]dimInfo, 0, len(dims))
	for _, di := range dims {
		if di.size > 1 {
			sorted = append(sorted, di)
		}
	}
	sort.SliceStable(sorted, func(a, b int) bool { return sorted[a].stride < sorted[b].stride })
	extent := uint64(dt)
	for _, di := range sorted {
		if uint64(di.stride) < extent {
			return nil, geomErr(name, "strides["+string(di.name)+"]", "stride %d overlaps inner extent %d", di.stride, extent)
		}
		hi, lo := bits.Mul64(uint64(di.size-1), uint64(di.stride))
		sum, carry := bits.Add64(lo, extent, 0)
		if hi != 0 || carry != 0 {
			return nil, geomErr(name, "shape["+string(di.name)+"]", "extent overflows 64 bits")
		}
		extent = sum
	}
	if _, carry := bits.Add64(d.DataPtr, extent, 0); carry != 0 {
		return nil, geomErr(name, "extent", "data_ptr %#x + extent %d overflows", d.DataPtr, extent)
	}
	if d.StorageBytes != 0 {
		sp := d.StoragePtr
		if d.DataPtr < sp || d.DataPtr-sp > d.StorageBytes || extent > d.StorageBytes-(d.DataPtr-sp) {
			return nil, geomErr(name, "extent", "[%#x, +%d) outside storage [%#x, +%d)", d.DataPtr, extent, sp, d.StorageBytes)
		}
	}

	blk := dims[byName[DimBlocks]]
	t := &tensor{
		name: name, base: d.DataPtr, extent: extent,
		numBlocks: blk.size, blockSize: dims[byName[DimBlockSize]].size,
	}
	if blk.size > 1 {
		t.blockStride = uint64(blk.stride)
	}
	if i, ok := byName[DimKernelBlocks]; ok {
		// a kernel block split: a block is its kernel blocks' tokens
		t.blockSize *= dims[i].size
	}
	if d.BlockTokens != 0 {
		// A state page (vLLM's MambaSpec view: (blocks, heads, 1, state
		// bytes)) holds no tokens; the block still stands for BlockTokens of
		// them in the block table the scheduler's chunks count.
		_, split := byName[DimKernelBlocks]
		switch {
		case d.BlockTokens < 0:
			return nil, geomErr(name, "block_tokens", "negative %d", d.BlockTokens)
		case t.blockSize != 1 || split:
			return nil, geomErr(name, "block_tokens", "%d with a block_size dim of %d tokens (want one state a block)", d.BlockTokens, t.blockSize)
		}
		t.blockSize = d.BlockTokens
	}

	// Dense inner run: the smallest-stride non-block dims that tile memory
	// with no gaps. The head dim must be inside it.
	var inner, outer []dimInfo
	run := uint64(dt)
	dense := true
	for _, di := range sorted {
		if di.name == DimBlocks {
			continue
		}
		if dense && uint64(di.stride) == run {
			run *= uint64(di.size)
			inner = append(inner, di)
			continue
		}
		dense = false
		outer = append(outer, di)
	}
	if h := dims[byName[DimHead]]; h.size > 1 && h.stride != dt {
		return nil, geomErr(name, "strides[head]", "head dim not contiguous (stride %d, dtype size %d)", h.stride, dt)
	}
	t.runLen = run
	nRuns := int64(1)
	for _, di := range outer {
		nRuns *= di.size
		if nRuns > maxRuns {
			return nil, geomErr(name, "strides", "a block splits into more than %d runs", maxRuns)
		}
	}
	t.runs = make([]uint64, 0, nRuns)
	t.runs = appendRuns(t.runs, outer, 0)
	sort.Slice(t.runs, func(a, b int) bool { return t.runs[a] < t.runs[b] })
	t.sig = signature(d, names, inner, outer)
	return t, nil
}

func appendRuns(dst []uint64, outer []dimInfo, off uint64) []uint64 {
	if len(outer) == 0 {
		return append(dst, off)
	}
	for i := int64(0); i < outer[0].size; i++ {
		dst = appendRuns(dst, outer[1:], off+uint64(i*outer[0].stride))
	}
	return dst
}
