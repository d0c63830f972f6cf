package layout

// Small test geometry: 4 blocks of 2 tokens, 2 heads of 4 elements, bf16.
// One (block, layer, K or V) run is 2*2*4*2 = 32 bytes.
const (
	tNB  = 4
	tBS  = 2
	tH   = 2
	tD   = 4
	tDT  = 2
	tRun = tBS * tH * tD * tDT // 32
)

func cuda0() Device { return Device{Kind: CUDA, Index: 0} }

// faNHD is a contiguous FlashAttention NHD layer at base.
func faNHD(name string, base uint64) TensorDesc {
	return TensorDesc{Layer: name, Backend: FlashAttn, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape:   []int64{2, tNB, tBS, tH, tD},
		Strides: []int64{tNB * tRun, tRun, tH * tD * tDT, tD * tDT, tDT}}
}

// faHND: same logical shape, physical (2, blocks, heads, block_size, head).
func faHND(name string, base uint64) TensorDesc {
	return TensorDesc{Layer: name, Backend: FlashAttn, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape:   []int64{2, tNB, tBS, tH, tD},
		Strides: []int64{tNB * tRun, tRun, tD * tDT, tBS * tD * tDT, tDT}}
}

// fiNHD: FlashInfer (blocks, 2, block_size, heads, head), contiguous.
func fiNHD(name string, base uint64) TensorDesc {
	return TensorDesc{Layer: name, Backend: FlashInfer, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape:   []int64{tNB, 2, tBS, tH, tD},
		Strides: []int64{2 * tRun, tRun, tH * tD * tDT, tD * tDT, tDT}}
}

// fiHND: physical (blocks, 2, heads, block_size, head).
func fiHND(name string, base uint64) TensorDesc {
	return TensorDesc{Layer: name, Backend: FlashInfer, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape:   []int64{tNB, 2, tBS, tH, tD},
		Strides: []int64{2 * tRun, tRun, tD * tDT, tBS * tD * tDT, tDT}}
}

// mla: (blocks, block_size, head) with head 8.
func mla(name string, base uint64) TensorDesc {
	return TensorDesc{Layer: name, Backend: MLA, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape:   []int64{tNB, tBS, 8},
		Strides: []int64{tBS * 8 * tDT, 8 * tDT, tDT}}
}

const tL = 3 // layers in the cross-layer tensor; block = 3*2*32 = 192 bytes

// crossNHD: (blocks, layers, 2, block_size, heads, head), contiguous.
func crossNHD(base uint64) TensorDesc {
	return TensorDesc{Layer: "all", Backend: CrossLayer, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape:   []int64{tNB, tL, 2, tBS, tH, tD},
		Strides: []int64{tL * 2 * tRun, 2 * tRun, tRun, tH * tD * tDT, tD * tDT, tDT}}
}

// crossHND: default dim names, physical (blocks, heads, layers, 2, block_size, head).
func crossHND(base uint64) TensorDesc {
	return TensorDesc{Layer: "all", Backend: CrossLayer, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape: []int64{tNB, tL, 2, tBS, tH, tD},
		// head 2, block_size 8, kv 16, layers 32, heads 96, blocks 192
		Strides: []int64{192, 32, 16, 8, 96, 2}}
}

// crossFALogical: FlashAttention's logical cross-layer order
// (layers, kv, blocks, block_size, heads, head) over the NHD buffer.
func crossFALogical(base uint64) TensorDesc {
	d := crossNHD(base)
	d.Dims = []Dim{DimLayers, DimKV, DimBlocks, DimBlockSize, DimHeads, DimHead}
	d.Shape = []int64{tL, 2, tNB, tBS, tH, tD}
	d.Strides = []int64{2 * tRun, tRun, tL * 2 * tRun, tH * tD * tDT, tD * tDT, tDT}
	return d
}

// vLLM 0.33's per-layer view (blocks, heads, block_size, content), content
// = K|V = 2*tD elements; one page = tH*tBS*2*tD*tDT = 64 bytes. The helpers
// are named after the KVCacheLayout whose strides they carry.
const tC, tPage = 2 * tD, tH * tBS * 2 * tD * tDT

func paged(name string, base uint64, blockStride, headStride, tokenStride int64) TensorDesc {
	return TensorDesc{Layer: name, Backend: Paged, Device: cuda0(), DataPtr: base, DTypeSize: tDT,
		Shape:   []int64{tNB, tH, tBS, tC},
		Strides: []int64{blockStride, headStride, tokenStride, tDT}}
}

// pagedLBNHC: physical [layer][block][token][head][content] (vLLM's default).
func pagedLBNHC(name string, base uint64) TensorDesc {
	return paged(name, base, tPage, tC*tDT, tH*tC*tDT)
}

// pagedLBHNC: physical [layer][block][head][token][content] (HND).
func pagedLBHNC(name string, base uint64) TensorDesc {
	return paged(name, base, tPage, tBS*tC*tDT, tC*tDT)
}

// pagedBLNHC: layer l of layers in a block-outermost buffer at base:
// physical [block][layer][token][head][content].
func pagedBLNHC(name string, base uint64, l, layers int64) TensorDesc {
	return paged(name, base+uint64(l*tPage), layers*tPage, tC*tDT, tH*tC*tDT)
}
