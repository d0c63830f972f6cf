package layout

import (
	"fmt"
	"sort"
)

// Layout is the validated geometry of one KV-cache group on one device: the
// tensors in registration order, how each block splits into contiguous runs,
// and the object format of a chunk. A Layout is immutable and safe for
// concurrent use.
type Layout struct {
	group       int
	device      Device
	backend     Backend
	dtypeSize   int
	blockSize   int64
	numBlocks   int64
	chunkTokens int
	blockBytes  uint64 // payload bytes per block, all tensors
	tensors     []*tensor
	fp          [32]byte
}

// New validates the descriptors of one KV-cache group and builds its
// Layout. chunkTokens is the chunk size in tokens (a multiple of the block
// size); Plan refuses any other number of blocks. Descriptor order is the
// object's tensor order: pass layers in the model's order.
func New(descs []TensorDesc, chunkTokens int) (*Layout, error) {
	if len(descs) == 0 {
		return nil, geomErr("", "tensors", "no tensors")
	}
	l := &Layout{group: descs[0].Group, device: descs[0].Device, backend: descs[0].Backend,
		dtypeSize: descs[0].DTypeSize, chunkTokens: chunkTokens}
	names := map[string]bool{}
	for i := range descs {
		d := &descs[i]
		if names[d.Layer] {
			return nil, geomErr(d.Layer, "layer", "registered twice")
		}
		names[d.Layer] = true
		t, err := analyze(d)
		if err != nil {
			return nil, err
		}
		switch {
		case d.Group != l.group:
			return nil, geomErr(d.Layer, "group", "%d mixed with group %d", d.Group, l.group)
		case d.Device != l.device:
			return nil, geomErr(d.Layer, "device", "%v mixed with %v", d.Device, l.device)
		case d.Backend != l.backend:
			return nil, geomErr(d.Layer, "backend", "%s mixed with %s", d.Backend, l.backend)
		case d.DTypeSize != l.dtypeSize:
			return nil, geomErr(d.Layer, "dtype_size", "%d mixed with %d", d.DTypeSize, l.dtypeSize)
		case i > 0 && t.numBlocks != l.numBlocks:
			return nil, geomErr(d.Layer, "shape[blocks]", "%d blocks mixed with %d", t.numBlocks, l.numBlocks)
		case i > 0 && t.blockSize != l.blockSize:
			return nil, geomErr(d.Layer, "shape[block_size]", "%d mixed with %d", t.blockSize, l.blockSize)
		}
		l.numBlocks, l.blockSize = t.numBlocks, t.blockSize
		l.blockBytes += t.blockBytes()
		l.tensors = append(l.tensors, t)
	}
	if l.backend == CrossLayer && len(l.tensors) != 1 {
		return nil, geomErr(descs[1].Layer, "tensors", "cross_layer takes exactly one tensor, got %d", len(descs))
	}
	if chunkTokens <= 0 || int64(chunkTokens)%l.blockSize != 0 {
		return nil, geomErr(descs[0].Layer, "chunk_tokens", "%d is not a positive multiple of block size %d", chunkTokens, l.blockSize)
	}
	if err := checkDisjoint(l.tensors); err != nil {
		return nil, err
	}
	if m, ok := blockMajor(l.tensors); ok {
		l.tensors = []*tensor{m}
	}
	l.fp = fingerprint(l)
	return l, nil
}

