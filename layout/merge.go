package layout

import (
	"encoding/binary"
	"sort"
)

// blockMajor recognises per-layer views over one block-major buffer whose
// runs, together, tile every block exactly: vLLM 0.33's block-outermost
// KVCacheLayouts (BLNHC, BLHNC, BHLNC) without page padding, or any other
// per-layer views of a cross-layer allocation. Such a group is copied as the
// cross-layer tensor it is: one run of blockStride bytes per block, so a
// chunk of consecutive block ids is one span for all layers, and scattered
// ids one span per block (instead of one per block and layer).
//
//	buffer:   ┌ block 0: L0 │ L1 │ ... │ Ln ┐┌ block 1: L0 │ ... ┐
//	object:   [ block ids[0], all layers ][ block ids[1], all layers ] ...
//
// The object then holds each block's bytes in address order, not layer by
// layer: a different payload order, so a different fingerprint (sig below).
func blockMajor(ts []*tensor) (*tensor, bool) {
	if len(ts) < 2 || ts[0].blockStride == 0 {
		return nil, false
	}
	s, base := ts[0].blockStride, ts[0].base
	for _, t := range ts {
		if t.blockStride != s || t.numBlocks != ts[0].numBlocks {
			return nil, false
		}
		base = min(base, t.base)
	}
	type piece struct {
		start, end  uint64 // within block 0, from base
		tensor, run int
	}
	var ps []piece
	for i, t := range ts {
		for j, r := range t.runs {
			off := t.base - base + r
			ps = append(ps, piece{off, off + t.runLen, i, j})
		}
	}
	sort.Slice(ps, func(a, b int) bool { return ps[a].start < ps[b].start })
	at := uint64(0)
	for _, p := range ps {
		if p.start != at {
			return nil, false // a gap (padding, another group) or an overlap
		}
		at = p.end
	}
	if at != s {
		return nil, false
	}
	sig := append([]byte(nil), "block-major\x00"...)
	sig = binary.AppendUvarint(sig, uint64(len(ps)))
	for _, p := range ps {
		sig = binary.AppendUvarint(sig, uint64(p.tensor))
		sig = binary.AppendUvarint(sig, uint64(p.run))
	}
	for _, t := range ts {
		sig = binary.AppendUvarint(sig, uint64(len(t.sig)))
		sig = append(sig, t.sig...)
	}
	n := ts[0].numBlocks
	return &tensor{
		name: ts[0].name + ".." + ts[len(ts)-1].name, base: base, extent: uint64(n) * s,
		numBlocks: n, blockSize: ts[0].blockSize, blockStride: s,
		runLen: s, runs: []uint64{0}, sig: sig,
	}, true
}