// NewGroups splits descriptors by KV-cache group and builds one Layout per
// group, ordered by group id. Layers of different groups may alias memory
// (vLLM's hybrid allocator); inside a group they may not.
func NewGroups(descs []TensorDesc, chunkTokens int) ([]*Layout, error) {
	by := map[int][]TensorDesc{}
	var ids []int
	for _, d := range descs {
		if _, ok := by[d.Group]; !ok {
			ids = append(ids, d.Group)
		}
		by[d.Group] = append(by[d.Group], d)
	}
	sort.Ints(ids)
	out := make([]*Layout, 0, len(ids))
	for _, g := range ids {
		l, err := New(by[g], chunkTokens)
		if err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, nil
}

// checkDisjoint refuses tensors whose bytes overlap. Tensors with disjoint
// address ranges pass at once; interleaved tensors (per-layer views over one
// block-major buffer) must share a block stride and have disjoint runs.
func checkDisjoint(ts []*tensor) error {
	order := make([]*tensor, len(ts))
	copy(order, ts)
	sort.Slice(order, func(a, b int) bool { return order[a].base < order[b].base })
	for i, a := range order {
		for _, b := range order[i+1:] {
			if b.base >= a.base+a.extent {
				break
			}
			if err := checkInterleaved(a, b); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkInterleaved handles a.base <= b.base < a.base+a.extent.
func checkInterleaved(a, b *tensor) error {
	s := a.blockStride
	if s == 0 || s != b.blockStride || a.blockBytes() > s || b.blockBytes() > s ||
		a.runs[len(a.runs)-1]+a.runLen > s || b.runs[len(b.runs)-1]+b.runLen > s {
		return geomErr(b.name, "data_ptr", "overlaps layer %q", a.name)
	}
	// Block j of b against block i of a: only shifts d = j - i that bring the
	// two block footprints within one stride of each other can collide.
	delta := b.base - a.base // >= 0
	q := int64(delta / s)
	for d := -q - 1; d <= -q+1; d++ {
		if d <= -a.numBlocks || d >= b.numBlocks { // d = j - i, i < a.n, j < b.n
			continue
		}
		// b's block j sits delta + d*s bytes after a's block i.
		rel := int64(delta) + d*int64(s)
		if runsOverlap(a.runs, a.runLen, b.runs, b.runLen, rel) {
			return geomErr(b.name, "data_ptr", "runs overlap layer %q", a.name)
		}
	}
	return nil
}

// runsOverlap says whether runs ra (length la) and runs rb shifted by rel
// (length lb) share a byte.
func runsOverlap(ra []uint64, la uint64, rb []uint64, lb uint64, rel int64) bool {
	for _, x := range ra {
		for _, y := range rb {
			ys := int64(y) + rel
			if ys < int64(x)+int64(la) && int64(x) < ys+int64(lb) {
				return true
			}
		}
	}
	return false
}

// Group is the KV-cache group id.
func (l *Layout) Group() int { return l.group }

// Device is where the tensors live.
func (l *Layout) Device() Device { return l.device }

// Backend is the attention backend family.
func (l *Layout) Backend() Backend { return l.backend }

// BlockSize is the tokens per block.
func (l *Layout) BlockSize() int { return int(l.blockSize) }

// NumBlocks is the number of blocks in every tensor of the group.
func (l *Layout) NumBlocks() int64 { return l.numBlocks }

// ChunkTokens is the chunk size Plan expects.
func (l *Layout) ChunkTokens() int { return l.chunkTokens }

// ChunkBlocks is the number of block ids Plan expects.
func (l *Layout) ChunkBlocks() int { return l.chunkTokens / int(l.blockSize) }

// BlockBytes is the payload bytes one block contributes (all tensors).
func (l *Layout) BlockBytes() uint64 { return l.blockBytes }

// NumTensors is the number of registered tensors.
func (l *Layout) NumTensors() int { return len(l.tensors) }

// RunsPerBlock is the number of contiguous runs one block splits into, over
// all tensors: the most spans a single block can need.
func (l *Layout) RunsPerBlock() int {
	n := 0
	for _, t := range l.tensors {
		n += len(t.runs)
	}
	return n
}

func (l *Layout) String() string {
	return fmt.Sprintf("layout{group %d %s %s tensors=%d blocks=%d block_size=%d block_bytes=%d runs/block=%d}",
		l.group, l.device, l.backend, len(l.tensors), l.numBlocks, l.blockSize, l.blockBytes, l.RunsPerBlock())
}
